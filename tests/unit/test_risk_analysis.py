"""The risk analysis: bootstrap AUROC, sign stability and leave-one-dataset-out on synthetic data
whose answer is known, and a smoke run of benchmarks/risk.py on a synthetic scoring cache."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from guarduq.calibration.analysis import (
    Candidate,
    bootstrap_auroc,
    choose_candidate,
    coefficient_signs,
    leave_one_dataset_out,
    paired_bootstrap_diff,
    robust_single,
    robust_single_rule,
    select_features,
    sign_stable,
    sign_stable_rule,
)
from guarduq.calibration.evaluation import ScoredItem
from guarduq.calibration.features import FEATURE_SETS
from guarduq.errors import CalibrationError
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
# log_epistemic's direction: + on a and b, - on c and d; mean_logprob: the same on all four.
FLIPS = {"a": 2.0, "b": 2.0, "c": -2.0, "d": -2.0}


def dataset(direction: float, n: int = 300, seed: int = 0) -> tuple[list[dict], np.ndarray]:
    rng = np.random.default_rng(seed)
    le, lp = rng.normal(0, 1, n), rng.normal(0, 1, n)
    p_wrong = 1 / (1 + np.exp(-(direction * le - 1.0 * lp)))
    y = (rng.uniform(size=n) >= p_wrong).astype(int)
    dicts = [
        {"epistemic": float(np.exp(a)), "aleatoric": float(rng.uniform(0, 0.25)), "mean_logprob": float(b - 2),
         "min_token_prob": float(rng.uniform(1e-3, 1)), "mean_entropy": float(rng.uniform(0, 3)),
         "n_tokens": int(rng.integers(1, 30)), "valid": True}
        for a, b in zip(le, lp, strict=True)
    ]
    return dicts, y


GROUPS = {k: dataset(v, seed=i) for i, (k, v) in enumerate(FLIPS.items())}


def test_bootstrap_auroc_matches_sklearn() -> None:
    rng = np.random.default_rng(0)
    wrong = rng.integers(0, 2, 200)
    sig = wrong + rng.normal(0, 1.5, 200)
    auc, lo, hi = bootstrap_auroc(wrong, sig, n_boot=300)
    assert auc == pytest.approx(roc_auc_score(wrong, sig))
    assert lo < auc < hi and hi - lo < 0.3
    assert bootstrap_auroc(np.zeros(5), np.arange(5.0)) == (None, None, None)


def test_paired_bootstrap_diff_resamples_both_signals_on_the_same_items() -> None:
    rng = np.random.default_rng(0)
    wrong = rng.integers(0, 2, 400)
    base = wrong + rng.normal(0, 1.5, 400)
    better = base + 0.3 * wrong  # the same signal plus a little more information
    diff, lo, hi = paired_bootstrap_diff(wrong, better, base, n_boot=500)
    assert diff == pytest.approx(roc_auc_score(wrong, better) - roc_auc_score(wrong, base))
    assert 0 < lo < diff < hi
    # Unpaired, the two intervals overlap although the paired one excludes zero: the shared
    # items' noise is what pairing removes.
    _, lo_b, hi_b = bootstrap_auroc(wrong, better, n_boot=500)
    _, lo_a, hi_a = bootstrap_auroc(wrong, base, n_boot=500)
    assert lo_b < hi_a and hi - lo < min(hi_b - lo_b, hi_a - lo_a)
    assert paired_bootstrap_diff(wrong, base, base, n_boot=50) == (0.0, 0.0, 0.0)
    assert paired_bootstrap_diff(np.ones(5), np.arange(5.0), np.arange(5.0)) == (None, None, None)


def test_sign_flip_is_found() -> None:
    coefs = coefficient_signs(GROUPS, FEATURE_SETS["paper+likelihood"])
    assert coefs["a"]["log_epistemic"] > 0 > coefs["d"]["log_epistemic"]
    assert all(c["mean_logprob"] < 0 for c in coefs.values())
    stable = sign_stable(coefs)
    assert "mean_logprob" in stable and "log_epistemic" not in stable


def test_select_features_sign_stable_rule() -> None:
    base = FEATURE_SETS["paper+likelihood"]
    kept = select_features("sign-stable", GROUPS, base)
    assert "mean_logprob" in kept and "log_epistemic" not in kept
    # Two datasets that agree on epistemic's direction keep it: the rule reads the data given.
    assert "log_epistemic" in select_features("sign-stable", {k: GROUPS[k] for k in ("a", "b")}, base)
    with pytest.raises(CalibrationError, match="at least 2 datasets"):
        select_features("sign-stable", {"a": GROUPS["a"]}, base)
    scores, y = GROUPS["b"]  # a one-class dataset cannot be fitted, so it does not count
    with pytest.raises(CalibrationError, match="got 1 of 2"):
        select_features("sign-stable", {"a": GROUPS["a"], "x": (scores, np.ones_like(y))}, base)
    with pytest.raises(CalibrationError, match="unknown feature rule"):
        select_features("lucky", GROUPS, base)


def test_lodo_prefers_the_sign_stable_choice() -> None:
    cands = [
        Candidate("paper", FEATURE_SETS["paper"]),
        Candidate("paper+likelihood", FEATURE_SETS["paper+likelihood"]),
        Candidate("sign-stable", sign_stable_rule(FEATURE_SETS["paper+likelihood"])),
    ]
    res = leave_one_dataset_out(GROUPS, cands, ("log_epistemic", "mean_logprob"), n_boot=0)
    # Each training fold holds both directions of log_epistemic, so the rule drops it every time.
    assert all("log_epistemic" not in res.features[d]["sign-stable"] for d in GROUPS)
    assert all("mean_logprob" in res.features[d]["sign-stable"] for d in GROUPS)
    summ = res.summary()
    # Fitted on data where epistemic mostly points one way, the paper's pair is worse than a coin
    # on some left-out dataset; the sign-stable choice never is.
    assert summ["paper"]["min_auroc"] < 0.5 <= summ["sign-stable"]["min_auroc"]
    assert summ["sign-stable"]["mean_auroc"] > summ["paper"]["mean_auroc"]
    name, reason = choose_candidate(res)
    assert name == "sign-stable" and "never fell below 0.5" in reason
    # Best single in hindsight: mean_logprob (log_epistemic averages to a coin).
    assert res.best_single()[0] == "mean_logprob"


def test_robust_single_keeps_the_signal_that_never_flips() -> None:
    free = FEATURE_SETS["same-pass"]
    # log_epistemic is the strongest signal on a and b but backwards on c and d.
    assert robust_single({k: GROUPS[k] for k in ("a", "b")}, free) == ("log_epistemic",)
    assert robust_single(GROUPS, free) == ("mean_logprob",)
    # A one-class dataset says nothing about ranking and is skipped, not counted as a failure.
    scores, y = GROUPS["c"]
    one_class = (scores, np.ones_like(y))
    assert robust_single({"a": GROUPS["a"], "x": one_class}, free) == ("log_epistemic",)
    res = leave_one_dataset_out(GROUPS, [Candidate("robust-single", robust_single_rule(free))],
                                ("log_epistemic", "mean_logprob"), n_boot=0)
    assert all(res.features[d]["robust-single"] == ("mean_logprob",) for d in GROUPS)
    # One feature, fitted in the direction the training data agree on: it ranks like that signal.
    for d in GROUPS:
        assert res.rows[d]["robust-single"]["auroc"] == pytest.approx(res.singles[d]["mean_logprob"])


# --------------------------------------------------------------------------- the pipeline


def _load_risk_module() -> Any:
    return load_benchmark("risk")


def test_pipeline_smoke_on_a_synthetic_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.jsonl"
    rng = np.random.default_rng(3)
    with cache.open("w") as f:
        for k, (dicts, y) in GROUPS.items():
            for i, (d, lab) in enumerate(zip(dicts[:120], y[:120], strict=True)):
                prof = {"embed": 1.0, "head": 0.5, **{f"block.{j}.attn": float(rng.uniform(0.1, 1)) for j in range(3)},
                        **{f"block.{j}.mlp": float(rng.uniform(0.1, 1)) for j in range(3)}}
                rec = ScoredItem(id=f"{k}:{i}", dataset=k, kind="labelled", prompt_hash="h", model_fingerprint="f",
                                 response="r", label=int(lab), scores={**d, "grad_profile": prof}, split="fit")
                f.write(json.dumps(asdict(rec)) + "\n")
        f.write('{"id": "torn')  # a live writer's half-written last line is ignored, not repaired
    before = cache.read_bytes()
    # A second cache file (calibrate writes one per dataset) repeating ten items: merged, counted once.
    (tmp_path / "cache-2.jsonl").write_text("".join(before.decode().splitlines(keepends=True)[:10]))
    mod = _load_risk_module()
    assert mod.main(["--cache", f"tiny={tmp_path}/cache*.jsonl", "--out", str(tmp_path / "out"), "--n-boot", "50"]) == 0
    assert cache.read_bytes() == before  # read-only
    page = (tmp_path / "out" / "risk.md").read_text()
    assert "480 usable answers" in page
    for needle in ("## tiny", "Leave one dataset out", "Choice for traffic unlike", "Goals of issue 12",
                   "| pooled |", "same-pass", "sign stable", "α=0.3 coverage", "sign-stable/within",
                   "| floor (95%) |", "(paired difference ", "forward-pass equivalents", "`same-pass` 3.00"):
        assert needle in page, needle
    for fig in ("auroc", "coverage", "lodo"):
        assert (tmp_path / "out" / f"risk_tiny_{fig}.png").stat().st_size > 1000


def test_load_cache_keeps_the_latest_record_of_each_item(tmp_path: Path) -> None:
    # A loader fix changed item a's options: its re-scored record (new prompt hash) follows the
    # stale one. Item c was re-scored and failed: it drops out rather than fall back to stale data.
    def rec(i: str, h: str, label: int | None) -> str:
        return json.dumps(asdict(ScoredItem(id=i, dataset="d", kind="mc", prompt_hash=h, model_fingerprint="f",
                                            response="r", label=label, scores={"valid": True}, split="fit"))) + "\n"

    path = tmp_path / "c.jsonl"
    path.write_text(rec("a", "old", 0) + rec("b", "h", 1) + rec("c", "old", 1) + rec("a", "new", 1) + rec("c", "new", None))
    got = _load_risk_module().load_cache(path)
    assert sorted((r.id, r.prompt_hash, r.label) for r in got) == [("a", "new", 1), ("b", "h", 1)]


def test_within_candidate_keeps_the_direction_a_pooled_fit_loses() -> None:
    """Simpson's paradox across four datasets: inside each, a larger mean_entropy means a likelier
    error; across them, the datasets with larger entropy have far lower error rates. Left out one
    at a time, the pooled fit ranks the left-out dataset backwards, the within fit does not."""
    rng = np.random.default_rng(7)
    groups = {}
    for g, name in enumerate("pqrs"):
        x = rng.normal(0, 0.5, 400) + 1.5 * g + 1.0
        p_wrong = 1 / (1 + np.exp(-(2.0 * (x - 1.5 * g - 1.0) + 2.0 - 1.8 * g)))
        y = (rng.uniform(size=400) >= p_wrong).astype(int)
        groups[name] = ([{"mean_entropy": float(v), "valid": True} for v in x], y)
    res = leave_one_dataset_out(groups, [Candidate("pooled", ("mean_entropy",)),
                                         Candidate("within", ("mean_entropy",), within=True)],
                                ("mean_entropy",))
    summ = res.summary()
    assert summ["pooled"]["min_auroc"] < 0.4 and summ["within"]["min_auroc"] > 0.65
    assert all(res.rows[d]["within"]["coefficients"]["mean_entropy"] > 0 for d in groups)
    assert choose_candidate(res)[0] == "within"
