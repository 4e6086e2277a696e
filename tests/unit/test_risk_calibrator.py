"""The CV-regularised calibrator (reproducible C, coefficients), old artifacts scoring as before,
and the too-small / one-sided warnings with their sample sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from guarduq.calibration import (
    CV_GRID,
    Calibrator,
    clopper_pearson_upper,
    select_threshold,
    start_size,
)
from guarduq.calibration.sizing import accepted_needed, calibration_warnings

ROOT = Path(__file__).resolve().parents[2]
# The SmolLM2 calibrator shipped before feature sets existed (format 1), kept as a fixture.
V1 = ROOT / "tests" / "data" / "calibrator-v1-smollm2.json"


def data(n: int, signal: float, seed: int = 0) -> tuple[list[dict[str, float]], np.ndarray]:
    """Score dicts where P(wrong) = sigmoid(signal * z(log epistemic) - signal * z(mean_logprob))."""
    rng = np.random.default_rng(seed)
    le, lp = rng.normal(0, 1, n), rng.normal(-1, 0.5, n)
    p_wrong = 1 / (1 + np.exp(-(signal * le - signal * (lp + 1) / 0.5)))
    y = (rng.uniform(size=n) >= p_wrong).astype(int)
    dicts = [
        {"epistemic": float(np.exp(a)), "aleatoric": float(rng.uniform(0, 0.25)), "mean_logprob": float(b),
         "min_token_prob": float(rng.uniform(1e-4, 1)), "mean_entropy": float(rng.uniform(0, 3)),
         "n_tokens": int(rng.integers(1, 30)), "valid": True}
        for a, b in zip(le, lp, strict=True)
    ]
    return dicts, y


def test_cv_choice_is_reproducible_and_follows_the_signal() -> None:
    x, y = data(600, 1.5)
    a = Calibrator("paper+likelihood").fit(x, y)
    b = Calibrator("paper+likelihood").fit(x, y)
    assert a.C_ == b.C_ and a.C_ in CV_GRID
    assert a.coefficients() == b.coefficients()
    assert a.cv_ is not None and a.cv_["folds"] == 5 and a.cv_["scoring"] == "neg_log_loss"
    assert len(a.cv_["mean_scores"]) == len(CV_GRID)
    # Pure noise: cross-validation prefers a strong prior (small C) to a fitted direction.
    rng = np.random.default_rng(1)
    noise = Calibrator("paper+likelihood").fit(x, rng.integers(0, 2, len(x)))
    assert noise.C_ < a.C_
    assert noise.C_ <= 0.01


def test_coefficients_signs_reported_and_stored(tmp_path: Path) -> None:
    x, y = data(800, 1.5, seed=2)
    cal = Calibrator("paper+likelihood", model_name="m", model_fingerprint="f" * 32).fit(x, y)
    coef = cal.coefficients()
    assert list(coef) == list(cal.features)
    assert coef["log_epistemic"] > 0 and coef["mean_logprob"] < 0  # the generating directions
    cal.fit_thresholds(x[:200], y[:200], alphas=(0.3,))
    cal.attach_evaluation(cal.evaluate(x[:200], y[:200]))
    assert cal.metrics_["coefficients"] == coef
    path = tmp_path / "c.json"
    cal.save(path)
    doc = json.loads(path.read_text())
    assert doc["format_version"] == 2 and doc["feature_set"] == "paper+likelihood"
    assert doc["logistic"]["C"] == cal.C_ and doc["logistic"]["cv"]["grid"] == list(CV_GRID)
    back = Calibrator.load(path)
    assert back.feature_set == "paper+likelihood" and back.C_ == cal.C_ and back.cv_ == cal.cv_
    np.testing.assert_array_equal(back.predict_risk(x[:50]), cal.predict_risk(x[:50]))


FIXED = [
    {"epistemic": 13.97, "aleatoric": 0.2105, "mean_logprob": -1.53, "valid": True},
    {"epistemic": 20.39, "aleatoric": 0.2362, "valid": True},
    {"epistemic": 1e-15, "aleatoric": 0.0, "valid": True},  # floored epistemic
    {"epistemic": 300.0, "aleatoric": 0.25, "valid": True},
    {"epistemic": 5.0, "aleatoric": 0.1, "valid": False},  # invalid: fail closed
]


def test_artifact_written_before_this_change_scores_identically(tmp_path: Path) -> None:
    doc = json.loads(V1.read_text())
    assert doc["format_version"] == 1 and "feature_set" not in doc  # really an old artifact
    mean, scale = np.array(doc["scaler"]["mean"]), np.array(doc["scaler"]["scale"])
    coef, b = np.array(doc["logistic"]["coef"]), doc["logistic"]["intercept"]

    def by_hand(d: dict[str, float]) -> float:
        if not d["valid"]:
            return 1.0
        x = np.array([math.log(max(d["epistemic"], 1e-12)), d["aleatoric"]])
        return float(1 / (1 + math.exp(-(coef @ ((x - mean) / scale) + b))))

    cal = Calibrator.load(V1)
    expected = [by_hand(d) for d in FIXED]
    np.testing.assert_allclose(cal.predict_risk(FIXED), expected, rtol=1e-12, atol=0)
    assert cal.feature_set == "paper" and doc["logistic"]["C"] == cal.C_
    # Re-saved in the new format, it still scores the same.
    cal.save(tmp_path / "again.json")
    np.testing.assert_allclose(Calibrator.load(tmp_path / "again.json").predict_risk(FIXED), expected, rtol=1e-12)


# --------------------------------------------------------------------------- sample sizes


@pytest.mark.parametrize(("alpha", "delta"), [(0.3, 0.1), (0.1, 0.1), (0.05, 0.05), (0.5, 0.1)])
def test_zero_error_floor_is_the_closed_form(alpha: float, delta: float) -> None:
    n = accepted_needed(alpha, delta)
    # CP upper bound with no error is 1 - delta^(1/n) <= alpha  <=>  n >= log(delta) / log(1 - alpha).
    assert n == math.ceil(math.log(delta) / math.log(1 - alpha))
    assert clopper_pearson_upper(0, n, delta) <= alpha < clopper_pearson_upper(0, n - 1, delta)


def test_needed_with_an_observed_error_rate_is_minimal() -> None:
    n = accepted_needed(0.3, 0.1, 0.2)
    assert n is not None and n > accepted_needed(0.3, 0.1)
    k = math.ceil(0.2 * n - 1e-9)
    assert stats.beta.ppf(0.9, k + 1, n - k) <= 0.3
    assert all(clopper_pearson_upper(math.ceil(0.2 * m - 1e-9), m, 0.1) > 0.3 for m in range(1, n))
    assert accepted_needed(0.3, 0.1, 0.3) is None and accepted_needed(0.3, 0.1, 0.6) is None


def test_warnings_for_a_small_one_sided_set() -> None:
    w = calibration_warnings(n_fit=8, n_fit_wrong=1, n_threshold=6, n_threshold_wrong=2,
                             alphas=(0.3, 0.5), delta=0.1, threshold_fraction=0.3, fit_fraction=0.4)
    text = "\n".join(w)
    assert "one-sided" in text and "only 1 of them wrong" in text
    # 10 wrong answers needed at 1/8 wrong in a fit split of 40%: 10 / (1/8) / 0.4 = 200.
    assert "about 200 labelled answers" in text
    floor3 = math.ceil(math.log(0.1) / math.log(0.7))  # 7 with zero errors
    need3 = max(floor3, start_size(0.3, 0.1))  # where the fixed-sequence test starts
    assert f"needs at least {need3} accepted answers" in w[1] and f"alone needs {floor3} with zero" in w[1]
    assert f"at least {math.ceil(need3 / 0.3)} labelled answers in all" in w[1]
    assert len(w) == 3 and w[2].startswith("alpha=0.5: cannot be certified")
    # The stated minimum is the real one: select_threshold certifies nothing below it, even error-free.
    risk = np.linspace(0, 1, need3 - 1)
    assert select_threshold(risk, np.zeros(need3 - 1, int), 0.3, 0.1).threshold is None
    risk = np.linspace(0, 1, need3)
    assert select_threshold(risk, np.zeros(need3, int), 0.3, 0.1).threshold is not None


def test_no_warning_for_a_large_balanced_set() -> None:
    assert calibration_warnings(n_fit=800, n_fit_wrong=300, n_threshold=600, n_threshold_wrong=100,
                                alphas=(0.3,), delta=0.1, threshold_fraction=0.3, fit_fraction=0.4) == []


def test_high_base_error_rate_says_what_a_subset_needs() -> None:
    w = calibration_warnings(n_fit=400, n_fit_wrong=300, n_threshold=300, n_threshold_wrong=240,
                             alphas=(0.3,), delta=0.1, threshold_fraction=0.3, fit_fraction=0.4)
    assert len(w) == 1 and "0.80 >= alpha" in w[0]
    assert f"needs {accepted_needed(0.3, 0.1, 0.15)} accepted answers" in w[0]


@pytest.mark.parametrize("C", [0.001, 0.3, 100.0])
def test_cv_solver_matches_scikit_learn(C: float) -> None:
    from sklearn.linear_model import LogisticRegression

    from guarduq.calibration.logistic import ridge_logistic

    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 4))
    t = (rng.uniform(size=300) < 1 / (1 + np.exp(-2 * X[:, 0] + X[:, 1]))).astype(float)
    w, b = ridge_logistic(X, t, C)
    ref = LogisticRegression(C=C, max_iter=10_000, tol=1e-10).fit(X, t)
    np.testing.assert_allclose(w, ref.coef_[0], atol=1e-6)
    assert b.shape == (1,) and b[0] == pytest.approx(ref.intercept_[0], abs=1e-6)
