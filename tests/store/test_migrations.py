"""The schema is versioned: created at head, not re-run, newer revisions refused, models = DDL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from guarduq.errors import StoreError
from guarduq.store import Store, migrate
from guarduq.store.engine import parse_url
from guarduq.store.schema import VERSION_TABLE, Base
from tests.store.support import UNIFORM, reply


def _engine(url: str):  # a plain engine, outside the store
    return create_engine(parse_url(url).url)


def test_fresh_database_gets_head(store_url: str) -> None:
    with Store(store_url):
        pass
    engine = _engine(store_url)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head() == "0002"
        tables = set(inspect(conn).get_table_names())
    engine.dispose()
    assert {"replies", "review_items", "labels", VERSION_TABLE} <= tables


def test_models_match_the_migrations(store_url: str) -> None:
    """A model changed without a revision (or the reverse) shows up here."""
    with Store(store_url):
        pass
    engine = _engine(store_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    assert diff == []


def test_second_store_does_not_rerun(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store(store_url) as s:
        s.record(reply(1), UNIFORM)

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("upgrade ran on a database already at head")

    monkeypatch.setattr(migrate.command, "upgrade", boom)
    with Store(store_url) as s:
        assert s.count() == 1


def test_newer_revision_is_refused(store_url: str) -> None:
    with Store(store_url):
        pass
    engine = _engine(store_url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '0042_from_the_future'"))
    engine.dispose()
    with pytest.raises(StoreError, match=r"schema revision '0042_from_the_future', which guarduq .* does "
                                         r"not know \(its newest is '0002'\): it was written by a newer guarduq"):
        Store(store_url)


def test_existing_tables_of_another_app_are_left_alone(store_url: str) -> None:
    engine = _engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('abc123')"))  # the host app's own
    with Store(store_url) as s:
        s.record(reply(1), UNIFORM)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "abc123"
    engine.dispose()


def test_a_store_at_0001_upgrades_keeping_its_replies_and_then_holds_group_and_drift(store_url: str) -> None:
    """0002 adds each reply's traffic group and drift case; replies written before read None."""
    engine = _engine(store_url)
    with engine.begin() as conn:
        cfg = migrate._config()
        cfg.attributes["connection"] = conn
        migrate.command.upgrade(cfg, "0001")
        assert migrate.current_revision(conn) == "0001"
        cols = {c["name"] for c in inspect(conn).get_columns("replies")}
        assert "group_name" not in cols
        conn.execute(text(
            "INSERT INTO replies (request_id, time, parameter_set, scores, shown, escalated, ended) "
            "VALUES ('old1', '2025-03-01 12:00:00', 'all', '{}', true, false, true)"))
    engine.dispose()
    with Store(store_url) as s:  # opening upgrades to head
        old = s.reply("old1")
        assert old is not None and old.group is None and old.drift is None
        s.record(reply(2, group="support", drift="unseen"), UNIFORM)
        s.record(reply(3, group="legal", drift="slice:arc"), UNIFORM)
        s.record(reply(4), UNIFORM)
        new = s.reply("req0002")
        assert new is not None and (new.group, new.drift) == ("support", "unseen")
        assert [r.request_id for r in s.queue(group="legal")] == ["req0003"]
        assert s.count(group="support") == 1 and s.count() == 3
        assert s.groups() == {"legal": 1, "support": 1}
        assert s.progress(group="support")["items"] == 1 and s.progress()["items"] == 3
    engine = _engine(store_url)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == "0002"
    engine.dispose()
