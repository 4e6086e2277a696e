"""How many labelled answers a calibration set needs, and the warnings when it has too few.

A threshold is certified for ``alpha`` when the exact (Clopper-Pearson) ``1 - delta`` upper
bound on the error rate among the accepted threshold-split answers is <= alpha. Even with no
error at all, that takes a minimum number of accepted answers; with an observed error rate r it
takes more, and for r >= alpha no number is enough. The risk model itself needs some right and
some wrong answers in its fit split. :func:`calibration_warnings` turns these facts into plain
sentences with the figures, before any time is spent.
"""

from __future__ import annotations

import math

from guarduq.calibration.thresholds import clopper_pearson_upper, start_size

# A logistic fit on fewer wrong (or right) answers than this mostly learns the base rate.
MIN_PER_CLASS = 10
_MAX_N = 1_000_000


def accepted_needed(alpha: float, delta: float, error_rate: float = 0.0) -> int | None:
    """Smallest n with CP_upper(ceil(error_rate * n), n, delta) <= alpha; None if none exists.

    ``error_rate = 0`` gives the floor any certificate needs: ceil(log(delta) / log(1 - alpha)).
    """
    if not 0 < alpha < 1 or not 0 < delta < 1:
        raise ValueError(f"alpha and delta must be in (0, 1), got {alpha}, {delta}")
    if error_rate >= alpha:
        return None
    lo = max(1, math.ceil(math.log(delta) / math.log(1 - alpha)))  # the zero-error floor
    n = lo
    while n <= _MAX_N:
        if clopper_pearson_upper(math.ceil(error_rate * n - 1e-9), n, delta) <= alpha:
            return n
        n = n + 1 if n < 2000 else int(n * 1.01) + 1
    return None


def calibration_warnings(
    *,
    n_fit: int,
    n_fit_wrong: int,
    n_threshold: int,
    n_threshold_wrong: int,
    alphas: tuple[float, ...] | list[float],
    delta: float,
    threshold_fraction: float,
    fit_fraction: float,
) -> list[str]:
    """Plain-language warnings (empty when the set is large and balanced enough).

    The minimum per alpha is the larger of the zero-error Clopper-Pearson floor and
    :func:`~guarduq.calibration.thresholds.start_size`, where ``select_threshold``'s first
    sequence starts testing.

    Each names how many labelled answers (in all, given the split fractions) would be needed.
    """
    out: list[str] = []
    n_total = n_fit + n_threshold
    fit_right = n_fit - n_fit_wrong
    minority = min(n_fit_wrong, fit_right)
    if minority < MIN_PER_CLASS and n_fit > 0:
        which = "wrong" if n_fit_wrong <= fit_right else "correct"
        share = minority / n_fit if n_fit else 0.0
        need = (
            math.ceil(MIN_PER_CLASS / max(share, 1e-9) / max(fit_fraction, 1e-9))
            if share > 0
            else None
        )
        hint = (
            f"about {need} labelled answers in all at this accuracy"
            if need is not None and need < _MAX_N
            else "more data with both right and wrong answers"
        )
        out.append(
            f"too small or one-sided to fit a risk model well: the fit split holds {n_fit} answers, only "
            f"{minority} of them {which}; at least {MIN_PER_CLASS} of each are needed ({hint})"
        )
    base = n_threshold_wrong / n_threshold if n_threshold else 1.0
    for alpha in sorted(set(alphas)):
        floor = accepted_needed(alpha, delta, 0.0)
        assert floor is not None
        n_min = max(floor, start_size(alpha, delta))  # where the fixed-sequence test starts
        at_base = accepted_needed(alpha, delta, base)
        if n_threshold < n_min:
            out.append(
                f"alpha={alpha:g}: cannot be certified: the threshold test needs at least {n_min} "
                f"accepted answers in the threshold split (the {1 - delta:g}-confidence "
                f"Clopper-Pearson bound alone needs {floor} with zero errors; the test starts "
                f"where an error rate of alpha/2 still passes), which holds {n_threshold}; that "
                f"is at least {math.ceil(n_min / threshold_fraction)} labelled answers in all "
                f"(now {n_total} outside the test split), more when some answers are refused"
            )
        elif at_base is None:
            half = accepted_needed(alpha, delta, alpha / 2)
            assert half is not None
            out.append(
                f"alpha={alpha:g}: the threshold split's error rate is {base:.2f} >= alpha, so a "
                "threshold exists only where risk isolates a subset with few errors; at an "
                f"error rate of alpha/2 that subset needs {half} accepted answers (about "
                f"{math.ceil(half / threshold_fraction)} labelled answers in all if every "
                "one were accepted, more in proportion to those refused)"
            )
        elif n_threshold < at_base:
            out.append(
                f"alpha={alpha:g}: with the observed error rate {base:.2f}, certifying even the "
                f"accept-everything rule needs {at_base} answers in the threshold split, which "
                f"holds {n_threshold} (about {math.ceil(at_base / threshold_fraction)} labelled "
                "answers in all)"
            )
    return out


def labels_needed(alpha: float, delta: float, threshold_fraction: float, error_rate: float = 0.0) -> int | None:
    """Labelled answers in all (fit + threshold + test) before ``alpha`` can be certified.

    The threshold split (``threshold_fraction`` of them) must hold the test's first accepted
    set: at least the zero-error Clopper-Pearson floor and :func:`start_size`, more at an
    observed ``error_rate`` (:func:`accepted_needed`; None when ``error_rate`` >= alpha, where
    only a subset that risk isolates could be certified, and no count suffices by itself).
    """
    if not 0 < threshold_fraction < 1:
        raise ValueError(f"threshold_fraction must be in (0, 1), got {threshold_fraction}")
    at_rate = accepted_needed(alpha, delta, error_rate)
    if at_rate is None:
        return None
    return math.ceil(max(at_rate, start_size(alpha, delta)) / threshold_fraction)


def uncertified_reason(
    alpha: float, delta: float, threshold_fraction: float, *, n_labels: int, n_threshold: int,
    threshold_errors: int, unit: str = "labelled answers",
) -> str:
    """Why ``alpha`` got no certified threshold, in words with the figures: how many more
    ``unit`` (labels in all, or of the uniform sample for reviews) it needs at the threshold
    split's observed error rate, or that no number of them suffices at that rate."""
    rate = threshold_errors / n_threshold if n_threshold else 0.0
    need = labels_needed(alpha, delta, threshold_fraction, rate)
    if need is None:
        return (f"alpha={alpha:g}: the threshold split is wrong {rate:.0%} of the time, at or above "
                "alpha, so no number of labels can certify it at this error rate (only a risk model "
                "that sets apart answers with fewer errors can)")
    if n_labels < need:
        return (f"alpha={alpha:g}: about {need - n_labels} more {unit} needed ({need} in all at the "
                f"observed error rate {rate:.0%}, delta={delta:g}; there are {n_labels})")
    return (f"alpha={alpha:g}: {n_labels} {unit} would be enough at the observed error rate {rate:.0%} "
            f"({need} needed), but the test stopped at its first failure among the lowest risks "
            "(confidently wrong answers there); more labels make such a stop less likely")
