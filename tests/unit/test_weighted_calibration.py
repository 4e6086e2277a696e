"""Weighted calibration (reviewed replies reweighted by their inclusion probability): a weight
is a repeat count, checked against fits on repeated rows; weights recover a population fit from
a biased sample."""

from __future__ import annotations

import numpy as np
import pytest

from guarduq.calibration import Calibrator
from guarduq.calibration.logistic import ridge_logistic
from guarduq.errors import CalibrationError


def _scores(rng: np.random.Generator, n: int) -> tuple[list[dict[str, float]], np.ndarray]:
    lp = rng.normal(-1.0, 0.6, n)
    ep = rng.lognormal(0.0, 1.0, n)
    p_wrong = 1 / (1 + np.exp(-(-1.5 * (lp + 1.0) + 0.8 * np.log(ep))))
    wrong = rng.random(n) < p_wrong
    scores = [{"mean_logprob": float(a), "epistemic": float(e), "aleatoric": 0.2, "mean_token_prob": float(np.exp(a)),
               "min_token_prob": 0.1, "mean_entropy": 1.0, "n_tokens": 5, "valid": True}
              for a, e in zip(lp, ep, strict=True)]
    return scores, (~wrong).astype(int)


def test_ridge_weights_equal_repeated_rows() -> None:
    rng = np.random.default_rng(0)
    X, t = rng.normal(size=(60, 3)), (rng.random(60) < 0.4).astype(float)
    w = rng.integers(1, 4, 60)
    got = ridge_logistic(X, t, 0.7, weights=w)
    want = ridge_logistic(np.repeat(X, w, axis=0), np.repeat(t, w), 0.7)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("C", [0.5, "cv"])
def test_calibrator_weights_are_repeat_counts(C: float | str) -> None:
    """Weights are rescaled to mean 1: weighted at C equals repeated rows at C / mean(w)."""
    rng = np.random.default_rng(1)
    scores, labels = _scores(rng, 300)
    w = rng.integers(1, 4, 300)
    weighted = Calibrator("mean_logprob,log_epistemic", C=C).fit(scores, labels, sample_weight=w)
    rep_scores = [s for s, k in zip(scores, w, strict=True) for _ in range(k)]
    rep_C = weighted.C_ / w.mean()
    repeated = Calibrator("mean_logprob,log_epistemic", C=rep_C).fit(rep_scores, np.repeat(labels, w))
    probe = scores[:50]
    # An independent solve of the weighted objective (the scaler is fitted on unrepeated rows)
    np.testing.assert_allclose(weighted.predict_risk(probe), _refit_risk(scores, labels, w, weighted.C_, probe),
                               rtol=1e-4, atol=1e-6)
    # Repeated rows shift the scaler a little, so the two agree only roughly
    np.testing.assert_allclose(weighted.predict_risk(probe), repeated.predict_risk(probe), atol=0.02)


def _refit_risk(scores: list[dict[str, float]], labels: np.ndarray, w: np.ndarray, C: float,
                probe: list[dict[str, float]]) -> np.ndarray:
    """The same objective solved independently: standardise on the unrepeated rows (as the
    calibrator's scaler does), then Newton on the weighted log-loss with weights / mean."""
    from guarduq.calibration.features import feature_matrix

    X, _ = feature_matrix(scores, ("mean_logprob", "log_epistemic"))
    P, _ = feature_matrix(probe, ("mean_logprob", "log_epistemic"))
    mu, sd = X.mean(axis=0), X.std(axis=0)
    coef, b = ridge_logistic((X - mu) / sd, 1.0 - labels, C, weights=w / w.mean())
    return 1 / (1 + np.exp(-(((P - mu) / sd) @ coef + b[0])))


def test_inverse_probability_weights_undo_a_biased_sample() -> None:
    """Sample every reply with a high epistemic score but 10% of the others (as risk bands do),
    and fit on mean_logprob alone: the sampling reads something the fit does not see, so
    unweighted it overstates how many answers are wrong; weighted by 1/pi it does not."""
    rng = np.random.default_rng(2)
    scores, labels = _scores(rng, 20_000)
    ep = np.array([s["epistemic"] for s in scores])
    pi = np.where(ep > 1.0, 1.0, 0.1)
    keep = rng.random(ep.size) < pi
    sub = [s for s, k in zip(scores, keep, strict=True) if k]
    population = Calibrator("mean_logprob", C=1.0).fit(scores, labels)
    naive = Calibrator("mean_logprob", C=1.0).fit(sub, labels[keep])
    weighted = Calibrator("mean_logprob", C=1.0).fit(sub, labels[keep], sample_weight=1 / pi[keep])
    truth = population.predict_risk(scores).mean()
    assert abs(weighted.predict_risk(scores).mean() - truth) < 0.01
    assert naive.predict_risk(scores).mean() - truth > 0.03  # the bias the weights remove


def test_bad_weights_are_refused() -> None:
    rng = np.random.default_rng(3)
    scores, labels = _scores(rng, 100)
    with pytest.raises(CalibrationError, match="positive"):
        Calibrator("mean_logprob", C=1.0).fit(scores, labels, sample_weight=[0.0] * 100)
    with pytest.raises(CalibrationError, match="values for"):
        Calibrator("mean_logprob", C=1.0).fit(scores, labels, sample_weight=[1.0] * 99)
    with pytest.raises(CalibrationError, match="pooled"):
        Calibrator("mean_logprob", C=1.0, within_groups=True).fit(
            scores, labels, groups=["a", "b"] * 50, sample_weight=[1.0] * 100)
