"""The within-dataset fit: the solver against scikit-learn, Simpson's paradox undone, and the
Calibrator option (groups needed, artifact round trip, one group = the pooled fit)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from guarduq.calibration import Calibrator
from guarduq.calibration.logistic import ridge_logistic, serving_intercept, within_fit
from guarduq.errors import CalibrationError


def simpson(n: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two datasets: inside each, a larger x means a likelier error (true coefficient +1), but
    dataset 1 has larger x *and* a much lower error rate, so pooled, larger x looks safer."""
    rng = np.random.default_rng(seed)
    g = rng.integers(0, 2, n)
    x = rng.normal(0, 1, n) + 3.0 * g
    logit = 1.0 * (x - 3.0 * g) + np.where(g == 1, -3.0, 2.0)
    t = (rng.uniform(size=n) < 1 / (1 + np.exp(-logit))).astype(float)
    return x[:, None], t, g


@pytest.mark.parametrize("C", [0.01, 1.0])
def test_group_intercepts_match_scikit_learn(C: float) -> None:
    """Free per-group intercepts = scikit-learn on indicator columns scaled so large that their
    L2 penalty vanishes (an independent solver for the same objective)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(600, 3))
    g = rng.integers(0, 3, 600)
    t = (rng.uniform(size=600) < 1 / (1 + np.exp(-(X[:, 0] - X[:, 2] + g - 1)))).astype(float)
    w, b = ridge_logistic(X, t, C, groups=g)
    big = 1e4
    D = big * (g[:, None] == np.arange(3)[None, :])
    ref = LogisticRegression(C=C, fit_intercept=False, max_iter=100_000, tol=1e-12)
    ref.fit(np.hstack([X, D]), t)
    np.testing.assert_allclose(w, ref.coef_[0][:3], atol=1e-4)
    np.testing.assert_allclose(b, big * ref.coef_[0][3:], atol=1e-3)


def test_serving_intercept_solves_the_score_equation() -> None:
    """Mean predicted risk equals the error rate, and for scikit-learn's own coefficients the
    root is scikit-learn's (unpenalised) intercept: its first-order condition."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(500, 2))
    t = (rng.uniform(size=500) < 1 / (1 + np.exp(-(X[:, 0] - 0.5)))).astype(float)
    ref = LogisticRegression(C=0.5, max_iter=10_000, tol=1e-12).fit(X, t)
    b = serving_intercept(X @ ref.coef_[0], t)
    assert b == pytest.approx(ref.intercept_[0], abs=1e-6)
    assert np.mean(1 / (1 + np.exp(-(X @ ref.coef_[0] + b)))) == pytest.approx(t.mean(), abs=1e-9)


def test_within_fit_recovers_the_within_direction() -> None:
    x, t, g = simpson()
    pooled = LogisticRegression(C=1.0).fit(x, t).coef_[0][0]
    w, _ = within_fit(x, t, g, C=1.0)
    assert pooled < 0 < w[0]  # the paradox, and its undoing
    assert w[0] == pytest.approx(1.0, abs=0.15)  # the true within-dataset coefficient
    for k in (0, 1):  # each dataset's own ranking: above chance only with the within direction
        m = g == k
        assert roc_auc_score(t[m], w[0] * x[m, 0]) > 0.6
        assert roc_auc_score(t[m], pooled * x[m, 0]) < 0.4


def scores_of(x: np.ndarray, seed: int = 0) -> list[dict[str, float]]:
    """Score dicts whose mean_entropy carries x (other features present, as noise)."""
    rng = np.random.default_rng(seed)
    return [{"epistemic": float(np.exp(rng.normal())), "aleatoric": float(rng.uniform(0, 0.25)),
             "mean_logprob": float(-rng.uniform(0.1, 3)), "min_token_prob": float(rng.uniform(1e-3, 1)),
             "mean_entropy": float(v), "n_tokens": int(rng.integers(1, 20)), "valid": True}
            for v in x]


def test_calibrator_within_groups_ranks_each_dataset(tmp_path: Path) -> None:
    x, t, g = simpson(3000)
    scores, labels = scores_of(x[:, 0]), (1 - t).astype(int)  # labels: 1 = correct
    names = np.where(g == 1, "mc", "open")
    pooled = Calibrator(["mean_entropy"]).fit(scores, labels)
    within = Calibrator(["mean_entropy"], within_groups=True).fit(scores, labels, groups=names)
    assert within.groups_ == ["mc", "open"]
    assert pooled.coefficients()["mean_entropy"] < 0 < within.coefficients()["mean_entropy"]
    risk = within.predict_risk(scores)
    assert risk.mean() == pytest.approx(t.mean(), abs=1e-6)  # one serving intercept, calibrated in the large
    for k in ("mc", "open"):
        m = names == k
        assert roc_auc_score(t[m], risk[m]) > 0.6 > 0.4 > roc_auc_score(t[m], pooled.predict_risk(scores)[m])
    path = tmp_path / "within.json"
    within.save(path)
    assert json.loads(path.read_text())["logistic"]["within"] == ["mc", "open"]
    back = Calibrator.load(path)
    assert back.within_groups and back.groups_ == ["mc", "open"]
    np.testing.assert_array_equal(back.predict_risk(scores), risk)
    pooled.save(tmp_path / "pooled.json")  # a pooled artifact does not carry the key at all
    assert "within" not in json.loads((tmp_path / "pooled.json").read_text())["logistic"]


