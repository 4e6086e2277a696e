"""Which replies go to human review, with the probabilities that let calibration undo the choice.

A ground-floor module (numpy and ``guarduq.errors`` only): the store records samples, the review
page counts them and calibration reweights them, and all three read the one ``Sample`` here.

Two independent draws per reply:

- the **uniform** draw, probability ``rate`` for every reply whatever its scores: the replies it
  picks are a simple random sample of traffic, the only part a certificate may rest on;
- the **extra** draw, probability ``extra_probability``: 1 for an escalation (when
  ``escalations``), else the largest rate of the risk ``bands`` the risk lies in (a reply with no
  risk is in no band), else 0.

P(picked) = 1 − (1 − rate)(1 − extra_probability), recorded with every sample.

Fit weights (``fit_weights``). Calibration splits the sample: uniform-drawn items go to the fit
split with probability f (the rest hold out for thresholds and tests, which must be a simple
random sample), and items that only the extra draw picked always go to fit (they are not a
random sample, so they are of no use elsewhere). For a reply with uniform rate r and extra
probability e, with U ~ Bern(r), S ~ Bern(f) and B ~ Bern(e) independent:

    in fit  ⇔  (U ∧ S) ∨ (¬U ∧ B),  so  π_fit = P(in fit) = r·f + (1 − r)·e

(the two events are disjoint). Weighting each fit item by 1/π_fit (Horvitz–Thompson) makes a
weighted sum over the fit split an unbiased estimate of the same sum over all traffic, so a
calibrator fit with these weights fits the traffic, not the over-sampled escalations and bands.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from guarduq.errors import StoreInputError


def _probability(x: Any, what: str, *, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not (0.0 <= float(x) <= 1.0):
        raise StoreInputError(f"{what} must be a probability in [0, 1], got {x!r}")
    if positive and float(x) == 0.0:
        raise StoreInputError(f"{what} must be above 0, got {x!r}")
    return float(x)


@dataclass(frozen=True)
class Sample:
    """Whether a reply goes to review, and the probabilities calibration needs to reweight it.

    ``uniform``: the uniform draw (probability ``rate``, independent of everything about the
    reply) fired; the replies it picks are a simple random sample of traffic, the only part a
    certificate may rest on. ``extra_probability``: the probability that a reason other than the
    uniform draw picks this reply (1.0 for an escalation, a band's rate, else 0.0).
    ``inclusion_probability`` = P(picked for any reason) = 1 - (1 - rate)(1 - extra_probability).
    """

    reasons: tuple[str, ...]
    uniform: bool
    rate: float
    extra_probability: float
    inclusion_probability: float

    @property
    def sampled(self) -> bool:
        return bool(self.reasons)

    def to_json(self) -> dict[str, Any]:
        """The sampling record as an export line's ``guarduq_sample`` holds it."""
        return {"uniform": self.uniform, "rate": self.rate, "extra_probability": self.extra_probability,
                "inclusion_probability": self.inclusion_probability, "reasons": list(self.reasons)}

    @classmethod
    def from_json(cls, value: Any) -> Sample:
        """The inverse of ``to_json``, checked: ``StoreInputError`` names what is missing or out
        of range (a sampled item's inclusion probability must be above 0, or its weight is
        infinite)."""
        if not isinstance(value, Mapping):
            raise StoreInputError("a sampling record must be an object")
        if not isinstance(value.get("uniform"), bool):
            raise StoreInputError("a sampling record's 'uniform' must be true or false")
        reasons = value.get("reasons", ())
        if not isinstance(reasons, list | tuple) or not all(isinstance(r, str) for r in reasons):
            raise StoreInputError("a sampling record's 'reasons' must be a list of strings")
        try:
            return cls(
                reasons=tuple(reasons),
                uniform=value["uniform"],
                rate=_probability(value["rate"], "rate"),
                extra_probability=_probability(value["extra_probability"], "extra_probability"),
                inclusion_probability=_probability(value["inclusion_probability"], "inclusion_probability",
                                                   positive=True),
            )
        except KeyError as exc:
            raise StoreInputError(f"a sampling record lacks {exc}") from None


class ReviewSampler:
    """Draws the review sample: every escalation, a uniform ``rate``, and risk ``bands``.

    ``bands``: ``(low, high, rate)`` each; a risk in [low, high] is drawn at ``rate`` (the
    largest, where bands overlap). Thread-safe: draws take a lock around one Generator, so a
    seeded sampler gives the same draws in the same order.
    """

    def __init__(
        self,
        rate: float = 0.0,
        bands: Sequence[tuple[float, float, float]] = (),
        escalations: bool = True,
        seed: int | None = None,
    ) -> None:
        self.rate = _probability(rate, "review rate")
        checked: list[tuple[float, float, float]] = []
        for i, band in enumerate(bands):
            try:
                low, high, band_rate = band
            except (TypeError, ValueError):
                raise StoreInputError(f"review band {i} must be (low, high, rate), got {band!r}") from None
            low = _probability(low, f"review band {i} low")
            high = _probability(high, f"review band {i} high")
            if low > high:
                raise StoreInputError(f"review band {i}: low {low} is above high {high}")
            checked.append((low, high, _probability(band_rate, f"review band {i} rate", positive=True)))
        self.bands: tuple[tuple[float, float, float], ...] = tuple(checked)
        self.escalations = bool(escalations)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, review: Any, seed: int | None = None) -> ReviewSampler:
        """From a policy's ``review`` settings (``rate``, ``escalations``, ``bands`` with
        ``low``/``high``/``rate``), read by attribute so the store does not import the policy."""
        bands = [(b.low, b.high, b.rate) for b in getattr(review, "bands", None) or ()]
        return cls(
            rate=getattr(review, "rate", 0.0),
            bands=bands,
            escalations=getattr(review, "escalations", True),
            seed=seed,
        )

    def __repr__(self) -> str:
        return f"ReviewSampler(rate={self.rate}, bands={list(self.bands)}, escalations={self.escalations})"

    def extra_probability(self, risk: float | None, escalated: bool) -> float:
        """The probability that a reason other than the uniform draw picks this reply."""
        if escalated and self.escalations:
            return 1.0
        if risk is None or not math.isfinite(risk):
            return 0.0
        return max((r for low, high, r in self.bands if low <= risk <= high), default=0.0)

    def draw(self, risk: float | None, escalated: bool, drift_rate: float = 0.0) -> Sample:
        """Whether this reply goes to review, why, and with what probability.

        ``drift_rate``: while a policy's drift action raises review (``on_drift``), the extra
        draw's probability is at least this. It is an extra draw, not the uniform one, so the
        uniform sample stays one simple random sample of traffic (the certificate's), and the
        drift window's replies reach the fit split with their own weights."""
        band = self.extra_probability(risk, escalated)
        drift = _probability(drift_rate, "drift review rate")
        extra = max(band, drift)
        with self._lock:  # always two draws, so the stream does not depend on the reply
            u, b = self._rng.random(2)
        uniform = bool(u < self.rate)
        picked_extra = bool(b < extra)
        reasons: list[str] = []
        if picked_extra and escalated and self.escalations:
            reasons.append("escalation")
        if uniform:
            reasons.append("uniform")
        if picked_extra and "escalation" not in reasons:
            reasons.append("drift" if drift > band else "band")
        return Sample(
            reasons=tuple(reasons),
            uniform=uniform,
            rate=self.rate,
            extra_probability=extra,
            inclusion_probability=inclusion_probability(self.rate, extra),
        )


