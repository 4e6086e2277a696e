"""benchmarks/bf16_risk.py: which answers it re-scores, and that its comparison sees a change
where the scores change and none where they do not (synthetic scores, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from guarduq.calibration.calibrator import Calibrator
from guarduq.calibration.splits import split_of
from tests.conftest import load_benchmark

bench = load_benchmark("bf16_risk")


def _scores(n: int, seed: int) -> tuple[list[dict], np.ndarray]:
    """Answers whose wrongness depends on log p̄ (1 = correct)."""
    rng = np.random.default_rng(seed)
    out, labels = [], []
    for _ in range(n):
        lp = rng.normal(-1, 0.6)
        labels.append(int(rng.uniform() < 1 / (1 + np.exp(-3 * (lp + 1)))))
        p = float(np.exp(lp))
        prof = {"embed": 1.0, "head": 0.5, **{f"block.{j}.{k}": float(rng.uniform(0.1, 1))
                                              for j in range(3) for k in ("attn", "mlp")}}
        out.append({"epistemic": float(np.exp(rng.normal(0, 1) + 2 * lp)), "mean_token_prob": p,
                    "aleatoric": p * (1 - p), "mean_logprob": lp, "min_token_prob": float(rng.uniform(1e-3, 1)),
                    "mean_entropy": float(rng.uniform(0, 3)), "n_tokens": int(rng.integers(1, 30)),
                    "grad_profile": prof, "valid": True})
    return out, np.array(labels)


def _calibrator() -> Calibrator:
    cal = Calibrator(bench.FEATURES)
    cal.fit(*_scores(600, 1))
    cal.fit_thresholds(*_scores(400, 2), alphas=(0.3, 0.5), delta=0.1)
    assert any(t.threshold is not None for t in cal.thresholds_)
    return cal


def test_same_scores_in_both_dtypes_change_nothing() -> None:
    cal = _calibrator()
    scores, y = _scores(300, 3)
    res = bench.compare(cal, scores, [dict(s) for s in scores], y, n_boot=200)
    assert res["risk"]["bf16_minus_fp32"] == (0.0, 0.0, 0.0)
    assert res["risk"]["abs_diff_max"] == 0.0
    assert all(f["changed_side"] == 0 and f["answered_fp32"] == f["answered_bf16"] for f in res["flips"])
    assert res["rel_err"]["mean_logprob"]["max"] == 0.0
    assert res["risk"]["fp32"][0] > 0.7  # log p̄ carries the signal


def test_scores_that_lose_their_signal_lower_the_risk_auroc() -> None:
    cal = _calibrator()
    scores, y = _scores(300, 4)
    rng = np.random.default_rng(5)
    shuffled = rng.permutation([s["mean_token_prob"] for s in scores])
    noisy = [dict(s, mean_token_prob=float(p), mean_logprob=float(np.log(p)), aleatoric=float(p * (1 - p)))
             for s, p in zip(scores, shuffled, strict=True)]
    res = bench.compare(cal, scores, noisy, y, n_boot=200)
    diff, lo, hi = res["risk"]["bf16_minus_fp32"]
    assert hi < 0 and diff < -0.1
    assert res["signals"]["mean_logprob"]["bf16_minus_fp32"][2] < 0
    assert sum(f["changed_side"] for f in res["flips"]) > 0


def test_chosen_test_answers_are_test_split_evenly_shared_and_stable() -> None:
    recs = [SimpleNamespace(id=f"{d}:{i}", dataset=d) for d in ("a", "b", "c") for i in range(300 if d == "a" else 80)]
    small, large = bench.chosen_test(recs, 30), bench.chosen_test(recs, 200)
    assert all(split_of(r.id) == "test" for r in large)
    assert [r.dataset for r in small].count("a") == 10  # the same share from each dataset
    n_b = sum(split_of(f"b:{i}") == "test" for i in range(80))
    assert [r.dataset for r in large].count("b") == n_b  # a small set gives all it has
    assert {r.id for r in small} <= {r.id for r in large}  # a larger n extends a smaller one's choice
