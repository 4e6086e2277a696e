"""Store fixtures: every API test runs on SQLite and on PostgreSQL (``pg_database_url``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy", reason="the store extra (SQLAlchemy, Alembic, psycopg) is not installed")
pytest.importorskip("alembic", reason="the store extra (SQLAlchemy, Alembic, psycopg) is not installed")

from guarduq.store import Store  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "postgres: needs PostgreSQL binaries (initdb, pg_ctl); skipped without")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL for an empty store: a SQLite file, then a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return str(request.getfixturevalue("pg_database_url"))


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = Store(store_url)
    yield s
    s.close()
