"""Does the calibrated risk earn its place? Comparisons of feature sets against single signals.

Pure numpy / scikit-learn on score dicts and labels (no model, no plotting), so the analysis runs
from scoring caches and is unit-testable on synthetic data:

* :func:`bootstrap_auroc`: AUROC with a percentile-bootstrap interval (vectorised ranks).
* :func:`paired_bootstrap_diff`: the difference of two AUROCs on the same items, with its interval.
* :func:`single_signals`: each feature alone, oriented by its prior direction (``ORIENTATION``).
* :func:`fit_and_test`: one calibrator fitted on a fit split, thresholds on a threshold split,
  measured on a test split (AUROC, ECE, coverage and whether each guarantee held).
* :func:`coefficient_signs` / :func:`sign_stable`: per-dataset coefficients, and the features
  whose direction agrees on every dataset.
* :func:`leave_one_dataset_out`: fit on all datasets but one, test on the one left out; a
  candidate's features may be chosen from the training datasets only (no peeking).
* :func:`choose_candidate`: the candidate a deployment should default to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import rankdata

from guarduq.calibration.calibrator import MIN_FIT_ITEMS, Calibrator
from guarduq.calibration.features import (
    ORIENTATION,
    feature_matrix,
    missing_features,
)
from guarduq.calibration.metrics import ece, ece_floor
from guarduq.calibration.thresholds import check_guarantees
from guarduq.errors import CalibrationError

Labelled = tuple[list[dict[str, Any]], np.ndarray]  # (score dicts, labels with 1 = correct)
FeatureChoice = tuple[str, ...] | Callable[[Mapping[str, Labelled]], tuple[str, ...]]


@dataclass(frozen=True)
class Candidate:
    """A way to build a calibrator: a feature list (or a rule choosing it from training data),
    an L2 strength (``"cv"`` or a number), and whether directions are learned within each
    training dataset (``Calibrator(within_groups=True)``) or across them."""

    name: str
    features: FeatureChoice
    C: float | str = "cv"
    note: str = ""
    within: bool = False

    def resolve(self, train: Mapping[str, Labelled]) -> tuple[str, ...]:
        return self.features(train) if callable(self.features) else tuple(self.features)


def _auroc_rows(wrong: np.ndarray, signal: np.ndarray) -> np.ndarray:
    """AUROC of each row of ``signal`` (B, n) against each row of ``wrong`` (B, n); NaN if one class."""
    ranks = rankdata(signal, axis=1)
    n_pos = wrong.sum(axis=1)
    n_neg = wrong.shape[1] - n_pos
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = ((ranks * wrong).sum(axis=1) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    auc[(n_pos == 0) | (n_neg == 0)] = np.nan
    return auc


def bootstrap_auroc(
    wrong: np.ndarray, signal: np.ndarray, n_boot: int = 1000, seed: int = 0
) -> tuple[float | None, float | None, float | None]:
    """(AUROC, 2.5%, 97.5%) for detecting wrong answers; Nones when only one class is present."""
    wrong = np.asarray(wrong, float)
    signal = np.asarray(signal, float)
    if wrong.size == 0 or wrong.min() == wrong.max():
        return None, None, None
    point = float(_auroc_rows(wrong[None], signal[None])[0])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, wrong.size, size=(n_boot, wrong.size))
    boots = _auroc_rows(wrong[idx], signal[idx])
    boots = boots[np.isfinite(boots)]
    if boots.size == 0:
        return point, None, None
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return point, float(lo), float(hi)


def paired_bootstrap_diff(
    wrong: np.ndarray, a: np.ndarray, b: np.ndarray, n_boot: int = 1000, seed: int = 0
) -> tuple[float | None, float | None, float | None]:
    """(AUROC(a) - AUROC(b), 2.5%, 97.5%) with both signals resampled on the *same* items.

    Two AUROCs on one test split share its items, so their own intervals overlap even when one is
    reliably higher; resampling items once and differencing within each resample removes the
    shared noise. Nones when only one class is present.
    """
    wrong = np.asarray(wrong, float)
    a, b = np.asarray(a, float), np.asarray(b, float)
    if wrong.size == 0 or wrong.min() == wrong.max():
        return None, None, None
    point = float(_auroc_rows(wrong[None], a[None])[0] - _auroc_rows(wrong[None], b[None])[0])
    idx = np.random.default_rng(seed).integers(0, wrong.size, size=(n_boot, wrong.size))
    diffs = _auroc_rows(wrong[idx], a[idx]) - _auroc_rows(wrong[idx], b[idx])
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size == 0:
        return point, None, None
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return point, float(lo), float(hi)


def single_signals(
    scores: Sequence[Mapping[str, Any]], features: Sequence[str]
) -> dict[str, np.ndarray]:
    """Each feature alone, times its prior orientation (higher = more likely wrong); NaN if missing."""
    X, _ = feature_matrix(scores, features)
    return {f: ORIENTATION.get(f, 1) * X[:, j] for j, f in enumerate(features)}


def available(scores: Sequence[Mapping[str, Any]], features: Sequence[str]) -> tuple[str, ...]:
    """The features some of these scores provide (the others would be dropped with a note)."""
    gone = missing_features(scores, features)
    return tuple(f for f in features if f not in gone)


def fit_and_test(
    features: Sequence[str],
    fit: Labelled,
    test: Labelled,
    *,
    threshold: Labelled | None = None,
    C: float | str = "cv",
    fit_groups: Sequence[str] | None = None,
    per_group: Mapping[str, Sequence[str]] | None = None,
    keep_calibrator: bool = False,
    alphas: Sequence[float] = (0.3, 0.4, 0.5),
    delta: float = 0.1,
    n_boot: int = 1000,
) -> dict[str, Any]:
    """Fit on ``fit``, choose thresholds on ``threshold`` (if given), measure on ``test``.

    ``fit_groups`` (the dataset of each fit item) makes it a within-dataset fit; ``per_group``
    (each item's group in each split: ``fit``, ``threshold``, ``test``) a fit with a model per
    group, served with each item's group (``group_guarantees``: each modelled group's own
    certificate on its test items); ``keep_calibrator`` returns the fitted calibrator too
    (``calibrator``: not JSON). ``error`` is set
    instead of the metrics when the fit split cannot be fitted (too few items, one class): the
    caller reports a dash, not a crash.
    """
    g = per_group or {}
    cal = Calibrator(tuple(features), C=C, within_groups=fit_groups is not None,  # type: ignore[arg-type]
                     per_group=per_group is not None)
    try:
        cal.fit(fit[0], fit[1], groups=g.get("fit", fit_groups))
    except CalibrationError as exc:
        return {"error": str(exc)}
    risk = cal.predict_risk(test[0], g.get("test"))
    y = np.asarray(test[1], int)
    auc, lo, hi = bootstrap_auroc(1 - y, risk, n_boot=n_boot)
    floor, floor_p95 = ece_floor(1 - risk) if y.size else (None, None)
    out: dict[str, Any] = {
        "auroc": auc,
        "ci": (lo, hi),
        "ece": ece(1 - risk, y) if y.size else None,
        "ece_floor": floor,  # a perfect calibrator's ECE on these items: mean, 95th percentile
        "ece_floor_p95": floor_p95,
        "n_test": int(y.size),
        "C": cal.C_,
        "coefficients": cal.coefficients(),
        **({"group_models": sorted(cal.group_models_), "pooled_for": cal.group_fallback_} if per_group else {}),
        "risk": risk,
    }
    if threshold is not None and len(threshold[0]):
        try:
            cal.fit_thresholds(threshold[0], threshold[1], alphas=alphas, delta=delta, groups=g.get("threshold"))
        except CalibrationError as exc:
            out["threshold_error"] = str(exc)
        else:  # each certificate checked on the risk it was certified on
            out["guarantees"] = check_guarantees(cal.thresholds_, cal.predict_risk(test[0]) if per_group else risk, y)
            if per_group:
                tg = np.asarray(g["test"], dtype=object)
                out["group_guarantees"] = {name: check_guarantees(ts, risk[tg == name], y[tg == name])
                                           for name, ts in cal.group_thresholds_.items()}
    if keep_calibrator:
        out["calibrator"] = cal
    return out


def coefficient_signs(
    groups: Mapping[str, Labelled], features: Sequence[str], C: float | str = "cv"
) -> dict[str, dict[str, float]]:
    """Dataset -> feature -> standardised coefficient of a calibrator fitted on that dataset alone
    (datasets that cannot be fitted are left out)."""
    out: dict[str, dict[str, float]] = {}
    for name, (scores, labels) in groups.items():
        try:
            out[name] = Calibrator(tuple(features), C=C).fit(scores, labels).coefficients()  # type: ignore[arg-type]
        except CalibrationError:
            continue
    return out


def sign_stable(coefs: Mapping[str, Mapping[str, float]], min_abs: float = 0.05) -> tuple[str, ...]:
    """Features whose coefficient has the same sign on every dataset (|coef| < min_abs counts as
    zero and agrees with either sign, but a feature that is ~0 everywhere is dropped)."""
    if not coefs:
        return ()
    feats = list(next(iter(coefs.values())))
    keep = []
    for f in feats:
        vals = np.array([c[f] for c in coefs.values()], float)
        strong = vals[np.abs(vals) >= min_abs]
        if strong.size and (np.all(strong > 0) or np.all(strong < 0)):
            keep.append(f)
    return tuple(keep)


def sign_stable_rule(
    base: Sequence[str], C: float | str = "cv", min_abs: float = 0.05
) -> Callable[[Mapping[str, Labelled]], tuple[str, ...]]:
    """A feature rule for :class:`Candidate`: the sign-stable subset of ``base`` on the training
    datasets (falls back to ``base`` when nothing is stable)."""

    def rule(train: Mapping[str, Labelled]) -> tuple[str, ...]:
        return select_features("sign-stable", train, base, C, min_abs)

    return rule


# Feature rules: a feature list chosen from the calibration data itself, dataset by dataset.
# `guarduq calibrate --features sign-stable` and `make calibrator` use them.
FEATURE_RULES: dict[str, str] = {
    "sign-stable": "the free features whose standardised coefficient has the same sign on every "
    "calibration dataset fitted alone (needs >= 2 datasets; the leave-one-dataset-out pick in "
    "docs/results/risk.md)",
}


def select_features(
    rule: str,
    groups: Mapping[str, Labelled],
    base: Sequence[str],
    C: float | str = "cv",
    min_abs: float = 0.05,
) -> tuple[str, ...]:
    """The features ``rule`` keeps out of ``base``, judged on ``groups`` (dataset -> fit data).

    Why a rule and not a fixed set: which features keep their direction depends on the model and
    the traffic, so it is read off the calibration data, as the leave-one-dataset-out comparison
    did when it chose the rule (without ever seeing the left-out dataset).
    """
    if rule not in FEATURE_RULES:
        raise CalibrationError(f"unknown feature rule {rule!r}; choose from {sorted(FEATURE_RULES)}")
    coefs = coefficient_signs(groups, base, C)
    if len(coefs) < 2:
        raise CalibrationError(
            f"--features {rule} compares coefficient signs across datasets: it needs at least 2 "
            f"datasets that can each be fitted (both labels, >= {MIN_FIT_ITEMS} items in the fit "
            f"split), got {len(coefs)} of {len(groups)}; name a feature set instead"
        )
    return sign_stable(coefs, min_abs) or tuple(base)


def robust_single(train: Mapping[str, Labelled], base: Sequence[str]) -> tuple[str, ...]:
    """The one feature of ``base`` whose worst AUROC over the training datasets (each feature in
    its prior direction, :data:`ORIENTATION`) is highest.

    Why: a signal that ranks wrong answers above chance on every dataset it has seen is the one
    most likely to keep doing so on the next, whereas a fitted combination can lean on a feature
    whose direction flips under shift. Datasets with one class only are skipped.
    """
    worst: dict[str, float] = {f: math.inf for f in base}
    for scores, labels in train.values():
        wrong = 1 - np.asarray(labels, int)
        if wrong.min() == wrong.max():
            continue
        for f, v in single_signals(scores, base).items():
            auc = bootstrap_auroc(wrong, v, n_boot=0)[0] if np.isfinite(v).all() else None
            worst[f] = min(worst[f], auc if auc is not None else -math.inf)
    ranked = [f for f in base if math.isfinite(worst[f])]
    return (max(ranked, key=lambda f: worst[f]),) if ranked else tuple(base)


def robust_single_rule(base: Sequence[str]) -> Callable[[Mapping[str, Labelled]], tuple[str, ...]]:
    """A feature rule for :class:`Candidate`: :func:`robust_single` on the training datasets."""
    return lambda train: robust_single(train, base)


def _pool(groups: Mapping[str, Labelled]) -> tuple[Labelled, list[str]]:
    """Every group's items in one Labelled, and each item's group name (for a within fit)."""
    scores: list[dict[str, Any]] = []
    labels: list[np.ndarray] = []
    names: list[str] = []
    for name, (s, y) in groups.items():
        scores.extend(s)
        labels.append(np.asarray(y, int))
        names.extend([name] * len(s))
    return (scores, np.concatenate(labels) if labels else np.zeros(0, int)), names


@dataclass
class LodoResult:
    """Per left-out dataset: each candidate's risk AUROC / ECE and each single signal's AUROC."""

    rows: dict[str, dict[str, dict[str, Any]]] = field(
        default_factory=dict
    )  # ds -> cand -> metrics
    singles: dict[str, dict[str, float | None]] = field(
        default_factory=dict
    )  # ds -> signal -> AUROC
    features: dict[str, dict[str, tuple[str, ...]]] = field(
        default_factory=dict
    )  # ds -> cand -> used

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Candidate or single signal -> mean and min AUROC over left-out datasets, mean ECE."""
        out: dict[str, dict[str, float | None]] = {}
        cands = sorted({c for r in self.rows.values() for c in r})
        for c in cands:
            aucs = [r[c].get("auroc") for r in self.rows.values() if c in r]
            eces = [r[c].get("ece") for r in self.rows.values() if c in r]
            out[c] = _agg(aucs, eces)
        sigs = sorted({s for r in self.singles.values() for s in r})
        for s in sigs:
            out["single:" + s] = _agg([r.get(s) for r in self.singles.values()], [])
        return out

    def best_single(self) -> tuple[str | None, float | None]:
        """The single signal with the best mean AUROC over left-out datasets (hindsight)."""
        best: tuple[str | None, float | None] = (None, None)
        for k, v in self.summary().items():
            m = v["mean_auroc"]
            if k.startswith("single:") and m is not None and (best[1] is None or m > best[1]):
                best = (k.removeprefix("single:"), m)
        return best


