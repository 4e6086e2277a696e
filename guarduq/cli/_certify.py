"""``calibrate`` refuses to write a calibrator that certifies nothing (``--allow-uncertified``
writes it anyway).

A calibrator under which no alpha asked for has a certified threshold lets nothing through under
a policy's ``risk <= threshold`` rule: put live, it withholds every reply. So ``calibrate``
(every dataset, the cascade's second stage too) leaves ``--out`` alone, whether it exists or not
(writing a fresh uncertified file and then pointing a policy at it is the same failure), and
says per alpha how many more labels would do, or that none would at the observed error rate.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from guarduq.calibration.sizing import uncertified_reason
from guarduq.calibration.thresholds import Threshold
from guarduq.errors import CalibrationError


def allow_uncertified_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-uncertified", action="store_true",
                   help="write --out even when no --alpha gets a certified threshold (a policy's "
                        "'risk <= threshold' rule then never matches: every reply is withheld)")


def check_certified(
    args: argparse.Namespace, out: Path, thresholds: Sequence[Threshold], reasons: Sequence[str],
) -> None:
    """``CalibrationError`` (the CLI's exit 2) unless some threshold is certified or
    ``--allow-uncertified`` was given; ``out`` is not touched either way."""
    if any(t.met for t in thresholds) or getattr(args, "allow_uncertified", False):
        return
    state = "left unchanged" if out.exists() else "not written"
    raise CalibrationError(
        f"no alpha asked for ({', '.join(f'{t.alpha:g}' for t in thresholds)}) has a certified "
        f"threshold, so under a 'risk <= threshold' rule this calibrator would withhold every reply; "
        f"{out} is {state}. " + "; ".join(reasons)
        + ". Pass --allow-uncertified to write it anyway"
    )


def reasons_for(
    thresholds: Sequence[Threshold], threshold_part: Sequence[Any], *, n_labels: int,
    threshold_fraction: float, unit: str,
) -> list[str]:
    """One sentence per uncertified alpha (:func:`~guarduq.calibration.sizing.uncertified_reason`)."""
    errors = sum(int(r.label) == 0 for r in threshold_part)
    return [uncertified_reason(t.alpha, t.delta, threshold_fraction, n_labels=n_labels,
                               n_threshold=len(threshold_part), threshold_errors=errors, unit=unit)
            for t in thresholds if not t.met]
