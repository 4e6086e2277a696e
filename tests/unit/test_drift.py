"""Drift: PSI and KS against hand-computed values, the rolling monitor, references, the CLI."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from guarduq.calibration.drift import (
    EPS,
    DriftMonitor,
    Reference,
    ks,
    level,
    load_reference,
    psi,
    reference_from_artifact,
)
from guarduq.cli import main
from guarduq.errors import CalibrationError

# A real artifact with evaluation data: the SmolLM2 calibrator of format 1 (a fixture).
SHIPPED = Path(__file__).resolve().parents[2] / "tests/data/calibrator-v1-smollm2.json"


def test_psi_by_hand_two_bins():
    ref = list(range(1, 11))  # median 5.5: shares 0.5 / 0.5
    live = [1, 2, 3, 6, 7, 8, 9, 10, 11, 12]  # 0.3 / 0.7
    expected = (0.3 - 0.5) * math.log(0.3 / 0.5) + (0.7 - 0.5) * math.log(0.7 / 0.5)
    assert psi(ref, live, bins=2) == pytest.approx(expected, abs=1e-12)
    assert psi(ref, ref, bins=2) == 0.0


def test_psi_empty_bin_is_floored_not_infinite():
    ref = [1.0, 2.0, 3.0, 4.0]  # 2 bins: edge 2.5
    live = [10.0, 11.0]  # all in the upper bin
    expected = (EPS - 0.5) * math.log(EPS / 0.5) + (1 - 0.5) * math.log(1 / 0.5)
    assert psi(ref, live, bins=2) == pytest.approx(expected, abs=1e-12)


def test_ks_by_hand_and_against_scipy():
    assert ks([1, 2, 3, 4], [3, 4, 5, 6]) == 0.5
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, 200), rng.normal(0.3, 1, 150)
    assert ks(a, b) == pytest.approx(stats.ks_2samp(a, b).statistic, abs=1e-12)


def test_levels_follow_the_documented_thresholds():
    assert [level(x) for x in (0.0, 0.099, 0.1, 0.249, 0.25, 3.0, math.nan)] == \
        ["ok", "ok", "watch", "watch", "alarm", "alarm", "ok"]


def test_monitor_waits_for_min_n_then_alarms_and_logs(caplog):
    rng = np.random.default_rng(0)
    ref = Reference({"aleatoric": rng.uniform(0, 0.25, 400)}, "test")
    mon = DriftMonitor(ref, window=50, min_n=20)
    for v in rng.uniform(0, 0.25, 19):
        assert mon.observe({"epistemic": 1.0, "aleatoric": float(v)}) == []
    assert mon.snapshot()[0].n == 19 and math.isnan(mon.snapshot()[0].psi)
    caplog.set_level(logging.INFO, logger="guarduq")
    for v in rng.uniform(0.2, 0.25, 50):  # the top fifth of the reference range only
        mon.observe({"epistemic": 1.0, "aleatoric": float(v)})
    state = mon.snapshot()[0]
    assert state.level == "alarm" and state.n == 50 and state.psi >= 0.25
    assert any("drift_level_changed" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_reference_from_the_shipped_calibrator():
    doc = json.loads(SHIPPED.read_text())
    ref = reference_from_artifact(doc)
    assert ref.features == ("log_epistemic", "aleatoric")
    n = len(doc["evaluation_data"]["epistemic"])
    assert ref.values["aleatoric"].tolist() == doc["evaluation_data"]["aleatoric"][:n]
    assert ref.values["log_epistemic"][0] == pytest.approx(math.log(doc["evaluation_data"]["epistemic"][0]))


def test_artifact_without_evaluation_data_names_the_fallback():
    doc = {**json.loads(SHIPPED.read_text()), "evaluation_data": None}
    with pytest.raises(CalibrationError, match="--reference"):
        reference_from_artifact(doc)
    doc = json.loads(SHIPPED.read_text())
    doc["features"] = ["log_epistemic", "mean_entropy"]  # not stored in evaluation_data
    with pytest.raises(CalibrationError, match="mean_entropy"):
        reference_from_artifact(doc)


def _audit(path: Path, epistemic: list[float], aleatoric: list[float], torn: bool = False) -> None:
    lines = [json.dumps({"request_id": str(i), "scores": {"epistemic": e, "aleatoric": a, "valid": True}})
             for i, (e, a) in enumerate(zip(epistemic, aleatoric, strict=True))]
    path.write_text("\n".join(lines) + "\n" + ('{"request_id": "x", "sco' if torn else ""))


def _fitted_scores(n: int, seed: int = 0) -> tuple[list[dict], list[int]]:
    rng = np.random.default_rng(seed)
    scores = [
        {"epistemic": float(np.exp(rng.normal(3, 1))), "aleatoric": float(rng.uniform(0, 0.25)),
         "mean_logprob": float(rng.normal(-2, 1)), "min_token_prob": float(rng.uniform(1e-3, 1)),
         "mean_entropy": float(rng.uniform(0, 3)), "n_tokens": int(rng.integers(1, 30)), "valid": True}
        for _ in range(n)
    ]
    return scores, [int(x) for x in rng.integers(0, 2, n)]


def test_fit_split_reference_is_stored_and_preferred(tmp_path):
    from guarduq.calibration import Calibrator
    from guarduq.calibration.features import feature_matrix

    scores, labels = _fitted_scores(1000)
    scores[0] = {**scores[0], "valid": False}  # excluded from the fit, so from the reference too
    cal = Calibrator("paper+likelihood", C=1.0).fit(scores, labels)
    cal.save(tmp_path / "cal.json", include_evaluation_data=False)
    doc = json.loads((tmp_path / "cal.json").read_text())
    # Every watched feature (the paper pair, then the calibrator's own) is summarised by 201
    # quantiles of the 999 valid fitted rows, computed here independently.
    assert list(doc["reference"]) == ["log_epistemic", "aleatoric", "mean_logprob",
                                      "log_min_token_prob", "mean_entropy", "log_n_tokens"]
    X, ok = feature_matrix(scores, list(doc["reference"]))
    for j, f in enumerate(doc["reference"]):
        expect = np.quantile(X[ok, j], np.linspace(0, 1, 201))
        np.testing.assert_allclose(doc["reference"][f], expect, rtol=1e-12)
        assert ks(X[ok, j], doc["reference"][f]) <= 1 / 200 + 1e-9
    # No evaluation data is needed any more, and mean_entropy (absent from evaluation_data) is watched.
    ref = reference_from_artifact(doc)
    assert ref.source.startswith("calibrator fit split (n=999")
    assert "mean_entropy" in ref.features
    # The reference survives a load/save round trip.
    again = Calibrator.load(tmp_path / "cal.json")
    assert again.to_dict()["reference"] == doc["reference"]
    # Without it (artifacts written before), the evaluation data is the fallback, as before.
    old = {**doc, "reference": None}
    with pytest.raises(CalibrationError, match="evaluation_data"):
        reference_from_artifact(old)


def test_drift_cli_ok_on_reference_like_traffic_and_alarm_on_shifted(tmp_path, capsys):
    doc = json.loads(SHIPPED.read_text())
    e, a = doc["evaluation_data"]["epistemic"], doc["evaluation_data"]["aleatoric"]
    same = tmp_path / "same.jsonl"
    _audit(same, e, a, torn=True)
    png = tmp_path / "drift.png"
    assert main(["drift", "--audit", str(same), "--calibrator", str(SHIPPED), "--out", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[0])
    assert out["skipped_lines"] == 1 and out["n_live"] == len(e)
    assert all(f["psi"] == 0.0 and f["level"] == "ok" for f in out["features"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shifted = tmp_path / "shifted.jsonl"
    _audit(shifted, [x * 50 for x in e], a)
    assert main(["drift", "--audit", str(shifted), "--calibrator", str(SHIPPED), "--fail-on-alarm"]) == 1
    text = capsys.readouterr().out
    assert "log_epistemic" in text and "alarm" in text


def test_reference_from_scores_jsonl(tmp_path):
    path = tmp_path / "ref.jsonl"
    path.write_text("\n".join(json.dumps({"epistemic": 2.0 ** i, "aleatoric": 0.01 * i}) for i in range(5)))
    ref = load_reference(path)
    assert ref.values["log_epistemic"].tolist() == pytest.approx([i * math.log(2) for i in range(5)])
