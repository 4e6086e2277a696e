"""benchmarks/cascade.py on synthetic caches: it credits a second opinion that separates the
band's answers, and does not credit one that is noise (the page and results.json say which)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from guarduq.calibration.evaluation import ScoreCache, ScoredItem
from tests.conftest import load_benchmark

SHAPE = {"sve_members": 4, "sve_targeted_blocks": 2, "sve_total_blocks": 30, "sve_answer_tokens": 8}


def _cache(path: Path, informative: bool, n: int = 900) -> None:
    rng = np.random.default_rng(3)
    cache = ScoreCache(path)
    for ds in ("a", "b"):
        y = (rng.uniform(size=n) < 0.55).astype(int)
        for i in range(n):
            prof = {"embed": 1.0, "head": 0.5, **{f"block.{j}.attn": float(rng.uniform(0.1, 1)) for j in range(3)},
                    **{f"block.{j}.mlp": float(rng.uniform(0.1, 1)) for j in range(3)}}
            good = y[i] == 1
            sve = (0.75 if good else 0.3) + rng.normal(0, 0.1) if informative else rng.uniform(0.2, 0.9)
            scores = {"valid": True, "epistemic": float(rng.uniform(1, 20)), "aleatoric": float(rng.uniform(0, 0.25)),
                      "mean_logprob": float((0.6 if good else -0.6) + rng.normal(0, 1.2) - 2),
                      "min_token_prob": float(rng.uniform(1e-3, 1)), "mean_entropy": float(rng.uniform(0, 3)),
                      "n_tokens": int(rng.integers(1, 30)), "grad_profile": prof,
                      "sve_mean_prob": float(np.clip(sve, 0.01, 0.99)), "sve_variance": float(rng.uniform(0, 0.02)),
                      "sve_mi": float(rng.uniform(0, 0.5)), "sve_agree": float(rng.integers(0, 2)), **SHAPE}
            cache.append(ScoredItem(id=f"{ds}:{i}", dataset=ds, kind="qa", prompt_hash="h", model_fingerprint="f",
                                    response="r", label=int(y[i]), scores=scores, split="fit"))


@pytest.mark.parametrize("informative", [True, False])
def test_cascade_bench_credits_only_a_second_opinion_that_separates_the_band(tmp_path: Path, informative: bool) -> None:
    bench = load_benchmark("cascade")
    _cache(tmp_path / "c.jsonl", informative)
    out = tmp_path / "out"
    assert bench.main(["--cache", str(tmp_path / "*.jsonl"), "--out", str(out), "--n-boot", "200",
                       "--alpha", "0.35", "--alpha", "0.4", "--policy-alpha", "0.4"]) == 0
    res = json.loads((out / "results.json").read_text())
    page = (out / "README.md").read_text()
    assert (out / "cascade_coverage.png").stat().st_size > 1000 and "### Goal" in page
    rows = [res["alphas"][a][bench.MAIN] for a in ("0.35", "0.4")]
    assert all(r["paid"] < 0.4 for r in rows)  # about a third of the test answers fall in the band
    best = max(rows, key=lambda r: r["coverage_gain"])
    if informative:
        assert best["coverage_gain"] >= 0.05 and best["coverage_gain_ci"][0] > 0 and "≥ 5 points: met" in page
        assert res["band_auroc"]["0.4"]["sve_mean_prob"][0] > 0.8  # inside the band the SVE separates
    else:
        assert best["coverage_gain_ci"][0] <= 0.01 and "≥ 5 points: met" not in page
        assert res["band_auroc"]["0.4"]["sve_mean_prob"][1] < 0.5 < res["band_auroc"]["0.4"]["sve_mean_prob"][2]
