"""benchmarks/scale.py on synthetic caches: the gain of the gradient term is found where it exists."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from guarduq.calibration.evaluation import ScoredItem
from tests.conftest import load_benchmark


def _cache(path: Path, informative: bool, n_params: int, seed: int) -> None:
    """Four datasets; wrongness depends on log p̄ always, and on log epistemic only if ``informative``."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for ds in ("a", "b", "c", "d"):
            for i in range(400):
                lp, le = rng.normal(-1, 0.5), rng.normal(0, 1)
                logit = -1.5 * (lp + 1) + (2.0 * le if informative else 0.0)
                label = int(rng.uniform() >= 1 / (1 + np.exp(-logit)))  # 1 = correct
                p = float(np.exp(lp))
                prof = {"embed": 1.0, "head": 0.5, **{f"block.{j}.attn": float(rng.uniform(0.1, 1)) for j in range(3)},
                        **{f"block.{j}.mlp": float(rng.uniform(0.1, 1)) for j in range(3)}}
                scores = {"epistemic": float(np.exp(le + 2 * lp)), "mean_token_prob": p, "aleatoric": p * (1 - p),
                          "mean_logprob": lp + float(rng.normal(0, 0.05)), "min_token_prob": float(rng.uniform(1e-3, 1)),
                          "mean_entropy": float(rng.uniform(0, 3)), "n_tokens": int(rng.integers(1, 30)),
                          "n_params": n_params, "grad_profile": prof, "valid": True}
                rec = ScoredItem(id=f"{ds}:{i}", dataset=ds, kind="labelled", prompt_hash="h", model_fingerprint="f",
                                 response="r", label=label, scores=scores, split="fit")
                f.write(json.dumps(asdict(rec)) + "\n")


def test_scale_table_finds_the_gradient_gain_only_where_it_exists(tmp_path: Path) -> None:
    _cache(tmp_path / "small.jsonl", informative=False, n_params=135_000_000, seed=1)
    _cache(tmp_path / "big.jsonl", informative=True, n_params=1_500_000_000, seed=2)
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"short": {"n": 6, "tokens": 32, "ratio": {"all": 2.5, "last_n_blocks=2": 1.2},
                                          "seconds": {"unguarded": 60.0, "all": 150.0, "last_n_blocks=2": 72.0}}}))
    mod = load_benchmark("scale")
    out = tmp_path / "out"
    assert mod.main(["--cache", f"small={tmp_path}/small.jsonl", "--cache", f"big={tmp_path}/big.jsonl",
                     "--cost", f"big={cost}", "--out", str(out), "--n-boot", "200"]) == 0
    res = {r["model"]: r for r in json.loads((out / "scale.json").read_text())}
    # log_epistemic_norm = log e - 2 log p̄ = le: the normalised term carries the signal in "big".
    big, small = res["big"]["pooled"]["gain"], res["small"]["pooled"]["gain"]
    assert big["+ log_epistemic_norm"][1] > 0.02  # the interval lies above 0
    assert small["+ log_epistemic_norm"][1] < 0 < small["+ log_epistemic_norm"][2]  # no gain: 0 inside
    assert res["big"]["pooled"]["singles"]["log_epistemic_norm"][0] > 0.7
    assert abs(res["small"]["pooled"]["singles"]["log_epistemic_norm"][0] - 0.5) < 0.06
    assert set(res["big"]["lodo"]) == {"a", "b", "c", "d"}
    # The four datasets are drawn alike, so the pooled calibrator ranks each one's test items about
    # as well as the pooled test split; each dataset's slice is its own test items only.
    pooled = res["big"]["pooled"]["risk"]["same-pass"]["auroc"][0]
    for d, cell in res["big"]["datasets"].items():
        assert abs(cell["pooled_fit"][0] - pooled) < 0.1, (d, cell["pooled_fit"], pooled)
    assert sum(c["n_test"] for c in res["big"]["datasets"].values()) == res["big"]["pooled"]["n_test"]
    page = (out / "scale.md").read_text()
    for needle in ("| parameters | 135 M | 1,500 M |", "gain of + log_epistemic_norm", "strictest α certified",
                   "2.50× / 1.20×", "10/25/12 s (32 tokens)", "### big", "risk, pooled fit"):
        assert needle in page, needle
    assert (out / "scale_auroc.png").stat().st_size > 5000


