"""Alembic's entry point for the store: runs on the connection ``guarduq.store.migrate`` passes.

There is no alembic.ini and no URL here: the store opens the connection, takes its lock and its
transaction, and hands the connection over in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

from guarduq.errors import StoreError
from guarduq.store.schema import VERSION_TABLE, Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise StoreError("the store's migrations run through guarduq.store (Store opens the database)")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
)
with context.begin_transaction():  # inside the caller's transaction: committed by the caller
    context.run_migrations()
