"""A cascade's second stage as a policy reads it (``guarduq.calibration.cascade`` fits it): the
checks that bind it to the first stage, and the row of numbers it scores at serving time.

The calibrator is read through its interface (``cascade_``, ``features``, ``threshold_for``,
``risk``), so this layer imports no numpy or scikit-learn. Its certificate holds only for the
first stage, alpha and band it was fitted and certified on; serving it with any other would
quietly void the guarantee, so each mismatch is a ``PolicyError`` at bind time.
"""

from __future__ import annotations

import math
from typing import Any

from guarduq.errors import PolicyError

# What a second opinion asked at serving time gives (no greedy answer: no sve_agree).
SERVABLE_FEATURES = frozenset({"first_stage_logit", "sve_mean_prob", "sve_variance", "sve_mi"})


def check_second_stage(
    policy: str, alpha: float | None, second: Any, first: Any, threshold: float | None
) -> tuple[float | None, float]:
    """(so.threshold, band upper edge) of ``second``, after checking that it was fitted on
    ``first`` (sha256), at ``alpha``, for the band that starts at ``threshold``."""
    stage = getattr(second, "cascade_", None)
    if getattr(first, "per_group", False):
        raise PolicyError(f"policy {policy!r}: a cascade needs a pooled first-stage calibrator, not one "
                          "with a model per group (its risk would not be the one the band was fitted on)")
    if not stage:
        raise PolicyError(f"policy {policy!r}: second_calibrator is not a cascade's second stage "
                          "(fit one with guarduq calibrate --cascade-on)")
    unknown = sorted(set(getattr(second, "features", ())) - SERVABLE_FEATURES)
    if unknown:
        raise PolicyError(f"policy {policy!r}: the second stage reads {unknown}, which a second opinion "
                          "asked at serving time does not give (fit it with --features cascade)")
    first_sha = getattr(first, "sha256", None)
    if stage.get("first_stage_sha256") and first_sha and stage["first_stage_sha256"] != first_sha:
        raise PolicyError(f"policy {policy!r}: the second stage was fitted on another first-stage "
                          f"calibrator (sha256 {stage['first_stage_sha256'][:12]}, this one {first_sha[:12]})")
    if alpha is None or not math.isclose(stage["alpha"], alpha):
        raise PolicyError(f"policy {policy!r} asks for alpha={alpha}, but its second stage was "
                          f"fitted and certified at alpha={stage['alpha']}")
    lower = stage.get("band_lower")
    if (lower is None) != (threshold is None) or (lower is not None and not math.isclose(lower, threshold or 0.0)):
        raise PolicyError(f"policy {policy!r}: the second stage's band starts at first-stage risk "
                          f"{lower}, but the policy's threshold is {threshold}: refit it on this calibrator")
    t2 = second.threshold_for(alpha)
    return (None if t2 is None else float(t2)), float(stage["band_upper"])


def second_stage_row(risk: float, mean_prob: float, variance: float, mutual_information: float,
                     agrees: bool | None) -> dict[str, float]:
    """The score row the second stage reads: the first-stage risk and the second opinion's numbers,
    under the keys ``guarduq.calibration.features`` reads them by."""
    row = {"first_risk": risk, "sve_mean_prob": mean_prob, "sve_variance": variance, "sve_mi": mutual_information}
    if agrees is not None:
        row["sve_agree"] = float(agrees)
    return row