def test_one_group_is_the_pooled_fit() -> None:
    """within_fit with a single group is LogisticRegression(C) (solved tightly); the Calibrator
    refuses that case rather than label a pooled fit 'within'."""
    rng = np.random.default_rng(3)
    Z = rng.normal(size=(400, 2))
    t = (rng.uniform(size=400) < 1 / (1 + np.exp(-Z[:, 0]))).astype(float)
    w, b = within_fit(Z, t, np.zeros(400, int), C=0.3)
    ref = LogisticRegression(C=0.3, max_iter=100_000, tol=1e-12).fit(Z, t)
    np.testing.assert_allclose(w, ref.coef_[0], atol=1e-6)
    assert b == pytest.approx(ref.intercept_[0], abs=1e-6)
    with pytest.raises(CalibrationError, match="at least 2 groups"):
        Calibrator(["mean_entropy"], within_groups=True).fit(
            scores_of(Z[:, 0], seed=3), (1 - t).astype(int), groups=["all"] * 400)


def test_within_groups_needs_groups() -> None:
    x, t, _ = simpson(200)
    cal = Calibrator(["mean_entropy"], within_groups=True)
    with pytest.raises(CalibrationError, match="pass groups="):
        cal.fit(scores_of(x[:, 0]), (1 - t).astype(int))
    with pytest.raises(CalibrationError, match="groups for"):
        cal.fit(scores_of(x[:, 0]), (1 - t).astype(int), groups=["a"] * 10)


def test_within_cv_scores_the_fixed_effects_model() -> None:
    """CV of a within fit scores held-out items with their group's intercept: on data whose
    groups differ mostly in error rate, its held-out log loss beats the pooled fit's CV."""
    x, t, g = simpson(1500, seed=4)
    scores, labels = scores_of(x[:, 0]), (1 - t).astype(int)
    pooled = Calibrator(["mean_entropy"]).fit(scores, labels)
    within = Calibrator(["mean_entropy"], within_groups=True).fit(scores, labels, groups=g.astype(str))
    assert within.cv_ is not None and pooled.cv_ is not None
    assert max(within.cv_["mean_scores"]) > max(pooled.cv_["mean_scores"]) + 0.1


@pytest.mark.parametrize("tiny", ["zz", "00"])  # the tiny group has the last code, or the first
def test_a_group_missing_from_a_cv_fold_is_served_the_shared_intercept(tiny: str) -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=301)
    t = (rng.uniform(size=301) < 1 / (1 + np.exp(-x))).astype(float)
    names = ["a"] * 150 + ["b"] * 150 + [tiny]  # one item: absent from 4 of 5 training folds
    cal = Calibrator(["mean_entropy"], within_groups=True).fit(scores_of(x), (1 - t).astype(int), groups=names)
    assert cal.groups_ == sorted(["a", "b", tiny]) and np.isfinite(cal.cv_["mean_scores"]).all()


def test_invalid_rows_can_remove_a_group() -> None:
    x, t, g = simpson(600, seed=6)
    scores, labels = scores_of(x[:, 0]), (1 - t).astype(int)
    names = np.where(g == 1, "mc", "open").tolist()
    for i in range(5):  # a third group whose every item is invalid
        scores.append({**scores[i], "valid": False})
        labels = np.append(labels, labels[i])
        names.append("broken")
    cal = Calibrator(["mean_entropy"], within_groups=True).fit(scores, labels, groups=names)
    assert cal.groups_ == ["mc", "open"] and cal.n_fit_invalid_ == 5
    one = [n if n != "mc" else "open" for n in names]  # only one valid group left
    with pytest.raises(CalibrationError, match="at least 2 groups"):
        Calibrator(["mean_entropy"], within_groups=True).fit(scores, labels, groups=one)


def test_serving_intercept_edge_cases() -> None:
    t = np.array([0.0, 1.0, 1.0, 0.0, 1.0])
    off = np.array([-75.0, -80.0, -70.0, -77.0, -72.0])  # far outside any fixed bracket
    b = serving_intercept(off, t)
    assert np.mean(1 / (1 + np.exp(-(off + b)))) == pytest.approx(t.mean(), abs=1e-9)
    assert serving_intercept(np.full(5, 2.0), t) == pytest.approx(np.log(0.6 / 0.4) - 2.0)
    with pytest.raises(CalibrationError, match="both right and wrong"):
        serving_intercept(off, np.ones(5))


def test_artifact_versions() -> None:
    """A within artifact is format 3 (an older guarduq refuses it as too new, not as corrupt);
    a pooled one stays format 2, and the format-1 fixture loads as a pooled calibrator."""
    x, t, g = simpson(400, seed=8)
    scores, labels = scores_of(x[:, 0]), (1 - t).astype(int)
    within = Calibrator(["mean_entropy"], within_groups=True).fit(scores, labels, groups=g.astype(str))
    pooled = Calibrator(["mean_entropy"]).fit(scores, labels)
    assert within.to_dict()["format_version"] == 3 and pooled.to_dict()["format_version"] == 2
    root = Path(__file__).resolve().parents[2]
    old = Calibrator.load(root / "tests" / "data" / "calibrator-v1-smollm2.json")
    assert old.within_groups is False and old.groups_ is None
    refit = Calibrator(["mean_entropy"], within_groups=True).fit(scores, labels, groups=g.astype(str))
    refit.within_groups = False
    assert refit.fit(scores, labels).groups_ is None  # a pooled refit forgets the groups
