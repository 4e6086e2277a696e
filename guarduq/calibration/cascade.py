"""A cascade: the costly second opinion only where the first stage cannot settle an answer.

Stage 1 is an ordinary calibrator: risk ``r1`` and the threshold ``t1`` certified at ``alpha``.
Answers with ``r1 <= t1`` are accepted at once. The next ``share`` of answers by ``r1`` (the
*band*, ``t1 < r1 <= hi``) pays for the second opinion (an SVE: one folded forward of its
members); everything above ``hi`` is refused without it. Stage 2 is a second calibrator over the
first stage's logit and the SVE's features (``FEATURE_SETS["cascade"]``), fitted on the band's
answers only, with its own threshold ``t2`` certified on the band's answers of the threshold
split. No number in the decision is set by hand: ``t1`` and ``t2`` are certified, ``hi`` is the
cost the user chose (the share that pays).

Why the whole cascade keeps the guarantee. The accepted answers are the union of two disjoint
sets, ``A1 = {r1 <= t1}`` and ``A2 = {band, r2 <= t2}``. Learn-then-Test certifies, each with
probability at least ``1 - delta_k``, that the error rate of ``A1`` is at most ``alpha`` and that
of ``A2`` is at most ``alpha``. The error rate of the union is the average of the two weighted by
their sizes, so it is at most ``alpha`` too, with probability at least ``1 - delta_1 - delta_2``
(union bound). ``fit_second_stage`` takes the ``delta`` of its own certificate; the cascade's is
the sum of both stages' ``delta`` (state it, or give each stage half).

The band is chosen from the fit split's first-stage risks alone (no labels), so the threshold
split's band answers are a fresh sample from the band for the certificate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from guarduq._logging import get_logger
from guarduq.calibration.calibrator import Calibrator
from guarduq.calibration.features import FEATURE_SETS
from guarduq.errors import CalibrationError

log = get_logger("cascade")

CASCADE_FEATURES: tuple[str, ...] = FEATURE_SETS["cascade"]
DEFAULT_SHARE = 1 / 3  # at most a third of the answers pay for the second opinion


@dataclass(frozen=True)
class Band:
    """First-stage risks ``lower < r1 <= upper`` get the second opinion (``lower`` None: from
    the lowest risk, when the first stage certifies nothing at ``alpha``)."""

    lower: float | None
    upper: float
    share: float  # of the answers it was chosen on

    def contains(self, risk: np.ndarray) -> np.ndarray:
        risk = np.asarray(risk, dtype=float)
        above = risk > self.lower if self.lower is not None else np.ones(risk.shape, dtype=bool)
        return above & (risk <= self.upper)


def choose_band(first_risk: Sequence[float], lower: float | None, share: float = DEFAULT_SHARE) -> Band:
    """The band from ``lower`` (exclusive) up to the highest first-stage risk that keeps at most
    ``share`` of all the answers inside it, so the cost bound holds on the answers it was chosen
    on (a tie at the upper edge is left out whole)."""
    if not 0 < share <= 1:
        raise CalibrationError(f"band share must be in (0, 1], got {share}")
    r = np.sort(np.asarray(first_risk, dtype=float))
    if r.size == 0:
        raise CalibrationError("no first-stage risks to choose a band from")
    start = int(np.searchsorted(r, lower, side="right")) if lower is not None else 0
    budget = int(np.floor(share * r.size))
    if start >= r.size or budget < 1:
        raise CalibrationError(f"the band above first-stage risk {lower} is empty ({r.size} answers, share {share})")
    end = min(start + budget, r.size)  # r[start:end] are inside; ties at the edge stay outside
    while end > start and end < r.size and r[end] == r[end - 1]:
        end -= 1
    if end == start:
        raise CalibrationError("every answer in the band ties at one first-stage risk")
    upper = float(r[end - 1])
    return Band(lower, upper, (end - start) / r.size)


def with_first_risk(scores: Iterable[Mapping[str, Any]], first_risk: Sequence[float]) -> list[dict[str, Any]]:
    """Score dicts with the first stage's verdict (``first_risk``) added, as stage 2 reads them."""
    return [{**s, "first_risk": float(r)} for s, r in zip(scores, first_risk, strict=True)]


def fit_second_stage(
    first: Calibrator,
    fit_scores: Sequence[Mapping[str, Any]],
    fit_labels: Sequence[Any],
    threshold_scores: Sequence[Mapping[str, Any]],
    threshold_labels: Sequence[Any],
    *,
    alpha: float,
    delta: float,
    share: float = DEFAULT_SHARE,
    features: str | Sequence[str] = CASCADE_FEATURES,
    C: float | str = "cv",
) -> Calibrator:
    """The second-stage calibrator of a cascade at ``alpha``: fitted on the fit split's band
    answers, its threshold certified (at ``delta``) on the threshold split's band answers. The
    band is stored in ``cascade_`` and saved with the artifact."""
    if first.per_group:  # its served risk depends on the reply's group, which the band does not see
        raise CalibrationError("a cascade needs a pooled first stage: this one has a model per group")
    lower = first.threshold_for(alpha)
    r_fit = first.predict_risk(fit_scores)
    band = choose_band(r_fit, lower, share)
    inside = band.contains(r_fit)
    second = Calibrator(features, C=C, model_name=first.model_name, model_fingerprint=first.model_fingerprint,
                        model_source=first.model_source)  # type: ignore[arg-type]
    fit_rows = with_first_risk(fit_scores, r_fit)
    second.fit([s for s, k in zip(fit_rows, inside, strict=True) if k],
               [y for y, k in zip(fit_labels, inside, strict=True) if k])
    r_thr = first.predict_risk(threshold_scores)
    in_thr = band.contains(r_thr)
    if not in_thr.any():
        raise CalibrationError("no threshold-split answer falls in the band: use more data")
    thr_rows = with_first_risk(threshold_scores, r_thr)
    second.fit_thresholds([s for s, k in zip(thr_rows, in_thr, strict=True) if k],
                          [y for y, k in zip(threshold_labels, in_thr, strict=True) if k],
                          alphas=(alpha,), delta=delta)
    second.cascade_ = {
        "first_stage_sha256": first.sha256, "band_lower": band.lower, "band_upper": band.upper,
        "band_share": band.share, "alpha": float(alpha), "delta": float(delta),
    }
    log.info("cascade_fitted", alpha=alpha, band=[band.lower, band.upper], share=round(band.share, 3),
             n_fit=int(inside.sum()), n_threshold=int(in_thr.sum()), threshold=second.threshold_for(alpha))
    return second


def band_of(second: Calibrator) -> Band:
    """The band a second-stage calibrator was fitted in; ``CalibrationError`` for any other."""
    c = second.cascade_
    if c is None:
        raise CalibrationError("this calibrator is not a cascade's second stage (it has no band)")
    return Band(c["band_lower"], c["band_upper"], c["band_share"])


def cascade_accepts(
    first_risk: np.ndarray, second_risk: np.ndarray, first_threshold: float | None, band: Band,
    second_threshold: float | None,
) -> np.ndarray:
    """Which answers the cascade accepts: ``r1 <= t1``, or in the band with ``r2 <= t2``.
    ``second_risk`` is read only inside the band (elsewhere it may be NaN: never computed)."""
    r1 = np.asarray(first_risk, dtype=float)
    r2 = np.asarray(second_risk, dtype=float)
    first_ok = r1 <= first_threshold if first_threshold is not None else np.zeros(r1.shape, dtype=bool)
    if second_threshold is None:
        return first_ok
    with np.errstate(invalid="ignore"):
        return first_ok | (band.contains(r1) & (r2 <= second_threshold))