def _confounded_cache(path: Path, within: bool, seed: int) -> None:
    """Three datasets whose error rates differ (25%, 50%, 85%) and whose answers are *more* likely
    on the worse ones (Simpson's paradox for a pooled fit); inside each, log p̄ ranks wrong answers
    only if ``within``."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for ds, (base, shift) in {"easy": (-1.1, -1.0), "mid": (0.0, 0.0), "hard": (1.7, 1.0)}.items():
            for i in range(500):
                z = rng.normal(0, 1)
                logit = base - (1.5 * z if within else 0.0)  # P(wrong)
                label = int(rng.uniform() >= 1 / (1 + np.exp(-logit)))
                lp = -1.0 + 0.3 * z + shift  # the hard dataset's answers look confident
                p = float(np.exp(min(lp, -1e-3)))
                scores = {"epistemic": float(np.exp(rng.normal(0, 1) + 2 * lp)), "mean_token_prob": p,
                          "aleatoric": p * (1 - p), "mean_logprob": lp, "min_token_prob": p / 2,
                          "mean_entropy": float(rng.uniform(0, 3)), "n_tokens": int(rng.integers(1, 30)),
                          "n_params": 1_000_000, "valid": True,
                          "grad_profile": {"embed": 1.0, "block.0.attn": 1.0, "block.0.mlp": 1.0,
                                           "block.1.attn": 1.0, "block.1.mlp": float(rng.uniform(0.5, 1)),
                                           "block.2.attn": 1.0, "block.2.mlp": 1.0}}
                rec = ScoredItem(id=f"{ds}:{i}", dataset=ds, kind="labelled", prompt_hash="h", model_fingerprint="f",
                                 response="r", label=label, scores=scores, split="fit")
                f.write(json.dumps(asdict(rec)) + "\n")


def test_a_model_per_dataset_is_compared_with_the_datasets_error_rates(tmp_path: Path) -> None:
    _confounded_cache(tmp_path / "within.jsonl", within=True, seed=3)
    _confounded_cache(tmp_path / "between.jsonl", within=False, seed=4)
    mod = load_benchmark("scale")
    out = tmp_path / "out"
    assert mod.main(["--cache", f"within={tmp_path}/within.jsonl", "--cache", f"between={tmp_path}/between.jsonl",
                     "--out", str(out), "--n-boot", "200"]) == 0
    res = {r["model"]: r["per_group"] for r in json.loads((out / "scale.json").read_text())}
    # Inside each dataset log p̄ ranks: per-dataset fits beat the pooled one, which the confound
    # misleads, and beat knowing the dataset alone.
    assert res["within"]["vs_pooled"][1] > 0 and res["within"]["vs_base_rate"][1] > 0.02
    assert res["within"]["pooled_for"] == {}
    # Only the error rates differ: a model per dataset adds nothing to knowing the dataset.
    assert res["between"]["base_rate"][0] > 0.7
    assert res["between"]["vs_base_rate"][1] < 0 < res["between"]["vs_base_rate"][2]
    # A policy as the Guard decides: on "within", the per-dataset calibrator answers far more at a
    # strict alpha than the pooled one, and every accepted share keeps its error near its alpha.
    pol = res["within"]["policies"]
    assert pol["0.4"]["per_group"]["accepted"] > pol["0.4"]["pooled"]["accepted"] + 0.3
    for model in ("within", "between"):
        for a, d in res[model]["policies"].items():
            for side in ("pooled", "per_group"):
                assert d[side]["error_rate"] is None or d[side]["error_rate"] <= float(a) + 0.05, (model, a, side)
    page = (out / "scale.md").read_text()
    p, g = pol["0.4"]["pooled"], pol["0.4"]["per_group"]
    shown = f"α = 0.4: {p['accepted']:.0%} ({p['error_rate']:.2f}) → {g['accepted']:.0%} ({g['error_rate']:.2f})"
    assert "risk with a model per dataset" in page and shown in page


def test_scale_status_counts_what_is_left_and_prices_it_at_each_sets_own_pace(tmp_path: Path,
                                                                              capsys: Any) -> None:
    with (tmp_path / "m.jsonl").open("w") as f:
        for ds, n, secs in (("a", 30, 2.0), ("b", 10, 36.0)):
            for i in range(n):
                rec = ScoredItem(id=f"{ds}:{i}", dataset=ds, kind="qa", prompt_hash="h", model_fingerprint="f",
                                 response="r", label=1, scores={"valid": True}, split="fit",
                                 seconds=secs + (i % 3 - 1))  # median secs
                f.write(json.dumps(asdict(rec)) + "\n")
    mod = load_benchmark("scale_status")
    assert mod.main(["--cache", f"m={tmp_path}/m.jsonl", "--target", "40", "--datasets", "a,b,c"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["a"] == ["30", "10", "2.0", f"{10 * 2.0 / 3600:.1f}"]
    assert rows["b"] == ["10", "30", "36.0", f"{30 * 36.0 / 3600:.1f}"]
    assert rows["c"] == ["0", "40", "–", "–"]
    assert rows["total"][:5] == ["40", "80", f"{(10 * 2.0 + 30 * 36.0) / 3600:.1f}", "+", "c"]
