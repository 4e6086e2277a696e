"""Guaranteed risk thresholds: Clopper-Pearson bounds tested in a fixed sequence (Learn-then-Test),
and the check of those guarantees on new data."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from guarduq.errors import CalibrationError


def _check_targets(alpha: float, delta: float) -> None:
    if not 0 < alpha < 1:
        raise CalibrationError(f"alpha must be in (0, 1), got {alpha}")
    if not 0 < delta < 1:
        raise CalibrationError(f"delta must be in (0, 1), got {delta}")


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


def expected_start(risk: np.ndarray, alpha: float, delta: float) -> int:
    """Where the calibrator itself expects the fixed-sequence test to be strongest (label-free).

    If the risks are calibrated, the n lowest-risk answers hold about ``k(n) = sum of their risks``
    errors, so the test at that point would see a p-value near ``P(Bin(n, alpha) <= k(n))``. The
    n that minimises it is where a test is most likely to pass. Starting stricter spends the
    whole sequence on a handful of the lowest-risk answers, where a few confidently wrong ones
    (which real calibrators do produce) fail the first test and stop everything.

    It reads the unlabelled risks, alpha and delta only, so the start is fixed before any label
    is seen and the fixed-sequence guarantee is untouched. Risks outside [0, 1] are not
    probabilities; then it returns 1 and the caller's floor decides.
    """
    r = np.sort(np.asarray(risk, dtype=float))
    if r.size == 0 or not np.all((r >= 0) & (r <= 1)):
        return 1
    n = np.arange(1, r.size + 1)
    pvals = stats.binom.cdf(np.floor(np.cumsum(r)), n, alpha)
    pvals[n < start_size(alpha, delta)] = np.inf
    return int(np.argmin(pvals)) + 1


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
    ``min_accepted`` items. The default is the larger of :func:`start_size` (enough that an
    observed error rate of alpha / 2 would pass) and :func:`expected_start` (where the risks
    themselves expect the test to be strongest). Both use alpha, delta and the unlabelled risks
    only, so the family-wise guarantee P(error(t*) > alpha) <= delta still holds.
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
    if min_accepted is None:
        n_min = max(start_size(alpha, delta), expected_start(risk, alpha, delta))
    else:
        n_min = max(1, int(min_accepted))
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
                f"(the test starts at {n_min} accepted items and failed there)"
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
