"""Alembic revisions of the store's schema, run by ``guarduq.store.migrate`` (no alembic.ini)."""
