"""A risk model per traffic group: ``Calibrator(per_group=True)``.

Why. A calibrator fitted on a mix of datasets learns how the signals separate the *datasets* as
much as how they separate right from wrong answers inside one, and the two can point opposite
ways (Simpson's paradox): Qwen2.5-Coder-1.5B answers NQ-open confidently and is wrong on 90% of
it. Pooled over the seven QA sets its calibrated risk ranked wrong answers worse than knowing
the dataset alone, while inside TriviaQA and NQ-open its likelihood signals reached AUROC of
about 0.8-0.9 (docs/results/scale/). Where the application knows what kind of traffic a request is (the
policy's traffic groups: an API key, ``metadata.group``, ``traffic_group(...)``), each group can
have its own logistic model, fitted on that group's items only.

How. The pooled model is fitted as always and serves every request without a group, or whose
group has no model of its own; each group with enough items of both kinds (:data:`MIN_GROUP_FIT`,
:data:`MIN_GROUP_CLASS`) gets a model fitted exactly as the pooled one is (same features, C by
the same cross-validation), on its items alone. Each certificate covers the risk it is applied
to: the pooled thresholds are certified on the pooled risk, each modelled group gets its own
(:func:`certify_group_models`, on its items' risk from its own model), and a group model serves
a reply only where its group is certified at the policy's alpha (``policy.context.risk_group``).

Lower layer: numpy and scikit-learn only; the calibrator that fits each group is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.pipeline import Pipeline

from guarduq.calibration.groups import certify_groups, group_starts
from guarduq.calibration.logistic import fixed_pipeline
from guarduq.calibration.thresholds import Threshold
from guarduq.errors import CalibrationError

MIN_GROUP_FIT = 40  # valid items a group needs for a model of its own
MIN_GROUP_CLASS = 5  # ... and of each of right and wrong answers among them


@dataclass(frozen=True)
class GroupModel:
    """One group's fitted scaler + logistic pipeline and how it was fitted."""

    pipeline: Pipeline
    n_fit: int
    C: float
    cv: dict[str, Any] | None


def group_array(groups: Sequence[str | None] | None, n: int) -> np.ndarray | None:
    """``groups`` as an object array of length ``n`` (None stays None: no group known)."""
    if groups is None:
        return None
    g = np.asarray([None if x is None else str(x) for x in groups], dtype=object)
    if g.shape != (n,):
        raise CalibrationError(f"got {g.size} groups for {n} scores")
    return g


def require_groups(groups: Sequence[str | None] | None, n: int) -> np.ndarray:
    """``groups`` as :func:`group_array` gives them; a ``CalibrationError`` when there are none."""
    g = group_array(groups, n)
    if g is None:
        raise CalibrationError("per_group=True fits a model per group: pass groups= to fit "
                               "(each item's traffic group or dataset)")
    return g


def fit_group_models(
    fit_one: Callable[[list[Any], np.ndarray, np.ndarray | None], Any],
    scores: Sequence[Any], y: np.ndarray, ok: np.ndarray, groups: np.ndarray,
    weights: np.ndarray | None,
) -> tuple[dict[str, GroupModel], dict[str, str]]:
    """(models, fallbacks): a ``GroupModel`` per group that supports one, and for every other
    group why it is served by the pooled model. ``fit_one(scores, labels, weights)`` returns a
    fitted ``Calibrator`` (the caller's settings); ``y`` holds 1 = correct, ``ok`` marks valid
    rows, ``weights`` the valid rows' weights (or None)."""
    models: dict[str, GroupModel] = {}
    fallback: dict[str, str] = {}
    w_all = None
    if weights is not None:
        w_all = np.ones(len(scores))
        w_all[ok] = weights
    for name in sorted({str(x) for x in groups if x is not None}):
        m = (groups == name) & ok
        n, n_right = int(m.sum()), int(y[m].sum())
        if n < MIN_GROUP_FIT or min(n_right, n - n_right) < MIN_GROUP_CLASS:
            fallback[name] = (f"{n} valid items, {n_right} right and {n - n_right} wrong: a model of its own "
                              f"needs {MIN_GROUP_FIT} items with {MIN_GROUP_CLASS} of each")
            continue
        idx = np.flatnonzero(m)
        cal = fit_one([scores[i] for i in idx], y[idx], None if w_all is None else w_all[idx])
        models[name] = GroupModel(cal.pipeline_, cal.n_fit_, cal.C_, cal.cv_)
    return models, fallback


