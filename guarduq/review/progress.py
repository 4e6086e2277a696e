"""The progress line: labels so far, and how many more uniform labels the policy's α needs.

A certificate rests on the uniform sample only (the one part of review that is a simple random
sample of traffic). ``guarduq calibrate`` certifies α on its threshold split, a
``threshold_fraction`` share of the labelled answers (0.3 by default), when the exact
Clopper-Pearson ``1 - δ`` bound on the accepted answers' error rate is ≤ α. With an error rate r
the accept-everything rule needs ``accepted_needed(α, δ, r)`` answers there, and the threshold
search starts testing only at ``start_size(α, δ)``; so the uniform labels needed in all are
``ceil(max(both) / threshold_fraction)`` (``sizing.labels_needed``, the count ``guarduq calibrate
--dataset reviews`` checks too). With r ≥ α no number is enough: only a risk threshold that
isolates fewer errors can be certified, which is ``guarduq calibrate``'s job, not a count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from guarduq.calibration.sizing import labels_needed
from guarduq.calibration.splits import THRESHOLD_FRACTION


@dataclass(frozen=True)
class Progress:
    """The figures behind the line (``text``), for templates and tests."""

    items: int
    labelled: int
    unsure: int
    uniform: int  # uniform-sample items with a right/wrong label
    uniform_wrong: int
    alpha: float | None
    delta: float
    needed_total: int | None  # uniform right/wrong labels needed in all (None: not reachable)
    needed_more: int | None
    text: str

    @property
    def error_rate(self) -> float | None:
        return self.uniform_wrong / self.uniform if self.uniform else None


def progress(counts: dict[str, Any], *, alpha: float | None, delta: float,
             threshold_fraction: float = THRESHOLD_FRACTION) -> Progress:
    """The progress line from ``Store.progress()``'s counts."""
    items, labelled = int(counts.get("items", 0)), int(counts.get("labelled", 0))
    unsure = int(counts.get("unsure", 0))
    uniform, wrong = int(counts.get("labelled_uniform", 0)), int(counts.get("wrong_uniform", 0))
    head = (f"{labelled} of {items} labelled ({uniform} from the uniform sample, {wrong} of them wrong"
            f"{f'; {unsure} unsure' if unsure else ''})")
    if alpha is None:
        return Progress(items, labelled, unsure, uniform, wrong, None, delta, None, None,
                        f"{head}; no α given (--alpha or --policy), so nothing to count towards a certificate")
    rate = wrong / uniform if uniform else 0.0
    total = labels_needed(alpha, delta, threshold_fraction, rate)
    if total is None:
        return Progress(items, labelled, unsure, uniform, wrong, alpha, delta, None, None,
                        f"{head}; the policy's α = {alpha:g}: the uniform sample is wrong {rate:.0%} of the "
                        "time, at or above α, so no number of labels certifies answering everything; "
                        "only a risk threshold that leaves out more errors can (guarduq calibrate)")
    more = max(0, total - uniform)
    basis = (f"at the observed error rate {rate:.0%}" if uniform
             else "with no uniform labels yet, counting as if none were wrong")
    if more:
        tail = (f"the policy's α = {alpha:g} needs about {more} more uniform labels to certify "
                f"({total} in all {basis}, δ = {delta:g})")
    else:
        tail = (f"the policy's α = {alpha:g} has enough uniform labels to try certifying "
                f"({total} needed {basis}, δ = {delta:g})")
    return Progress(items, labelled, unsure, uniform, wrong, alpha, delta, total, more, f"{head}; {tail}")
