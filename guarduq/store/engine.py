"""Which database a store URL names, and one SQLAlchemy Engine per store set up for it.

SQLite (the embedded default, ``sqlite:///path.db`` or a bare file path):

- WAL journal: readers (the review page) never block the writer (the Guard), and a commit is
  one append to the WAL.
- ``synchronous=FULL``: each commit fsyncs the WAL, so a committed label survives power loss,
  not only a killed process (``NORMAL`` would keep it through ``kill -9`` but may lose the last
  commits on power loss). It costs one fsync per commit, small next to a scored reply.
- every write transaction is ``BEGIN IMMEDIATE``: it takes the write lock up front, so two
  writers (threads or processes) queue on the busy timeout instead of failing with "database is
  locked" when a read turns into a write.
- foreign keys on (SQLite leaves them off per connection).

PostgreSQL: ``postgresql://`` is read as ``postgresql+psycopg://`` (psycopg 3, the driver the
``store`` extra installs).
"""

from __future__ import annotations

import functools
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import StaticPool

from guarduq.errors import StoreError, StoreInputError

BUSY_TIMEOUT_S = 30.0
_SQLITE_DRIVERS = ("sqlite", "sqlite+pysqlite")
_PG_DRIVERS = ("postgresql", "postgres", "postgresql+psycopg")
_EXAMPLES = "use sqlite:///path/to/store.db (or a file path) or postgresql://user@host:5432/dbname"

# Strict JSON: non-finite floats are turned into None before they get here (``convert.clean``);
# one that slips through fails loudly rather than writing NaN, which is not JSON.
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True)
class Target:
    """A validated store URL."""

    url: URL
    backend: str  # "sqlite" or "postgresql"
    where: str  # for messages: the URL without its password
    memory: bool = False  # an in-memory SQLite database (one connection, lost on close)


def parse_url(raw: str) -> Target:
    """Validate a store URL; a string without ``://`` is a SQLite file path."""
    if not isinstance(raw, str) or not raw.strip():
        raise StoreInputError(f"empty store URL; {_EXAMPLES}")
    raw = raw.strip()
    if "://" not in raw:
        return _sqlite_target(URL.create("sqlite", database=raw))
    try:
        url = make_url(raw)
    except ArgumentError as exc:
        raise StoreInputError(f"cannot read store URL {raw!r}: {exc}; {_EXAMPLES}") from None
    driver = url.drivername.lower()
    if driver in _SQLITE_DRIVERS:
        return _sqlite_target(url.set(drivername="sqlite"))
    if driver in _PG_DRIVERS:
        url = url.set(drivername="postgresql+psycopg")
        if not url.database:
            raise StoreInputError(f"store URL {_hidden(url)!r} names no database; {_EXAMPLES}")
        return Target(url=url, backend="postgresql", where=_hidden(url))
    raise StoreInputError(
        f"store URL {_hidden(url)!r} has scheme {url.drivername!r}, which the store does not "
        f"support; {_EXAMPLES}"
    )


def _hidden(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def _sqlite_target(url: URL) -> Target:
    database = url.database or ""
    if database in ("", ":memory:"):
        return Target(url=url.set(database=":memory:"), backend="sqlite", where="sqlite (in memory)", memory=True)
    path = Path(database).expanduser()
    try:
        if b"\x00" in str(path).encode("utf-8"):
            raise ValueError("the path contains a NUL character")
        if path.is_dir():
            raise StoreError(f"cannot open the store at {path}: it is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        if isinstance(exc, StoreError):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise StoreError(f"cannot open the store at {path}: {reason}") from None
    url = url.set(database=str(path.resolve()))
    return Target(url=url, backend="sqlite", where=f"sqlite:///{path.resolve()}")


def make_engine(target: Target, *, echo: bool = False) -> Engine:
    """One Engine (a connection pool) for the whole store; sessions are short, per call."""
    if target.backend == "postgresql":
        try:
            import psycopg  # noqa: F401 - SQLAlchemy would say less when it is missing
        except ImportError as exc:
            raise StoreError(
                f"a PostgreSQL store needs psycopg 3 ({exc}): pip install 'guarduq[store]'"
            ) from exc
        return create_engine(
            target.url,
            echo=echo,
            json_serializer=_dumps,
            pool_pre_ping=True,  # a restarted server costs one failed ping, not one failed call
            # No call waits forever on a lost server or a held lock (the writer thread would stall)
            connect_args={"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30,
                          "options": "-c statement_timeout=30000 -c lock_timeout=10000"},
        )
    engine = create_engine(
        target.url,
        echo=echo,
        json_serializer=_dumps,
        connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_S},
        **({"poolclass": StaticPool} if target.memory else {}),
    )
    memory = target.memory

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver leaves transactions to us (see _on_begin)
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if not memory:
                _retry_locked(lambda: cur.execute("PRAGMA journal_mode = WAL"))
            cur.execute("PRAGMA synchronous = FULL")
            cur.execute("PRAGMA foreign_keys = ON")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(conn.get_execution_options().get("guarduq_begin", "BEGIN"))

    return engine


def _retry_locked(fn: Any, attempts: int = 50) -> Any:
    """Switching a new file to WAL needs a moment of exclusive access; wait for it."""
    for i in range(attempts):
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or i == attempts - 1:
                raise
            time.sleep(0.05)
    return None