def _agg(aucs: Sequence[float | None], eces: Sequence[float | None]) -> dict[str, float | None]:
    a = [x for x in aucs if x is not None and math.isfinite(x)]
    e = [x for x in eces if x is not None and math.isfinite(x)]
    complete = len(a) == len(aucs)
    return {
        "mean_auroc": float(np.mean(a)) if a and complete else None,
        "min_auroc": float(np.min(a)) if a and complete else None,
        "mean_ece": float(np.mean(e)) if e else None,
        "n_datasets": float(len(a)),
    }


def leave_one_dataset_out(
    groups: Mapping[str, Labelled],
    candidates: Sequence[Candidate],
    signals: Sequence[str],
    *,
    progress: Callable[[Any], Any] | None = None,
    n_boot: int = 200,
) -> LodoResult:
    """For each dataset: fit every candidate on all the others, test on the whole left-out one."""
    res = LodoResult()
    names = list(groups)
    it = progress(names) if progress is not None else names
    for left in it:
        train = {k: v for k, v in groups.items() if k != left}
        scores, y = groups[left]
        wrong = 1 - np.asarray(y, int)
        res.rows[left], res.features[left] = {}, {}
        pooled, fit_names = _pool(train)
        for cand in candidates:
            feats = cand.resolve(train)
            res.features[left][cand.name] = feats
            m = fit_and_test(
                feats, pooled, (scores, np.asarray(y, int)), C=cand.C, n_boot=n_boot,
                fit_groups=fit_names if cand.within else None,
            )
            res.rows[left][cand.name] = {k: v for k, v in m.items() if k != "risk"}
        sig = single_signals(scores, signals)
        res.singles[left] = {
            s: (bootstrap_auroc(wrong, v, n_boot=0)[0] if np.isfinite(v).all() else None)
            for s, v in sig.items()
        }
    return res


def choose_candidate(res: LodoResult) -> tuple[str | None, str]:
    """The candidate with the best mean left-out AUROC among those never below 0.5; else the one
    with the best worst case. Returns (name, reason)."""
    summ = {
        k: v
        for k, v in res.summary().items()
        if not k.startswith("single:") and v["mean_auroc"] is not None
    }
    if not summ:
        return None, "no candidate could be fitted on every leave-one-out split"
    safe = {k: v for k, v in summ.items() if (v["min_auroc"] or 0) >= 0.5}
    if safe:
        name = max(safe, key=lambda k: (safe[k]["mean_auroc"], safe[k]["min_auroc"]))
        v = safe[name]
        return name, (
            f"best mean left-out AUROC ({v['mean_auroc']:.3f}) among the candidates that never "
            f"fell below 0.5 (worst {v['min_auroc']:.3f})"
        )
    name = max(summ, key=lambda k: summ[k]["min_auroc"] or 0)
    v = summ[name]
    return name, (
        f"no candidate stayed >= 0.5 on every left-out dataset; this one has the best worst case "
        f"({v['min_auroc']:.3f}, mean {v['mean_auroc']:.3f})"
    )
