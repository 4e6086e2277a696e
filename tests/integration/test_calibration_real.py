"""``guarduq calibrate`` then ``guarduq evaluate --json`` on a few real ARC-Easy items with SmolLM2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from guarduq.calibration import Calibrator
from guarduq.cli import main

pytestmark = pytest.mark.integration

DATA = Path(os.environ.get("GUARDUQ_DATA") or Path(__file__).resolve().parents[2] / ".." / "shared" / "data")
ARC = DATA / "arc_easy" / "ARC-Easy-Dev.jsonl"


@pytest.mark.long
@pytest.mark.skipif(not ARC.is_file(), reason=f"evaluation data not found at {ARC}")
def test_calibrate_then_evaluate_json_contract(tmp_path: Path, real_guard, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "cal.json"
    data = ["--dataset", "arc", "--data", str(ARC), "--limit", "20",
            "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    rc = main(["calibrate", "--model", "smollm2-135m-instruct", *data, "--test-fraction", "0.25",
               "--threshold-fraction", "0.25", "--alpha", "0.3", "--delta", "0.2", "--out", str(out), "--json",
               "--allow-uncertified"])  # 20 items: the JSON contract, certified or not
    assert rc == 0, capsys.readouterr().err
    fit = json.loads(capsys.readouterr().out)
    assert fit["model"]["fingerprint"] == real_guard.info.fingerprint
    assert sum(fit["split_sizes"].values()) == 20

    cal = Calibrator.load(out, expected_fingerprint=real_guard.info.fingerprint)
    assert cal.datasets_[0]["name"] == "arc" and cal.datasets_[0]["n"] == 20
    (cache,) = (tmp_path / "runs" / "cache").rglob("*.jsonl")
    lines_before = cache.read_text().count("\n")
    assert lines_before == 20

    rc = main(["evaluate", "--calibrator", str(out), *data, "--split", "test", "--json"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(capsys.readouterr().out)
    assert cache.read_text().count("\n") == lines_before  # evaluate reused the scoring cache
    assert res["n"] == fit["split_sizes"]["test"]
    assert 0 <= res["accuracy"] <= 1
    assert set(res["auroc"]) >= {"epistemic", "aleatoric", "combined", "mean_logprob", "risk"}
    for key in ("ece_before", "ece_after", "brier", "aurc", "prr"):
        assert key in res
    (g,) = res["guarantees"]
    assert g["alpha"] == 0.3 and g["delta"] == 0.2
    assert set(g) >= {"threshold", "coverage", "error_rate", "held"}
    assert res["model"]["fingerprint"] == real_guard.info.fingerprint
