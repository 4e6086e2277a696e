"""Per-model calibration: raw uncertainty scores -> risk = P(wrong | scores) -> guaranteed thresholds.

Raw gradient norms live on a model-specific scale, so each model gets its own ``Calibrator``:

1. ``fit``: a scikit-learn pipeline (``StandardScaler`` + ``LogisticRegression``) on a few features
   of the scores (default ``log(epistemic)`` and ``aleatoric``), predicting ``risk``.
2. ``fit_thresholds``: for each target ``alpha`` (the largest error rate tolerated among accepted
   answers) pick the loosest risk threshold whose accepted set has error <= alpha with probability
   >= 1 - delta. Each candidate threshold is a hypothesis test with an exact binomial
   (Clopper-Pearson) bound, tested in a fixed sequence from strict to loose (Learn-then-Test);
   the sequence stops at the first failure, so no multiplicity correction is needed.
   Use labels the risk model was not fitted on (see ``datasets.split_of``).
3. ``evaluate``: AUROC per raw signal and for the risk, ECE / Brier before and after calibration,
   risk-coverage curve (AURC), prediction rejection ratio (PRR), and whether each guarantee held.
4. ``save`` / ``load``: one JSON artifact (never pickle) bound to the model fingerprint.

Invalid scores (``valid=False`` or a non-finite feature) are *excluded with a count* from fitting,
threshold selection and metrics, and get ``risk = 1.0`` from ``predict_risk`` (fail closed).
Labels are ``1 = correct``; risk and every uncertainty signal follow "higher = more uncertain".
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError
from scipy import stats
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score, roc_curve
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from guarduq._logging import get_logger
from guarduq.errors import ArtifactError, CalibrationError, FingerprintMismatchError

log = get_logger("calibration")

FORMAT = "guarduq-calibrator"
FORMAT_VERSION = 1
ECE_BINS = 15
# An exactly-zero gradient (p̄ saturated) would make log(epistemic) = -inf; floor it instead.
EPISTEMIC_FLOOR = 1e-12
MIN_FIT_ITEMS = 10

ScoreLike = Any  # guarduq.scoring.uncertainty.Scores or a mapping with the same field names


def _log_epistemic(s: Mapping[str, Any]) -> float:
    e = float(s["epistemic"])
    return math.log(max(e, EPISTEMIC_FLOOR)) if e >= 0 else math.nan


FEATURES: dict[str, Callable[[Mapping[str, Any]], float]] = {
    "log_epistemic": _log_epistemic,
    "aleatoric": lambda s: float(s["aleatoric"]),
    "mean_logprob": lambda s: float(s["mean_logprob"]),
    "min_token_prob": lambda s: float(s["min_token_prob"]),
    "n_tokens": lambda s: float(s["n_tokens"]),
    "mean_token_prob": lambda s: float(s["mean_token_prob"]),
    "mean_entropy": lambda s: float(s["mean_entropy"]),
}
DEFAULT_FEATURES: tuple[str, ...] = ("log_epistemic", "aleatoric")

# Raw signals whose AUROC is reported, each oriented "higher = more likely wrong".
SIGNALS: tuple[str, ...] = ("epistemic", "aleatoric", "combined", "mean_logprob", "risk")


# --------------------------------------------------------------------------- inputs


def as_score_dict(scores: ScoreLike) -> dict[str, Any]:
    """A ``Scores`` object or a mapping (a cache line) as a plain dict of its fields."""
    if isinstance(scores, Mapping):
        return dict(scores)
    to_dict = getattr(scores, "to_dict", None)
    if callable(to_dict):
        return to_dict(with_token_probs=False)
    raise CalibrationError(f"expected Scores or a mapping of scores, got {type(scores).__name__}")


def feature_matrix(
    scores: Iterable[ScoreLike], features: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """``(X, valid)``: one row per response; ``valid`` is False for invalid or non-finite rows."""
    rows, valid = [], []
    for s in scores:
        d = as_score_dict(s)
        try:
            row = [FEATURES[f](d) for f in features]
        except (KeyError, TypeError, ValueError):
            row = [math.nan] * len(features)
        ok = bool(d.get("valid", True)) and all(math.isfinite(v) for v in row)
        rows.append(row)
        valid.append(ok)
    X = np.asarray(rows, dtype=float).reshape(len(rows), len(features))
    return X, np.asarray(valid, dtype=bool)


def _labels(labels: Iterable[Any], n: int) -> np.ndarray:
    y = np.asarray(list(labels))
    if y.shape != (n,):
        raise CalibrationError(f"got {y.size} labels for {n} scores")
    if y.dtype == bool:
        y = y.astype(int)
    if not np.isin(y, (0, 1)).all():
        raise CalibrationError("labels must be 0 (wrong) or 1 (correct)")
    return y.astype(int)


def _check_targets(alpha: float, delta: float) -> None:
    if not 0 < alpha < 1:
        raise CalibrationError(f"alpha must be in (0, 1), got {alpha}")
    if not 0 < delta < 1:
        raise CalibrationError(f"delta must be in (0, 1), got {delta}")


# --------------------------------------------------------------------------- thresholds


@dataclass(frozen=True)
class Threshold:
    """A risk threshold for one (alpha, delta) target, as chosen on calibration data.

    ``threshold`` is None when no candidate could be certified; ``message`` then says so.
    Answers are accepted when ``risk <= threshold``.
    """

    alpha: float
    delta: float
    threshold: float | None
    coverage: float  # fraction of calibration items accepted at the threshold
    n: int  # calibration items used
    n_accepted: int
    errors: int
    error_rate: float | None
    upper_bound: float | None  # Clopper-Pearson (1 - delta) upper bound on the error rate
    message: str | None = None

    @property
    def met(self) -> bool:
        return self.threshold is not None


def clopper_pearson_upper(errors: int, n: int, delta: float) -> float:
    """One-sided exact (1 - delta) upper confidence bound on a binomial error rate."""
    if n == 0:
        return 1.0
    if errors >= n:
        return 1.0
    return float(stats.beta.ppf(1 - delta, errors + 1, n - errors))


def default_grid() -> np.ndarray:
    """Candidate thresholds fixed before seeing data (step 0.001 on [0, 1])."""
    return np.round(np.linspace(0.0, 1.0, 1001), 6)


def start_size(alpha: float, delta: float) -> int:
    """Smallest n at which k = floor(n * alpha / 2) errors would pass the exact binomial test."""
    _check_targets(alpha, delta)
    n = math.ceil(math.log(delta) / math.log(1 - alpha))  # zero errors pass from here on
    while stats.binom.cdf(math.floor(n * alpha / 2), n, alpha) > delta:
        n += 1
    return n


def select_threshold(
    risk: np.ndarray,
    wrong: np.ndarray,
    alpha: float,
    delta: float,
    grid: np.ndarray | None = None,
    min_accepted: int | None = None,
) -> Threshold:
    """Learn-then-Test with a fixed sequence, strict -> loose.

    For each candidate t, H0(t): the error rate among answers with risk <= t exceeds alpha.
    Its exact binomial p-value is P(Bin(n_t, alpha) <= k_t) (k_t errors among n_t accepted). Tests
    run from the strictest t; the first that fails stops the sequence, and the loosest rejected
    H0 is returned.

    Where the sequence starts matters: with a handful of accepted items one unlucky error fails
    the first test and stops everything. So it starts at the first threshold accepting at least
    ``min_accepted`` items (default :func:`start_size`: enough that an observed error rate of
    alpha / 2 would pass). That choice uses alpha, delta and the unlabelled risks only, so the
    family-wise guarantee P(error(t*) > alpha) <= delta still holds.
    """
    _check_targets(alpha, delta)
    risk = np.asarray(risk, dtype=float)
    wrong = np.asarray(wrong, dtype=int)
    grid = default_grid() if grid is None else np.sort(np.asarray(grid, dtype=float))
    n = int(risk.size)
    order = np.argsort(risk, kind="stable")
    sorted_risk, sorted_wrong = risk[order], wrong[order]
    n_acc = np.searchsorted(sorted_risk, grid, side="right")
    cum_err = np.concatenate([[0], np.cumsum(sorted_wrong)])
    k_acc = cum_err[n_acc]
    n_min = start_size(alpha, delta) if min_accepted is None else max(1, int(min_accepted))
    testable = np.flatnonzero(n_acc >= n_min)
    best: int | None = None
    if testable.size:
        idx = testable
        pvals = stats.binom.cdf(k_acc[idx], n_acc[idx], alpha)
        failed = np.flatnonzero(pvals > delta)
        last = failed[0] - 1 if failed.size else idx.size - 1
        if last >= 0:
            best = int(idx[last])
    if best is None:
        return Threshold(
            alpha=alpha,
            delta=delta,
            threshold=None,
            coverage=0.0,
            n=n,
            n_accepted=0,
            errors=0,
            error_rate=None,
            upper_bound=None,
            message=(
                f"no risk threshold keeps the error rate <= {alpha:g} with confidence "
                f"{1 - delta:g} on these {n} calibration items; nothing would be accepted "
                f"(need at least {n_min} items accepted with few errors)"
            ),
        )
    na, ka = int(n_acc[best]), int(k_acc[best])
    return Threshold(
        alpha=alpha,
        delta=delta,
        threshold=float(grid[best]),
        coverage=na / n if n else 0.0,
        n=n,
        n_accepted=na,
        errors=ka,
        error_rate=ka / na if na else None,
        upper_bound=clopper_pearson_upper(ka, na, delta),
    )


# --------------------------------------------------------------------------- metrics


def auroc(wrong: np.ndarray, signal: np.ndarray) -> float | None:
    """AUROC of ``signal`` (higher = more uncertain) for detecting wrong answers; None if one class."""
    wrong = np.asarray(wrong)
    if np.unique(wrong).size < 2:
        return None
    return float(roc_auc_score(wrong, signal))


def ece(confidence: np.ndarray, correct: np.ndarray, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error with equal-width bins on [0, 1]."""
    confidence = np.clip(np.asarray(confidence, dtype=float), 0.0, 1.0)
    correct = np.asarray(correct, dtype=float)
    bins = np.minimum((confidence * n_bins).astype(int), n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        m = bins == b
        if m.any():
            total += m.sum() * abs(correct[m].mean() - confidence[m].mean())
    return float(total / max(confidence.size, 1))


def reliability_bins(
    confidence: np.ndarray, correct: np.ndarray, n_bins: int = ECE_BINS
) -> list[dict[str, float]]:
    """Per-bin (lower edge, mean confidence, accuracy, count) for a reliability diagram."""
    confidence = np.clip(np.asarray(confidence, dtype=float), 0.0, 1.0)
    correct = np.asarray(correct, dtype=float)
    bins = np.minimum((confidence * n_bins).astype(int), n_bins - 1)
    out = []
    for b in range(n_bins):
        m = bins == b
        if m.any():
            out.append(
                {
                    "lo": b / n_bins,
                    "confidence": float(confidence[m].mean()),
                    "accuracy": float(correct[m].mean()),
                    "count": int(m.sum()),
                }
            )
    return out


def brier(confidence: np.ndarray, correct: np.ndarray) -> float:
    return float(np.mean((np.asarray(confidence, float) - np.asarray(correct, float)) ** 2))


def risk_coverage(uncertainty: np.ndarray, wrong: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coverage, selective risk) when answers are accepted from most to least certain."""
    order = np.argsort(np.asarray(uncertainty, float), kind="stable")
    errs = np.cumsum(np.asarray(wrong, float)[order])
    k = np.arange(1, len(order) + 1)
    return k / len(order), errs / k


def aurc(uncertainty: np.ndarray, wrong: np.ndarray) -> float:
    """Area under the risk-coverage curve (lower is better)."""
    return float(np.mean(risk_coverage(uncertainty, wrong)[1]))


def prr(uncertainty: np.ndarray, wrong: np.ndarray) -> float | None:
    """Prediction rejection ratio: (AURC_random - AURC) / (AURC_random - AURC_oracle).

    1 = ranks like an oracle, 0 = no better than random (lm-polygraph's headline metric).
    """
    wrong = np.asarray(wrong, float)
    n = wrong.size
    n_wrong = wrong.sum()
    if n == 0 or n_wrong in (0, n):
        return None
    k = np.arange(1, n + 1)
    oracle = float(np.mean(np.maximum(0.0, k - (n - n_wrong)) / k))
    random = float(n_wrong / n)
    return float((random - aurc(uncertainty, wrong)) / (random - oracle))


def _zscore(x: np.ndarray) -> np.ndarray:
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


def signal_values(signals: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The AUROC signals, each oriented "higher = more likely wrong".

    ``combined`` = z(log epistemic) + z(aleatoric), standardised on the evaluated data itself
    (no labels used); ``mean_logprob`` is negated. ``mean_logprob`` and ``risk`` are optional.
    """
    log_e = np.log(np.maximum(signals["epistemic"], EPISTEMIC_FLOOR))
    out = {
        "epistemic": signals["epistemic"],
        "aleatoric": signals["aleatoric"],
        "combined": _zscore(log_e) + _zscore(signals["aleatoric"]),
    }
    if "mean_logprob" in signals:
        out["mean_logprob"] = -signals["mean_logprob"]
    if "risk" in signals:
        out["risk"] = signals["risk"]
    return out


def compute_metrics(labels: np.ndarray, signals: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Every reported metric for one set of labelled, valid items."""
    labels = np.asarray(labels, int)
    wrong = 1 - labels
    n = int(labels.size)
    if n == 0:
        return {"n": 0, "accuracy": None, "auroc": dict.fromkeys(SIGNALS)}
    oriented = signal_values(signals)
    conf_before = np.asarray(signals["mean_token_prob"], float)
    conf_after = 1.0 - np.asarray(signals["risk"], float)
    return {
        "n": n,
        "accuracy": float(labels.mean()),
        "auroc": {k: auroc(wrong, v) for k, v in oriented.items()},
        "ece_before": ece(conf_before, labels),
        "ece_after": ece(conf_after, labels),
        "brier_before": brier(conf_before, labels),
        "brier": brier(conf_after, labels),
        "aurc": aurc(signals["risk"], wrong),
        "prr": prr(signals["risk"], wrong),
    }


# --------------------------------------------------------------------------- evaluation result

EVAL_FIELDS = ("epistemic", "aleatoric", "mean_logprob", "mean_token_prob", "risk")


@dataclass
class Evaluation:
    """Metrics and per-item arrays for one labelled set (what reports are drawn from).

    ``signals`` holds the raw per-item arrays (``EVAL_FIELDS``), aligned with ``labels`` and
    ``datasets``; invalid items are not in them, only counted in ``n_invalid``.
    """

    labels: np.ndarray
    signals: dict[str, np.ndarray]
    datasets: np.ndarray
    metrics: dict[str, Any]
    per_dataset: dict[str, dict[str, Any]]
    guarantees: list[dict[str, Any]]
    thresholds: list[Threshold]
    n_invalid: int = 0
    model: dict[str, Any] = field(default_factory=dict)
    calibrator_sha256: str | None = None

    @classmethod
    def from_arrays(
        cls,
        labels: np.ndarray,
        signals: Mapping[str, np.ndarray],
        datasets: Sequence[str] | np.ndarray | None,
        thresholds: Sequence[Threshold],
        *,
        n_invalid: int = 0,
        model: Mapping[str, Any] | None = None,
        calibrator_sha256: str | None = None,
    ) -> Evaluation:
        labels = np.asarray(labels, int)
        sig = {k: np.asarray(signals[k], float) for k in EVAL_FIELDS}
        ds = np.asarray(datasets if datasets is not None else ["data"] * labels.size, dtype=str)
        per_dataset = {}
        if len(set(ds.tolist())) > 1:
            for name in sorted(set(ds.tolist())):
                m = ds == name
                per_dataset[name] = {
                    **compute_metrics(labels[m], {k: v[m] for k, v in sig.items()}),
                    "guarantees": check_guarantees(thresholds, sig["risk"][m], labels[m]),
                }
        return cls(
            labels=labels,
            signals=sig,
            datasets=ds,
            metrics=compute_metrics(labels, sig),
            per_dataset=per_dataset,
            guarantees=check_guarantees(thresholds, sig["risk"], labels),
            thresholds=list(thresholds),
            n_invalid=n_invalid,
            model=dict(model or {}),
            calibrator_sha256=calibrator_sha256,
        )

    def to_json(self) -> dict[str, Any]:
        """The ``guarduq evaluate --json`` object."""
        return {
            **self.metrics,
            "n_invalid": self.n_invalid,
            "guarantees": self.guarantees,
            "per_dataset": self.per_dataset,
            "model": self.model,
            "calibrator_sha256": self.calibrator_sha256,
        }

    def data_dict(self, digits: int = 6) -> dict[str, list[Any]]:
        """Compact per-item arrays (embedded in artifacts so reports can be redrawn)."""
        out: dict[str, list[Any]] = {
            "label": self.labels.tolist(),
            "dataset": self.datasets.tolist(),
        }
        for k, v in self.signals.items():
            out[k] = [float(f"{x:.{digits}g}") for x in v]
        return out

    @classmethod
    def from_data_dict(
        cls, data: Mapping[str, Sequence[Any]], thresholds: Sequence[Threshold], **kw: Any
    ) -> Evaluation:
        return cls.from_arrays(
            np.asarray(data["label"], int),
            {k: np.asarray(data[k], float) for k in EVAL_FIELDS},
            data.get("dataset"),
            thresholds,
            **kw,
        )


def check_guarantees(
    thresholds: Sequence[Threshold], risk: np.ndarray, labels: np.ndarray
) -> list[dict[str, Any]]:
    """On new data: coverage and error rate at each threshold, and whether error <= alpha held."""
    out = []
    risk, labels = np.asarray(risk, float), np.asarray(labels, int)
    for t in thresholds:
        row: dict[str, Any] = {"alpha": t.alpha, "delta": t.delta, "threshold": t.threshold}
        if t.threshold is None or risk.size == 0:
            row.update(coverage=0.0, n_accepted=0, error_rate=None, held=None)
            row["note"] = t.message or "no threshold"
        else:
            acc = risk <= t.threshold
            na = int(acc.sum())
            err = float((1 - labels[acc]).mean()) if na else None
            # Nothing accepted means no accepted answer was wrong: the guarantee holds vacuously.
            row.update(
                coverage=float(acc.mean()),
                n_accepted=na,
                error_rate=err,
                held=bool(err is None or err <= t.alpha),
            )
        out.append(row)
    return out


# --------------------------------------------------------------------------- artifact schema


class _ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None
    fingerprint: str | None


class _Scaler(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mean: list[float]
    scale: list[float]


class _Logistic(BaseModel):
    model_config = ConfigDict(extra="forbid")
    coef: list[float]
    intercept: float
    C: float


class _ThresholdModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alpha: float
    delta: float
    threshold: float | None
    coverage: float
    n: int
    n_accepted: int
    errors: int
    error_rate: float | None
    upper_bound: float | None
    message: str | None = None


class _DatasetRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    sha256: str
    n: int


class _Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["guarduq-calibrator"]
    format_version: Literal[1]
    guarduq_version: str
    created: str
    model: _ModelRef
    features: list[str]
    scaler: _Scaler
    logistic: _Logistic
    n_fit: int
    n_fit_invalid: int
    thresholds: list[_ThresholdModel]
    metrics: dict[str, Any]
    datasets: list[_DatasetRef]
    split: dict[str, float] | None = None
    evaluation_data: dict[str, list[Any]] | None = None


# --------------------------------------------------------------------------- the calibrator


class Calibrator:
    """Maps a model's raw scores to ``risk = P(wrong | scores)`` and holds guaranteed thresholds.

    Parameters (set in ``__init__``, scikit-learn style): ``features`` (names in ``FEATURES``),
    ``C`` (inverse L2 strength), and the model's ``model_name`` / ``model_fingerprint`` the
    artifact is bound to. Fitted state ends in ``_``.
    """

    def __init__(
        self,
        features: Sequence[str] = DEFAULT_FEATURES,
        *,
        C: float = 1.0,
        model_name: str | None = None,
        model_fingerprint: str | None = None,
    ) -> None:
        unknown = [f for f in features if f not in FEATURES]
        if unknown or not features:
            raise CalibrationError(
                f"unknown feature(s) {unknown or '(none given)'}; choose from {sorted(FEATURES)}"
            )
        if len(set(features)) != len(features):
            raise CalibrationError(f"duplicate features in {list(features)}")
        if not C > 0:
            raise CalibrationError(f"C must be > 0, got {C}")
        self.features = tuple(features)
        self.C = float(C)
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.thresholds_: list[Threshold] = []
        self.metrics_: dict[str, Any] = {}
        self.datasets_: list[dict[str, Any]] = []
        self.split_: dict[str, float] | None = None  # how the data was split (test_fraction, ...)
        self.evaluation_: Evaluation | None = None
        self._sha256: str | None = None
        self.created_: str | None = None

    # -- fitting

    def fit(self, scores: Sequence[ScoreLike], labels: Iterable[Any]) -> Calibrator:
        """Fit the scaler + logistic regression on valid rows (invalid ones are counted, excluded)."""
        scores = list(scores)
        X, ok = feature_matrix(scores, self.features)
        y = _labels(labels, len(scores))
        X, y = X[ok], y[ok]
        self.n_fit_invalid_ = int((~ok).sum())
        if self.n_fit_invalid_:
            log.warning("calibration_invalid_excluded", n=self.n_fit_invalid_, n_total=len(scores))
        if y.size < MIN_FIT_ITEMS:
            raise CalibrationError(
                f"need at least {MIN_FIT_ITEMS} valid labelled items to fit, got {y.size}"
            )
        if y.min() == y.max():
            which = "correct" if y[0] == 1 else "wrong"
            raise CalibrationError(
                f"all {y.size} fitting labels are '{which}': a calibrator needs both correct and "
                "wrong answers (use more or different data)"
            )
        pipe = Pipeline(
            [("scale", StandardScaler()), ("logistic", LogisticRegression(C=self.C, max_iter=1000))]
        )
        pipe.fit(X, 1 - y)  # target: wrong
        self.pipeline_ = pipe
        self.n_fit_ = int(y.size)
        self.created_ = datetime.now(UTC).isoformat(timespec="seconds")
        self._sha256 = None
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "pipeline_"):
            raise CalibrationError("calibrator is not fitted; call fit() or Calibrator.load()")

    def predict_risk(self, scores: Sequence[ScoreLike]) -> np.ndarray:
        """P(wrong | scores) per response; 1.0 (fail closed) for invalid or non-finite scores."""
        self._check_fitted()
        scores = list(scores)
        X, ok = feature_matrix(scores, self.features)
        risk = np.ones(len(scores), dtype=float)
        if ok.any():
            risk[ok] = self.pipeline_.predict_proba(X[ok])[:, 1]
        return risk

    def risk(self, scores: ScoreLike) -> float:
        """``predict_risk`` for one response."""
        return float(self.predict_risk([scores])[0])

    def fit_thresholds(
        self,
        scores: Sequence[ScoreLike],
        labels: Iterable[Any],
        alphas: Sequence[float] = (0.1, 0.2, 0.3),
        delta: float = 0.1,
    ) -> list[Threshold]:
        """Choose one guaranteed threshold per alpha on labelled data *not* used by ``fit``."""
        self._check_fitted()
        scores = list(scores)
        y = _labels(labels, len(scores))
        _, ok = feature_matrix(scores, self.features)
        risk = self.predict_risk(scores)[ok]
        wrong = 1 - y[ok]
        if wrong.size == 0:
            raise CalibrationError("no valid items to choose thresholds on")
        self.thresholds_ = [select_threshold(risk, wrong, a, delta) for a in sorted(set(alphas))]
        for t in self.thresholds_:
            if t.threshold is None:
                log.warning("threshold_not_met", alpha=t.alpha, delta=t.delta, message=t.message)
        self._sha256 = None
        return self.thresholds_

    def threshold_for(self, alpha: float) -> float | None:
        """The certified threshold for ``alpha`` (None when none met it or it was not asked for)."""
        for t in self.thresholds_:
            if math.isclose(t.alpha, alpha):
                return t.threshold
        return None

    # -- evaluation

    def evaluate(
        self,
        scores: Sequence[ScoreLike],
        labels: Iterable[Any],
        datasets: Sequence[str] | None = None,
    ) -> Evaluation:
        """Metrics on labelled data and whether each stored guarantee held on it."""
        self._check_fitted()
        scores = list(scores)
        y = _labels(labels, len(scores))
        _, ok = feature_matrix(scores, self.features)
        raw_fields = [k for k in EVAL_FIELDS if k != "risk"]
        raw = np.array(
            [[_as_float(as_score_dict(s).get(k)) for k in raw_fields] for s in scores], dtype=float
        ).reshape(len(scores), len(raw_fields))
        ok &= np.isfinite(raw).all(axis=1)  # raw signals must be finite too, or AUROCs see NaNs
        signals = {k: raw[ok, j] for j, k in enumerate(raw_fields)}
        signals["risk"] = self.predict_risk(scores)[ok]
        ds = np.asarray(datasets, dtype=str)[ok] if datasets is not None else None
        return Evaluation.from_arrays(
            y[ok],
            signals,
            ds,
            self.thresholds_,
            n_invalid=int((~ok).sum()),
            model={"name": self.model_name, "fingerprint": self.model_fingerprint},
            calibrator_sha256=self._sha256,
        )

    def attach_evaluation(self, evaluation: Evaluation) -> None:
        """Store held-out metrics (and per-item data for reports) in the artifact."""
        self.evaluation_ = evaluation
        self.metrics_ = {**evaluation.metrics, "n_invalid": evaluation.n_invalid}
        if evaluation.per_dataset:
            self.metrics_["per_dataset"] = evaluation.per_dataset
        self.metrics_["guarantees"] = evaluation.guarantees
        self._sha256 = None

    # -- model binding

    def check_model(self, fingerprint: str | None, *, allow_mismatch: bool = False) -> None:
        """Refuse to serve a model whose weights differ from the ones this was fitted on."""
        if fingerprint is None or self.model_fingerprint is None:
            return
        if fingerprint != self.model_fingerprint:
            msg = (
                f"calibrator was fitted for model '{self.model_name}' (fingerprint "
                f"{self.model_fingerprint}), not for this one (fingerprint {fingerprint}); raw "
                "scores do not transfer across models - fit a calibrator for this model"
            )
            if not allow_mismatch:
                raise FingerprintMismatchError(msg)
            log.warning("calibrator_fingerprint_mismatch_overridden", detail=msg)

    # -- artifact

    @property
    def sha256(self) -> str | None:
        """sha256 of the artifact file this calibrator was last saved to or loaded from."""
        return self._sha256

    def to_dict(self, include_evaluation_data: bool = True) -> dict[str, Any]:
        self._check_fitted()
        import guarduq

        scaler: StandardScaler = self.pipeline_.named_steps["scale"]
        logistic: LogisticRegression = self.pipeline_.named_steps["logistic"]
        out = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "guarduq_version": getattr(guarduq, "__version__", "unknown"),
            "created": self.created_ or datetime.now(UTC).isoformat(timespec="seconds"),
            "model": {"name": self.model_name, "fingerprint": self.model_fingerprint},
            "features": list(self.features),
            "scaler": {"mean": scaler.mean_.tolist(), "scale": scaler.scale_.tolist()},
            "logistic": {
                "coef": logistic.coef_[0].tolist(),
                "intercept": float(logistic.intercept_[0]),
                "C": self.C,
            },
            "n_fit": self.n_fit_,
            "n_fit_invalid": self.n_fit_invalid_,
            "thresholds": [asdict(t) for t in self.thresholds_],
            "metrics": _jsonable(self.metrics_),
            "datasets": self.datasets_,
            "split": self.split_,
            "evaluation_data": self.evaluation_.data_dict()
            if include_evaluation_data and self.evaluation_ is not None
            else None,
        }
        return out

    def save(self, path: str | os.PathLike[str], include_evaluation_data: bool = True) -> str:
        """Write the JSON artifact atomically (temp file + fsync + rename); returns its sha256."""
        data = json.dumps(self.to_dict(include_evaluation_data), indent=1, allow_nan=False)
        raw = (data + "\n").encode()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; an artifact is meant to be shared
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._sha256 = hashlib.sha256(raw).hexdigest()
        return self._sha256

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        expected_fingerprint: str | None = None,
        allow_mismatch: bool = False,
    ) -> Calibrator:
        """Read an artifact; ``FingerprintMismatchError`` if it belongs to another model.

        ``allow_mismatch=True`` loads it anyway and logs a warning (scores will be miscalibrated).
        """
        path = Path(path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ArtifactError(f"calibrator file not found: {path}") from None
        except OSError as exc:
            raise ArtifactError(f"cannot read calibrator {path}: {exc}") from exc
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{path} is not valid JSON (corrupt calibrator?): {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ArtifactError(f"{path} is not a guarduq calibrator (format != {FORMAT!r})")
        if doc.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{path} has calibrator format version {doc.get('format_version')!r}; this guarduq "
                f"reads version {FORMAT_VERSION} (refit it or upgrade guarduq)"
            )
        try:
            art = _Artifact.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ArtifactError(f"{path}: corrupt calibrator at '{where}': {first['msg']}") from exc
        self = cls._from_artifact(art, path)
        self._sha256 = hashlib.sha256(raw).hexdigest()
        self.check_model(expected_fingerprint, allow_mismatch=allow_mismatch)
        return self

    @classmethod
    def _from_artifact(cls, art: _Artifact, path: Path) -> Calibrator:
        k = len(art.features)
        numbers = [*art.scaler.mean, *art.scaler.scale, *art.logistic.coef, art.logistic.intercept]
        if not (len(art.scaler.mean) == len(art.scaler.scale) == len(art.logistic.coef) == k):
            raise ArtifactError(f"{path}: parameter lengths do not match the {k} features")
        if not all(math.isfinite(x) for x in numbers) or min(art.scaler.scale) <= 0:
            raise ArtifactError(f"{path}: non-finite or invalid calibrator parameters")
        try:
            self = cls(
                art.features,
                C=art.logistic.C,
                model_name=art.model.name,
                model_fingerprint=art.model.fingerprint,
            )
        except CalibrationError as exc:
            raise ArtifactError(f"{path}: {exc}") from exc
        scaler = StandardScaler()
        scaler.mean_ = np.asarray(art.scaler.mean, float)
        scaler.scale_ = np.asarray(art.scaler.scale, float)
        scaler.var_ = scaler.scale_**2
        scaler.n_features_in_ = k
        scaler.n_samples_seen_ = art.n_fit
        logistic = LogisticRegression(C=art.logistic.C)
        logistic.coef_ = np.asarray([art.logistic.coef], float)
        logistic.intercept_ = np.asarray([art.logistic.intercept], float)
        logistic.classes_ = np.array([0, 1])
        logistic.n_features_in_ = k
        logistic.n_iter_ = np.array([0])
        self.pipeline_ = Pipeline([("scale", scaler), ("logistic", logistic)])
        self.n_fit_ = art.n_fit
        self.n_fit_invalid_ = art.n_fit_invalid
        self.thresholds_ = [Threshold(**t.model_dump()) for t in art.thresholds]
        self.metrics_ = art.metrics
        self.datasets_ = [d.model_dump() for d in art.datasets]
        self.split_ = art.split
        self.created_ = art.created
        if art.evaluation_data:
            try:
                self.evaluation_ = Evaluation.from_data_dict(
                    art.evaluation_data,
                    self.thresholds_,
                    model={"name": self.model_name, "fingerprint": self.model_fingerprint},
                )
            except (KeyError, ValueError, TypeError) as exc:
                raise ArtifactError(f"{path}: corrupt evaluation_data: {exc}") from exc
        return self

    def __repr__(self) -> str:
        fitted = f"n_fit={self.n_fit_}" if hasattr(self, "pipeline_") else "unfitted"
        return f"Calibrator(features={list(self.features)}, model={self.model_name!r}, {fitted})"


def _as_float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _jsonable(obj: Any) -> Any:
    """Replace NaN/inf by None so artifacts stay strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    return obj


def roc_points(wrong: np.ndarray, signal: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(false positive rate, true positive rate) for a ROC plot; None with one class."""
    wrong = np.asarray(wrong)
    if wrong.size < 2 or wrong.min() == wrong.max():
        return None
    fpr, tpr, _ = roc_curve(wrong, signal)
    return fpr, tpr