def certify_group_models(
    served: np.ndarray, wrong: np.ndarray, groups: np.ndarray, models: Mapping[str, GroupModel],
    alphas: Sequence[float], delta: float, *, fit: tuple[np.ndarray, np.ndarray] | None = None,
    fit_wrong: np.ndarray | None = None,
) -> dict[str, list[Threshold]]:
    """Each modelled group's thresholds, certified on its own items' ``served`` risk (the
    Mondrian test of :mod:`~guarduq.calibration.groups`); ``fit`` = (groups, served risk) of the
    fit split, where each test's second start is learned. Groups without a model get none: the
    pooled certificate covers them, as they are served the pooled risk."""
    def modelled(g: np.ndarray) -> list[str | None]:
        return [x if x in models else None for x in g]

    starts = None
    if fit is not None and fit_wrong is not None:
        starts = group_starts(fit[1], fit_wrong, modelled(fit[0]), alphas, delta)
    return certify_groups(served, wrong, modelled(groups), alphas, delta, starts)


def apply_group_models(
    risk: np.ndarray, X: np.ndarray, ok: np.ndarray, groups: np.ndarray | None,
    models: Mapping[str, GroupModel],
) -> np.ndarray:
    """The pooled ``risk`` with each valid row of a modelled group replaced by its group's risk
    (invalid rows keep their fail-closed 1.0; rows without a group or a model keep the pooled)."""
    if groups is None or not models:
        return risk
    out = risk.copy()
    for name, gm in models.items():
        m = ok & (groups == name)
        if m.any():
            out[m] = gm.pipeline.predict_proba(X[m])[:, 1]
    return out


def models_to_json(models: Mapping[str, GroupModel]) -> dict[str, Any]:
    """The artifact's ``group_models``: per group, its scaler and logistic as the pooled ones are stored."""
    out = {}
    for name, gm in models.items():
        scaler, logistic = gm.pipeline.named_steps["scale"], gm.pipeline.named_steps["logistic"]
        out[name] = {"scaler": {"mean": scaler.mean_.tolist(), "scale": scaler.scale_.tolist()},
                     "logistic": {"coef": logistic.coef_[0].tolist(), "intercept": float(logistic.intercept_[0]),
                                  "C": gm.C, "cv": gm.cv},
                     "n_fit": gm.n_fit}
    return out


def models_from_json(doc: Mapping[str, Any], n_features: int) -> dict[str, GroupModel]:
    """``models_to_json``'s inverse, from the artifact's checked fields; ``ValueError`` when a
    group's parameters do not fit the features or are not finite."""
    models = {}
    for name, g in doc.items():
        numbers = [*g.scaler.mean, *g.scaler.scale, *g.logistic.coef, g.logistic.intercept]
        if not len(g.scaler.mean) == len(g.scaler.scale) == len(g.logistic.coef) == n_features:
            raise ValueError(f"group {name!r}: parameter lengths do not match the {n_features} features")
        if not np.isfinite(numbers).all() or min(g.scaler.scale) <= 0:
            raise ValueError(f"group {name!r}: non-finite or invalid parameters")
        pipe = fixed_pipeline(g.scaler.mean, g.scaler.scale, g.logistic.coef, g.logistic.intercept,
                              g.logistic.C, g.n_fit)
        models[name] = GroupModel(pipe, g.n_fit, g.logistic.C, g.logistic.cv.model_dump() if g.logistic.cv else None)
    return models
