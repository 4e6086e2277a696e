"""Features a calibrator reads off the scores: the named feature functions and the feature matrix."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from guarduq.errors import CalibrationError

# An exactly-zero gradient (p̄ saturated) would make log(epistemic) = -inf; floor it instead.
EPISTEMIC_FLOOR = 1e-12

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
