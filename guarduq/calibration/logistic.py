"""The calibrator's L2 logistic regression: pooled over datasets, or within each dataset.

* :func:`ridge_logistic`: scikit-learn's ``LogisticRegression(C)`` objective, solved by Newton
  steps (cheap enough to refit 11 strengths x 5 folds), with one free intercept or one per group.
* :func:`within_fit`: feature directions learned *inside* each calibration dataset, with one
  intercept for serving. Why it exists is in its docstring: pooled fits of likelihood features
  suffer Simpson's paradox across datasets.
* :func:`choose_C`: the L2 strength by cross-validated log loss; :func:`normalised_weights`:
  sample weights as the fit reads them.

Both fits work on standardised features; :func:`pipeline` / :func:`fixed_pipeline` build the scaler +
logistic pipeline ``Calibrator`` serves with (fitted by scikit-learn, or from given parameters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import brentq
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from guarduq._logging import get_logger
from guarduq.errors import CalibrationError

log = get_logger("calibration")
CV_SCORING = "neg_log_loss"


def standardisation(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column means and standard deviations, a constant column's scale set to 1 (as
    ``StandardScaler`` does), so ``(X - mean) / scale`` is always finite."""
    mean, scale = X.mean(axis=0), X.std(axis=0)
    scale[scale == 0] = 1.0
    return mean, scale


def _one_hot(groups: np.ndarray | None, n: int) -> np.ndarray:
    """(n, g) indicator columns of integer group codes 0..g-1 (g = largest code + 1; pass codes
    without gaps, as ``np.unique(..., return_inverse=True)`` gives); ones without groups."""
    if groups is None:
        return np.ones((n, 1))
    codes = np.asarray(groups, int)
    return (codes[:, None] == np.arange(codes.max() + 1)[None, :]).astype(float)