def inclusion_probability(rate: float, extra_probability: float) -> float:
    """P(picked for any reason) = 1 − (1 − rate)(1 − extra_probability)."""
    return 1.0 - (1.0 - rate) * (1.0 - extra_probability)


def fit_weights(
    samples: Sequence[Sample], in_fit_uniform: Sequence[bool], fit_fraction: float,
    labelled_fraction: tuple[float, float] = (1.0, 1.0),
) -> np.ndarray:
    """Horvitz–Thompson weights 1/π_fit for the calibration fit split (derived in the module
    docstring); 0 for items outside it.

    ``in_fit_uniform[i]``: for a uniform-drawn item, whether the random split put it in fit
    (drawn with probability ``fit_fraction``); ignored for the others, which are in fit when
    another reason picked them.

    ``labelled_fraction`` = (λ_u, λ_o): the share of the uniform-drawn items, and of the items
    only another reason picked, that reviewers labelled. Reviewers rarely label every sampled
    item, and not at the same rate in each stratum (escalations first, say); treating labelling
    within a stratum as random, an item is in the labelled fit set with probability
    π = rate·f·λ_u + (1 − rate)·extra·λ_o, which reduces to the sampling formula when all are
    labelled.
    """
    lam_u = _probability(labelled_fraction[0], "labelled_fraction (uniform)")
    lam_o = _probability(labelled_fraction[1], "labelled_fraction (other)")
    if len(samples) != len(in_fit_uniform):
        raise StoreInputError(f"{len(samples)} samples but {len(in_fit_uniform)} split flags")
    f = _probability(fit_fraction, "fit_fraction")
    out = np.zeros(len(samples), dtype=np.float64)
    for i, (s, in_fit) in enumerate(zip(samples, in_fit_uniform, strict=True)):
        fit = bool(in_fit) if s.uniform else s.sampled
        if not fit:
            continue
        pi = s.rate * f * lam_u + (1.0 - s.rate) * s.extra_probability * lam_o
        if not pi > 0.0:
            raise StoreInputError(
                f"sample {i} is in the fit split but has fit probability {pi} (rate {s.rate}, "
                f"fit_fraction {f}, extra_probability {s.extra_probability}): inconsistent split"
            )
        out[i] = 1.0 / pi
    return out
