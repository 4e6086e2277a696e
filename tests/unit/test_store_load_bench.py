"""benchmarks/store_load.py --quick: the store-on load benchmark's own pipeline on a tiny model.

Asserts what must hold on any machine (no failed request, every answered reply in each store,
every sampled item with its text, no other reply with text), never a timing. The benchmark runs
once for the module; the PostgreSQL checks skip, with the reason, where no server can start.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("sqlalchemy", reason="the store extra (SQLAlchemy, Alembic, psycopg) is not installed")

from tests.pg_server import unavailable  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NO_PG = unavailable()
ANSWERED = 8 * 8 + 2  # --quick: 8 clients x 8 requests, plus the 2 warm-up requests


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    out = tmp_path_factory.mktemp("store-load") / "store_load.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        sys.modules.pop("store_load", None)
        import store_load

        rc = store_load.main(["--quick", "--out", str(out), "--record-timing", "20",
                              *(["--no-postgres"] if NO_PG else [])])
    report = json.loads(out.read_text())
    report["rc"] = rc
    yield report


def check_store(report: dict[str, Any], name: str) -> None:
    assert report[name]["errors"] == 0 and report[name]["n"] == 64, report[name]["error_examples"]
    s = report[name]["store"]
    assert s["every_reply_recorded"] and s["recorded"] == s["answered"] == ANSWERED
    assert s["items_without_text"] == 0 and s["unsampled_with_text"] == 0
    assert report[name]["record_timing"]["n"] == 20


# The whole benchmark in quick mode, 40-100 s on 2 cores: `make test-bench`, not `make test`.
pytestmark = pytest.mark.bench

@pytest.mark.slow
def test_no_store_and_sqlite_fail_nothing_and_the_store_holds_every_reply(report: dict[str, Any]) -> None:
    assert report["rc"] == 0
    assert report["none"]["errors"] == 0 and report["none"]["n"] == 64
    check_store(report, "sqlite")


@pytest.mark.slow
@pytest.mark.skipif(NO_PG is not None, reason=f"PostgreSQL not run: {NO_PG}")
def test_postgresql_fails_nothing_and_holds_every_reply(report: dict[str, Any]) -> None:
    assert report["configs"] == ["none", "sqlite", "postgresql"]
    check_store(report, "postgresql")
