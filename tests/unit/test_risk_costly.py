"""benchmarks/risk.py's costly-features section (issue 24 item 3) on synthetic records whose answer
is known: P(True) carries the label, the SVE features are pure noise. The section must credit the
first with a paired interval above 0 and not the second, and never list a cascade set."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from guarduq.calibration.evaluation import ScoredItem
from guarduq.calibration.features import FEATURE_SETS
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {"sve_members": 4, "sve_targeted_blocks": 2, "sve_total_blocks": 30, "sve_answer_tokens": 32}


def _risk_module() -> Any:
    return load_benchmark("risk")


def _records(n: int = 300) -> list[ScoredItem]:
    """Three datasets; the free features barely tell right from wrong, P(True) does, SVE is noise."""
    rng = np.random.default_rng(11)
    out = []
    for ds in ("a", "b", "c"):
        lp, pt = rng.normal(0, 1, n), rng.normal(0, 1, n)
        y = (rng.uniform(size=n) >= 1 / (1 + np.exp(-(0.3 - 0.4 * lp - 2.5 * pt)))).astype(int)
        for i in range(n):
            prof = {"embed": 1.0, "head": 0.5, **{f"block.{j}.attn": float(rng.uniform(0.1, 1)) for j in range(3)},
                    **{f"block.{j}.mlp": float(rng.uniform(0.1, 1)) for j in range(3)}}
            scores = {"valid": True, "epistemic": float(rng.uniform(1, 20)), "aleatoric": float(rng.uniform(0, 0.25)),
                      "mean_logprob": float(lp[i] - 2), "min_token_prob": float(rng.uniform(1e-3, 1)),
                      "mean_entropy": float(rng.uniform(0, 3)), "n_tokens": int(rng.integers(1, 30)),
                      "grad_profile": prof, "p_true": float(1 / (1 + np.exp(-pt[i]))),
                      "sve_mean_prob": float(rng.uniform(0.2, 0.9)), "sve_variance": float(rng.uniform(0, 0.02)),
                      "sve_mi": float(rng.uniform(0, 0.5)), "sve_agree": float(rng.integers(0, 2)), **SHAPE}
            out.append(ScoredItem(id=f"{ds}:{i}", dataset=ds, kind="qa", prompt_hash="h", model_fingerprint="f",
                                  response="r", label=int(y[i]), scores=scores, split="fit"))
    return out


def test_costly_section_credits_an_informative_feature_and_not_a_noisy_one(tmp_path: Path) -> None:
    risk = _risk_module()
    lines, fig = risk.analyse_model("tiny", _records(), 200, tmp_path)
    page = "\n".join(lines)
    assert "### Costly features against same-pass (issue 24)" in page
    costly = fig["costly"]
    assert costly["sets"] == ["same-pass+ptrue", "same-pass+sve", "same-pass+ptrue+sve"]
    informative, noise = costly["paired"]["pooled"]["same-pass+ptrue"], costly["paired"]["pooled"]["same-pass+sve"]
    assert informative[1] is not None and informative[1] > 0  # paired interval above 0
    assert noise[1] is not None and noise[1] <= 0  # holds 0, or below it
    assert costly["verdict"]["same-pass+ptrue"].startswith("`same-pass+ptrue`: pooled beats `same-pass`")
    assert "pooled beats" not in costly["verdict"]["same-pass+sve"]
    # Left one dataset out (3 datasets): P(True) still helps on every left-out one.
    assert costly["lodo"] is not None and set(costly["lodo"].rows) == {"a", "b", "c"}
    assert costly["lodo_diff"]["same-pass+ptrue"] > 0.05
    assert "Left one dataset out (fitted on all the others" in page
    # Priced: +1 forward for P(True); the SVE opinion at M = 4, N = 2 of L = 30, + 4 for its answer.
    assert costly["cost"]["same-pass"] == 3.0 and costly["cost"]["same-pass+ptrue"] == 4.0
    assert costly["cost"]["same-pass+sve"] == 3 + 36 / 30 + 4
    assert "| pooled | `same-pass+ptrue` |" in page and "α=0.3 coverage" in page
    # Cascade second stages belong to the cascade benchmark: not measured, not listed as missing.
    assert "cascade" not in page
    assert not {"cascade", "cascade+agree"} & set(fig["sets"])


def test_cascade_sets_are_never_chosen_and_no_section_without_a_costly_set() -> None:
    risk = _risk_module()
    every = tuple({f for v in FEATURE_SETS.values() for f in v})
    assert "first_stage_logit" in every
    sets = risk.measurable_sets(every)
    assert not any("first_stage_logit" in v for v in sets.values()) and "same-pass+sve" in sets
    from _risk_costly import costly_section  # importable once risk.py put benchmarks/ on the path

    free = {"same-pass": FEATURE_SETS["same-pass"]}
    assert costly_section({}, {}, free, {}, Counter(), (0.3,), 10) == ([], {})


def test_free_only_measures_every_answer_when_only_some_hold_costly_features(tmp_path: Path) -> None:
    """make risk's --free-only: answers without P(True)/SVE are not dropped for lacking them."""
    risk = _risk_module()
    records = _records(120)
    for r in records[::2]:  # half the answers were scored without the costly features
        for k in ("p_true", "sve_mean_prob", "sve_variance", "sve_mi", "sve_agree"):
            r.scores.pop(k)
    lines, fig = risk.analyse_model("tiny", records, 50, tmp_path, costly=False)
    assert f"{len(records)} valid for every available feature (0 dropped)" in "\n".join(lines)
    assert fig["costly"] == {} and not any("ptrue" in s or "sve" in s for s in fig["sets"])
    lines, _ = risk.analyse_model("tiny", records, 50, tmp_path)
    assert f"{len(records) // 2} valid for every available feature" in "\n".join(lines)
