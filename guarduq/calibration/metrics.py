"""Metrics of a labelled set (AUROC, ECE, Brier, risk-coverage, AURC, PRR) and the ``Evaluation``
that holds them with the per-item arrays reports are drawn from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

from guarduq.calibration.features import EPISTEMIC_FLOOR
from guarduq.calibration.thresholds import Threshold, check_guarantees

ECE_BINS = 15

# Raw signals whose AUROC is reported, each oriented "higher = more likely wrong".
SIGNALS: tuple[str, ...] = ("epistemic", "aleatoric", "combined", "mean_logprob", "risk")


def auroc(wrong: np.ndarray, signal: np.ndarray) -> float | None:
    """AUROC of ``signal`` (higher = more uncertain) for detecting wrong answers; None if one class."""
    wrong = np.asarray(wrong)
    if np.unique(wrong).size < 2:
        return None
    return float(roc_auc_score(wrong, signal))


def _bins(confidence: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(clipped confidences, equal-width bin index on [0, 1] of each; 1.0 falls in the last bin)."""
    confidence = np.clip(np.asarray(confidence, dtype=float), 0.0, 1.0)
    return confidence, np.minimum((confidence * n_bins).astype(int), n_bins - 1)


def ece(confidence: np.ndarray, correct: np.ndarray, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error with equal-width bins on [0, 1]."""
    confidence, bins = _bins(confidence, n_bins)
    correct = np.asarray(correct, dtype=float)
    total = 0.0
    for b in range(n_bins):
        m = bins == b
        if m.any():
            total += m.sum() * abs(correct[m].mean() - confidence[m].mean())
    return float(total / max(confidence.size, 1))


def ece_floor(
    confidence: np.ndarray,
    n_bins: int = ECE_BINS,
    n_draws: int = 1000,
    seed: int = 0,
    chunk: int = 100,
) -> tuple[float, float]:
    """(mean, 95th percentile) ECE of a *perfectly calibrated* predictor with these confidences.

    Draw ``correct ~ Bernoulli(confidence)`` ``n_draws`` times: the confidences are then exactly
    calibrated, and each bin's ``|accuracy - confidence|`` is pure sampling noise, of order
    ``sqrt(c (1 - c) / n_bin)``. ECE sums absolute values, so this noise never averages out: it
    shrinks only as every bin fills, and on a few hundred answers it is of the size of the 0.05
    people call "calibrated". The mean is ECE's noise floor; an ECE above the 95th percentile is
    miscalibration, not noise, at the 5% level (for one test, the fitted risk taken as fixed).
    Draws come ``chunk`` rows at a time, so memory stays ``chunk x n`` on large sets.
    """
    confidence, bins = _bins(confidence, n_bins)
    if confidence.size == 0:
        return 0.0, 0.0
    rng = np.random.default_rng(seed)
    masks = [(m, confidence[m].mean()) for m in (bins == b for b in np.unique(bins))]
    null = []
    for start in range(0, n_draws, chunk):
        draws = rng.random((min(chunk, n_draws - start), confidence.size)) < confidence
        total = sum(m.sum() * np.abs(draws[:, m].mean(axis=1) - c) for m, c in masks)
        null.append(np.asarray(total) / confidence.size)
    null_ece = np.concatenate(null)
    return float(null_ece.mean()), float(np.quantile(null_ece, 0.95))


def reliability_bins(
    confidence: np.ndarray, correct: np.ndarray, n_bins: int = ECE_BINS
) -> list[dict[str, float]]:
    """Per-bin (lower edge, mean confidence, accuracy, count) for a reliability diagram."""
    confidence, bins = _bins(confidence, n_bins)
    correct = np.asarray(correct, dtype=float)
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
    floor, floor_p95 = ece_floor(conf_after)  # what a perfect calibrator would show at this n
    return {
        "n": n,
        "accuracy": float(labels.mean()),
        "auroc": {k: auroc(wrong, v) for k, v in oriented.items()},
        "ece_before": ece(conf_before, labels),
        "ece_after": ece(conf_after, labels),
        "ece_floor": floor,
        "ece_floor_p95": floor_p95,  # an ECE above it is miscalibration, not noise (5% level)
        "brier_before": brier(conf_before, labels),
        "brier": brier(conf_after, labels),
        "aurc": aurc(signals["risk"], wrong),
        "prr": prr(signals["risk"], wrong),
    }


def roc_points(wrong: np.ndarray, signal: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(false positive rate, true positive rate) for a ROC plot; None with one class."""
    wrong = np.asarray(wrong)
    if wrong.size < 2 or wrong.min() == wrong.max():
        return None
    fpr, tpr, _ = roc_curve(wrong, signal)
    return fpr, tpr


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
            "coverage_notes": self.coverage_notes(),
            "per_dataset": self.per_dataset,
            "model": self.model,
            "calibrator_sha256": self.calibrator_sha256,
        }

    def coverage_notes(self) -> list[str]:
        """Plain words for a certified threshold whose accepted answers come from few datasets.

        A guarantee holds on the mix it was measured on: a threshold may meet α by accepting one
        easy kind of question and none of the others. Then traffic of the other kinds is always
        withheld, which the pooled coverage hides; each note names those datasets and the one
        that supplies most of the accepted answers.
        """
        notes = []
        for i, g in enumerate(self.guarantees):
            if g["threshold"] is None or not g["n_accepted"] or not self.per_dataset:
                continue
            accepted = {name: m["guarantees"][i]["n_accepted"] for name, m in self.per_dataset.items()}
            parts = []  # each part reads after "alpha=... (risk <= t):"
            if none := sorted(name for name, k in accepted.items() if k == 0):
                names = none[0] if len(none) == 1 else f"{', '.join(none[:-1])} or {none[-1]}"
                parts.append(f"accepts no answer from {names}")
            top, k = max(accepted.items(), key=lambda kv: kv[1])
            items_share = float(np.mean(self.datasets == top))
            if k / g["n_accepted"] > 0.5 > items_share:
                parts.append(f"{k} of the {g['n_accepted']} accepted answers ({k / g['n_accepted']:.0%}) are "
                             f"{top}, which is {items_share:.0%} of the items")
            if parts:
                notes.append(f"alpha={g['alpha']:g} (risk <= {g['threshold']:.3g}): " + "; ".join(parts)
                             + ". The guarantee covers this mix, not each kind of question in it")
        return notes

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
        labels = np.asarray(data["label"], int)
        signals = {k: np.asarray(data[k], float) for k in EVAL_FIELDS}
        datasets = data.get("dataset")
        if datasets is not None and (len(datasets) != len(labels) or not all(isinstance(d, str) for d in datasets)):
            raise ValueError("'dataset' must list one name per item")
        if any(a.ndim != 1 or len(a) != len(labels) for a in (labels, *signals.values())):
            raise ValueError("per-item arrays must be flat lists of one length")
        return cls.from_arrays(
            labels,
            signals,
            datasets,
            thresholds,
            **kw,
        )
