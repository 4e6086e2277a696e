"""Features and feature sets: values against hand computations, the gradient profile, missing
values (unavailable, never a crash), and the named sets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from guarduq.calibration import (
    COSTLY,
    DEFAULT_FEATURES,
    FEATURE_DOCS,
    FEATURE_SETS,
    FEATURES,
    ORIENTATION,
    Calibrator,
    feature_matrix,
    missing_features,
    resolve_features,
)
from guarduq.errors import CalibrationError

BASE = {
    "epistemic": 20.0,
    "aleatoric": 0.21,
    "mean_token_prob": 0.7,
    "mean_logprob": -1.5,
    "min_token_prob": 1e-5,
    "mean_entropy": 1.3,
    "n_tokens": 13,
    "valid": True,
}
# 6 blocks: early third = blocks 0-1, late third = blocks 4-5.
PROFILE = {
    "embed": 2.0,
    "head": 1.0,
    "final_norm": 0.5,
    **{f"block.{i}.attn": 1.0 + i for i in range(6)},
    **{f"block.{i}.mlp": 2.0 for i in range(6)},
    **{f"block.{i}.norm": 0.25 for i in range(6)},
}


def _total(p: dict[str, float]) -> float:
    return sum(p.values())


def test_free_features_match_hand_computation() -> None:
    X, ok = feature_matrix([BASE], FEATURE_SETS["paper+likelihood"])
    assert ok.all()
    expected = [math.log(20.0), 0.21, -1.5, math.log(1e-5), 1.3, math.log(13)]
    np.testing.assert_allclose(X[0], expected)


def test_grad_profile_features_match_hand_computation() -> None:
    d = {**BASE, "grad_profile": PROFILE}
    X, ok = feature_matrix([d], ("grad_embed_head", "grad_attn_mlp", "grad_early", "grad_late"))
    total = _total(PROFILE)
    attn = sum(1.0 + i for i in range(6))
    early = sum(1.0 + i + 2.0 + 0.25 for i in (0, 1))
    late = sum(1.0 + i + 2.0 + 0.25 for i in (4, 5))
    assert ok.all()
    np.testing.assert_allclose(
        X[0], [math.log(3.0 / total), math.log(attn / 12.0), math.log(early / total), math.log(late / total)]
    )


def test_missing_grad_profile_is_unavailable_not_a_crash() -> None:
    X, ok = feature_matrix([BASE, {**BASE, "grad_profile": PROFILE}], ("log_epistemic", "grad_late"))
    assert list(ok) == [False, True] and math.isnan(X[0, 1])
    msg = missing_features([BASE, BASE], ("aleatoric", "grad_late", "p_true"))
    assert set(msg) == {"grad_late", "p_true"}
    assert "grad_profile" in msg["grad_late"] and "re-score" in msg["grad_late"]
    assert "P(True)" in msg["p_true"]
    # Fitting on scores that lack a feature says which and why.
    with pytest.raises(CalibrationError, match="grad_profile"):
        Calibrator("same-pass").fit([BASE] * 20, [0, 1] * 10)


def test_zero_or_empty_profile_is_invalid() -> None:
    zero = {k: 0.0 for k in PROFILE}
    _, ok = feature_matrix([{**BASE, "grad_profile": zero}, {**BASE, "grad_profile": {}}], ("grad_early",))
    assert not ok.any()


def test_costly_features_read_from_the_score_dict() -> None:
    sve = ("sve_mean_prob", "sve_variance", "sve_mi", "sve_agree")
    d = {**BASE, "p_true": 0.8, "sve_mean_prob": 0.6, "sve_variance": 0.01, "sve_mi": 0.2, "sve_agree": 1.0}
    X, ok = feature_matrix([d], ("p_true", *sve))
    assert ok.all() and list(X[0]) == [0.8, 0.6, 0.01, 0.2, 1.0]
    assert {"p_true", *sve} == COSTLY
    # Priors: a likelier answer and agreeing members mean less risk; spread means more.
    assert [ORIENTATION[f] for f in sve] == [-1, 1, 1, -1]
    # Without the opinion the message says which flag computes it.
    gone = missing_features([BASE], sve)
    assert set(gone) == set(sve) and all("--sve FILE" in m for m in gone.values())
    assert "--sve-answer-tokens" in gone["sve_agree"]


def test_feature_sets_membership() -> None:
    paper = ("log_epistemic", "aleatoric")
    lik = ("mean_logprob", "log_min_token_prob", "mean_entropy", "log_n_tokens")
    grad = ("grad_embed_head", "grad_attn_mlp", "grad_early", "grad_late")
    assert FEATURE_SETS["paper"] == paper
    assert FEATURE_SETS["likelihood"] == lik
    assert FEATURE_SETS["same-pass"] == paper + lik + grad
    assert FEATURE_SETS["same-pass+ptrue"] == paper + lik + grad + ("p_true",)
    sve = ("sve_mean_prob", "sve_variance", "sve_mi", "sve_agree")
    assert FEATURE_SETS["same-pass+sve"] == paper + lik + grad + sve
    assert FEATURE_SETS["same-pass+ptrue+sve"] == paper + lik + grad + ("p_true",) + sve
    assert resolve_features("same-pass+sve") == ("same-pass+sve", paper + lik + grad + sve)
    free = [k for k, v in FEATURE_SETS.items() if not set(v) & COSTLY]
    assert not {"same-pass+ptrue", "same-pass+sve", "same-pass+ptrue+sve"} & set(free)
    assert not set(DEFAULT_FEATURES) & COSTLY  # the default costs nothing extra
    # Every feature is documented in one line and has a prior direction.
    assert set(FEATURE_DOCS) == set(FEATURES) == set(ORIENTATION)
    assert all("\n" not in v for v in FEATURE_DOCS.values())


def test_resolve_names_lists_and_old_names() -> None:
    assert resolve_features("paper") == ("paper", FEATURE_SETS["paper"])
    assert resolve_features("log_epistemic,aleatoric") == ("paper", FEATURE_SETS["paper"])
    assert resolve_features(["mean_logprob", "n_tokens", "min_token_prob"]) == (
        None,
        ("mean_logprob", "n_tokens", "min_token_prob"),
    )
    with pytest.raises(CalibrationError, match="unknown feature"):
        resolve_features("paper,vibes")
    with pytest.raises(CalibrationError, match="duplicate"):
        resolve_features("aleatoric,aleatoric")
    # Old names still compute what they did.
    X, _ = feature_matrix([BASE], ("min_token_prob", "n_tokens", "mean_token_prob"))
    assert list(X[0]) == [1e-5, 13.0, 0.7]


def test_serving_without_a_costly_feature_fails_closed() -> None:
    rng = np.random.default_rng(0)
    dicts = [{**BASE, "p_true": float(p)} for p in rng.uniform(size=40)]
    labels = [int(d["p_true"] > 0.5) for d in dicts]
    cal = Calibrator("aleatoric,p_true", C=1.0).fit(dicts, labels)
    assert cal.costly_features == ("p_true",)
    assert cal.risk(BASE) == 1.0  # no P(True) in the scores: risk 1.0, not an exception


def test_normalised_epistemic_is_the_gradient_norm_of_log_p_bar(tokenizer) -> None:
    """log ||grad log p̄||², from the scorer's score dict, against autograd on log p̄ itself (float64)."""
    import torch

    from guarduq import Guard, layout
    from tests.conftest import tiny_llama

    model = tiny_llama(seed=3).double()
    guard = Guard((model, tokenizer))
    s = guard.score("What is two plus two?", "Four, I think.").to_dict()
    enc = layout.encode(tokenizer, model, "What is two plus two?", "Four, I think.")
    logits = model(input_ids=enc.input_ids).logits[0, enc.response_start - 1 : -1]
    probs = torch.softmax(logits, -1).gather(-1, enc.input_ids[0, enc.response_start:, None])
    grads = torch.autograd.grad(torch.log(probs.mean()), [p for p in model.parameters()])
    want = math.log(sum(float((g**2).sum()) for g in grads))
    assert FEATURES["log_epistemic_norm"](s) == pytest.approx(want, rel=1e-6)  # p̄ is reported in float32
    assert FEATURES["log_epistemic_norm"]({**s, "mean_token_prob": 0.0}) != FEATURES["log_epistemic_norm"](s)
