"""benchmarks/reload.py --quick: the reload benchmark's own pipeline on a tiny model (seconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]


# The whole benchmark in quick mode, 40-100 s on 2 cores: `make test-bench`, not `make test`.
pytestmark = pytest.mark.bench

@pytest.mark.slow
def test_reload_quick_fails_no_request_and_prints_the_p99_ratio(capsys, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("reload", None)
    import reload

    out = tmp_path / "reload.json"
    assert reload.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "p99 during reload / steady p99 = " in printed
    report = json.loads(out.read_text())
    assert report["steady"]["errors"] == 0 and report["reloading"]["errors"] == 0
    assert report["reloading"]["reloads"] >= 1 and report["reloading"]["reloads_ok"] == report["reloading"]["reloads"]
    assert report["replies_named_a_served_calibrator"] is True and report["p99_ratio"] > 0
    assert any('outcome="ok"' in x and not x.endswith(" 0.0") for x in report["server_reloads_total"])