def ridge_logistic(
    X: np.ndarray,
    t: np.ndarray,
    C: float,
    groups: np.ndarray | None = None,
    iters: int = 50,
    weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """argmin_w,b  C * sum_i v_i logloss(t_i, x_i.w + b_g(i)) + |w|^2 / 2, intercepts unpenalised.

    Without ``groups`` this is ``LogisticRegression(C)``'s objective (one intercept, returned as
    a length-1 array); with integer group codes each group gets its own free intercept (a fixed
    effect). ``weights`` v (default 1) is scikit-learn's ``sample_weight``: an integer weight is
    the same as repeating the row. The objective is convex, so damped Newton steps converge in a
    few iterations.
    """
    n, k = X.shape
    v = np.ones(n) if weights is None else np.asarray(weights, float)
    G = _one_hot(groups, n)
    A = np.hstack([X, G])
    theta = np.zeros(k + G.shape[1])
    reg = np.ones_like(theta)
    reg[k:] = 1e-10  # intercepts are not penalised (a tiny ridge keeps the Hessian invertible)

    def objective(th: np.ndarray) -> float:
        z = A @ th
        return float(C * np.sum(v * (np.logaddexp(0, z) - t * z)) + 0.5 * th[:k] @ th[:k])

    f = objective(theta)
    for _ in range(iters):
        p = 1 / (1 + np.exp(-(A @ theta)))
        grad = C * A.T @ (v * (p - t)) + reg * theta
        hess = C * (A.T * (v * p * (1 - p))) @ A + np.diag(reg)
        step = np.linalg.solve(hess, grad)
        lr = 1.0
        while lr > 1e-6:
            new = theta - lr * step
            f_new = objective(new)
            if f_new <= f:
                break
            lr /= 2
        else:  # no step lowers the objective: theta is as good as this precision allows
            break
        theta, f_old, f = new, f, f_new
        if abs(f_old - f) <= 1e-10 * max(1.0, abs(f)):
            break
    return theta[:k], theta[k:]


def serving_intercept(offset: np.ndarray, t: np.ndarray) -> float:
    """The maximum-likelihood intercept b for fixed coefficients: sum sigma(offset + b) = sum t.

    The score equation of an unpenalised intercept (the mean predicted risk over the fit data
    equals its error rate r). Its left side increases in b, so the root is unique when
    0 < r < 1, and it lies in [logit r - max offset, logit r - min offset]: at the left end every
    sigma(offset + b) <= r, at the right end every one >= r.
    """
    t = np.asarray(t, float)
    r = float(np.mean(t))
    if not 0 < r < 1:
        raise CalibrationError(
            f"an intercept needs both right and wrong answers; the error rate here is {r:g}"
        )
    target = float(np.sum(t))
    off = np.asarray(offset, float)

    def excess(b: float) -> float:
        return float(np.sum(0.5 * (1 + np.tanh(0.5 * (off + b))))) - target  # sigma, no overflow

    logit = math.log(r / (1 - r))
    lo, hi = logit - float(off.max()), logit - float(off.min())
    if lo == hi:  # every offset equal: the root is exactly logit r - offset
        return lo
    return float(brentq(excess, lo, hi, xtol=1e-12))


def held_out_logits(
    a: np.ndarray,
    t: np.ndarray,
    C: float,
    b: np.ndarray,
    groups_a: np.ndarray | None = None,
    groups_b: np.ndarray | None = None,
    weights_a: np.ndarray | None = None,
) -> np.ndarray:
    """Fit on (a, t) (rows weighted by ``weights_a``), return the logits of the held-out rows b
    (a cross-validation fold).

    With groups, each held-out row gets its own group's intercept, as the fixed-effects model was
    fitted; a group with no training row in this fold gets the serving intercept instead.
    """
    if groups_a is None or groups_b is None:
        w, w0 = ridge_logistic(a, t, C, weights=weights_a)
        return np.asarray(b @ w + w0[0])
    seen, codes = np.unique(groups_a, return_inverse=True)
    w, w0 = ridge_logistic(a, t, C, groups=codes)
    pos = np.minimum(np.searchsorted(seen, groups_b), seen.size - 1)
    known = seen[pos] == groups_b
    off = w0[pos]
    if not known.all():
        off = np.where(known, off, serving_intercept(a @ w, t))
    return np.asarray(b @ w + off)


def within_fit(
    Z: np.ndarray, t: np.ndarray, groups: np.ndarray, C: float
) -> tuple[np.ndarray, float]:
    """Coefficients learned within each group (dataset), and one intercept to serve with.

    Why: pooled over datasets, a feature's coefficient mixes two effects. Within one dataset,
    a lower mean log-probability means a likelier wrong answer (SmolLM2: every QA set); between
    datasets the order can reverse (short, confident answers to open questions are wrong far more
    often than long, hesitant multiple-choice picks). A pooled fit learns the blend, and on a new
    kind of traffic only the within part ranks anything: this is Simpson's paradox, and it is why
    pooled calibrators fell below chance on left-out datasets (docs/results/risk.md).

    Giving each group a free intercept (dataset fixed effects) absorbs every difference between
    datasets' error rates, so ``w`` is identified by variation inside the datasets only. Serving
    traffic carries no dataset label, so the group intercepts are replaced by the single
    :func:`serving_intercept` over all groups. With one group this is exactly the pooled fit.
    """
    codes = np.unique(np.asarray(groups), return_inverse=True)[1]
    w, _ = ridge_logistic(Z, t, C, groups=codes)
    return w, serving_intercept(Z @ w, t)


def pipeline(C: float) -> Pipeline:
    """Standardise, then ``LogisticRegression(C)``: the calibrator's pooled fit."""
    return Pipeline(
        [("scale", StandardScaler()), ("logistic", LogisticRegression(C=C, max_iter=1000))]
    )


def fixed_pipeline(
    mean: np.ndarray, scale: np.ndarray, coef: np.ndarray, intercept: float, C: float, n_fit: int
) -> Pipeline:
    """The same pipeline with given parameters (a loaded artifact, or a within-group fit)."""
    k = len(coef)
    scaler = StandardScaler()
    scaler.mean_ = np.asarray(mean, float)
    scaler.scale_ = np.asarray(scale, float)
    scaler.var_ = scaler.scale_**2
    scaler.n_features_in_ = k
    scaler.n_samples_seen_ = n_fit
    logistic = LogisticRegression(C=C)
    logistic.coef_ = np.asarray([coef], float)
    logistic.intercept_ = np.asarray([intercept], float)
    logistic.classes_ = np.array([0, 1])
    logistic.n_features_in_ = k
    logistic.n_iter_ = np.array([0])
    return Pipeline([("scale", scaler), ("logistic", logistic)])


def choose_C(
    X: np.ndarray, target: np.ndarray, grid: Sequence[float], folds: int,
    codes: np.ndarray | None = None, weights: np.ndarray | None = None,
) -> tuple[float, dict[str, Any] | None]:
    """The L2 strength of ``grid`` with the best held-out log loss in stratified ``folds``-fold
    cross-validation (ties go to the stronger prior, the smaller C), and the CV record.

    Scaler and logistic are refitted per fold, on scikit-learn's objective, by the Newton solver
    above: 11 x 5 scikit-learn fits cost more in input checks than in arithmetic. With
    ``weights``, each fold is fitted and scored with them (a weighted mean held-out log loss), the
    objective the final fit minimises. A within fit (``codes``) is scored as the fixed-effects
    model it fits: each held-out item with its own group's intercept (:func:`held_out_logits`),
    so C is tuned for the within coefficients; serving then shares one intercept.
    """
    folds = min(folds, int(np.bincount(target, minlength=2).min()))
    if folds < 2:
        log.warning("cv_skipped_too_few", minority=folds, C=1.0)
        return 1.0, None
    losses = np.zeros((folds, len(grid)))
    splits = StratifiedKFold(folds, shuffle=True, random_state=0).split(X, target)
    for i, (tr, te) in enumerate(splits):
        mu, sd = standardisation(X[tr])
        a, b = (X[tr] - mu) / sd, (X[te] - mu) / sd
        t = target[te].astype(float)
        g_tr, g_te = (codes[tr], codes[te]) if codes is not None else (None, None)
        w_tr, w_te = (weights[tr], weights[te]) if weights is not None else (None, None)
        for j, c in enumerate(grid):
            z = held_out_logits(a, target[tr].astype(float), c, b, g_tr, g_te, weights_a=w_tr)
            p = np.clip(1 / (1 + np.exp(-z)), 1e-15, 1 - 1e-15)
            losses[i, j] = -np.average(t * np.log(p) + (1 - t) * np.log(1 - p), weights=w_te)
    means = -losses.mean(axis=0)  # neg_log_loss: higher is better
    best = int(np.flatnonzero(means >= means.max() - 1e-12)[0])  # grid ascends: smallest C
    cv = {"grid": [float(c) for c in grid], "folds": folds, "scoring": CV_SCORING,
          "mean_scores": [float(m) for m in means]}
    return float(grid[best]), cv


def normalised_weights(
    sample_weight: Sequence[float] | None, n: int, ok: np.ndarray, *, grouped: bool
) -> np.ndarray | None:
    """The valid rows' weights, rescaled to mean 1; None when none were given."""
    if sample_weight is None:
        return None
    if grouped:
        raise CalibrationError("sample_weight is supported by pooled fits only (not within_groups)")
    w = np.asarray(list(sample_weight), dtype=float)
    if w.shape != (n,):
        raise CalibrationError(f"sample_weight has {w.size} values for {n} items")
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise CalibrationError("sample_weight must hold finite positive numbers")
    w = w[ok]
    return w / w.mean() if w.size else w
