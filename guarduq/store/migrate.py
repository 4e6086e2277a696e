"""Bring a database to the schema this guarduq knows, safely when several processes start at once.

The revisions are Alembic scripts shipped inside the package (``migrations/``), run through
Alembic's API on a connection the store opens, so nothing outside the package (no alembic.ini)
is needed. Concurrency: on PostgreSQL the upgrade runs inside one transaction holding a
transaction-scoped advisory lock; on SQLite inside one ``BEGIN IMMEDIATE`` transaction (the
write lock, waited for through the busy timeout). Either way a second process waits, then finds
the schema at head and does nothing. DDL is transactional on both, so a process killed halfway
leaves the old schema, never half a new one.

A database at a revision this code does not know (written by a newer guarduq) is refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from guarduq._logging import get_logger
from guarduq._version import __version__
from guarduq.errors import StoreError
from guarduq.store.schema import VERSION_TABLE

log = get_logger("store")

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# pg_advisory_xact_lock key: any fixed bigint; this one is crc32("guarduq.store.migrate").
_PG_LOCK_KEY = 0x5D1B_7A43


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


@functools.cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The newest revision this guarduq knows."""
    rev = _script().get_current_head()
    assert rev is not None
    return rev


def known_revisions() -> frozenset[str]:
    return frozenset(s.revision for s in _script().walk_revisions())


def current_revision(conn: Connection) -> str | None:
    """The database's revision (None: no guarduq schema yet)."""
    heads = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_heads()
    if len(heads) > 1:
        raise StoreError(f"the store's schema has several heads {sorted(heads)}; it was edited by hand")
    return heads[0] if heads else None


def _check_known(rev: str | None, where: str) -> None:
    if rev is not None and rev not in known_revisions():
        raise StoreError(
            f"the store at {where} has schema revision {rev!r}, which guarduq {__version__} does not "
            f"know (its newest is {head()!r}): it was written by a newer guarduq; upgrade guarduq "
            "to use it"
        )


def ensure_schema(engine: Engine, where: str) -> bool:
    """Upgrade the database to head unless it is there already; True when it ran an upgrade."""
    target = head()
    with engine.connect() as conn:  # the common case, read only: already at head
        rev = current_revision(conn)
        conn.rollback()
    _check_known(rev, where)
    if rev == target:
        return False
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as conn:
        if sqlite:
            conn.execution_options(guarduq_begin="BEGIN IMMEDIATE")
        with conn.begin():
            if not sqlite:
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
            rev = current_revision(conn)  # again, under the lock: another process may have done it
            _check_known(rev, where)
            if rev == target:
                return False
            cfg = _config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, target)
    log.info("store_migrated", where=where, from_revision=rev, to_revision=target)
    return True
