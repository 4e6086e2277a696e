"""Guaranteed risk thresholds: Clopper-Pearson bounds tested in a fixed sequence (Learn-then-Test),
and the check of those guarantees on new data."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    upper_bound: float | None  # Clopper-Pearson upper bound on the error, at the level tested
    message: str | None = None
    start: float | None = None  # a second sequence's start, learned on the fit split (None: none)

    @property
    def met(self) -> bool:
        return self.threshold is not None


def _stats() -> Any:
    """``scipy.stats``, imported on first use: it takes ~0.8 s, and the review page's progress
    (``calibration.sizing``) imports this module."""
    from scipy import stats

    return stats


def clopper_pearson_upper(errors: int, n: int, delta: float) -> float:
    """One-sided exact (1 - delta) upper confidence bound on a binomial error rate."""
    if n == 0:
        return 1.0
    if errors >= n:
        return 1.0
    return float(_stats().beta.ppf(1 - delta, errors + 1, n - errors))


def default_grid() -> np.ndarray:
    """Candidate thresholds fixed before seeing data (step 0.001 on [0, 1])."""
    return np.round(np.linspace(0.0, 1.0, 1001), 6)


def start_size(alpha: float, delta: float) -> int:
    """Smallest n at which k = floor(n * alpha / 2) errors would pass the exact binomial test."""
    _check_targets(alpha, delta)
    n = math.ceil(math.log(delta) / math.log(1 - alpha))  # zero errors pass from here on
    while _stats().binom.cdf(math.floor(n * alpha / 2), n, alpha) > delta:
        n += 1
    return n


def _accepted(
    risk: np.ndarray, wrong: np.ndarray, grid: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each grid threshold t: the sorted grid, answers accepted (risk <= t), errors among them."""
    risk = np.asarray(risk, dtype=float)
    wrong = np.asarray(wrong, dtype=int)
    grid = default_grid() if grid is None else np.sort(np.asarray(grid, dtype=float))
    order = np.argsort(risk, kind="stable")
    n_acc = np.searchsorted(risk[order], grid, side="right")
    k_acc = np.concatenate([[0], np.cumsum(wrong[order])])[n_acc]
    return grid, n_acc, k_acc


def start_threshold(
    risk: np.ndarray,
    wrong: np.ndarray,
    alpha: float,
    delta: float,
    grid: np.ndarray | None = None,
    min_share: float = 0.05,
) -> float | None:
    """Where the fixed sequence should start, learned on labelled data the test never sees.

    The sequence stops at its first failure, so a start among the lowest risks, where calibrators
    put a few confidently wrong answers, can stop it at once. On independent labelled data (the
    calibrator's fit split) this picks the grid threshold whose binomial p-value is smallest
    there, i.e. where the evidence that the error is <= alpha is strongest. Thresholds accepting
    fewer than :func:`start_size` answers or ``min_share`` of them are not considered: at a loose
    alpha a handful of right answers already gives a tiny p-value (0.3^5 = 0.002 at alpha 0.7),
    a fluke that would not repeat on new data. None when none is testable.

    The threshold split plays no part in this choice, so the sequence ``select_threshold`` runs
    from it is fixed before those labels are read. The argmin is chosen in-sample and can be
    optimistic, which is why that sequence runs beside the default one, not instead of it.
    """
    _check_targets(alpha, delta)
    grid, n_acc, k_acc = _accepted(risk, wrong, grid)
    ok = n_acc >= max(start_size(alpha, delta), math.ceil(min_share * np.asarray(risk).size))
    if not ok.any():
        return None
    pvals = np.where(ok, _stats().binom.cdf(k_acc, np.maximum(n_acc, 1), alpha), np.inf)
    return float(grid[int(np.argmin(pvals))])


def _fixed_sequence(
    n_acc: np.ndarray, k_acc: np.ndarray, idx: np.ndarray, alpha: float, delta: float
) -> int | None:
    """Test grid points ``idx`` in order at level delta; the last rejected before the first failure."""
    if not idx.size:
        return None
    failed = np.flatnonzero(_stats().binom.cdf(k_acc[idx], n_acc[idx], alpha) > delta)
    last = failed[0] - 1 if failed.size else idx.size - 1
    return int(idx[last]) if last >= 0 else None


def select_threshold(
    risk: np.ndarray,
    wrong: np.ndarray,
    alpha: float,
    delta: float,
    grid: np.ndarray | None = None,
    min_accepted: int | None = None,
    start: float | None = None,
) -> Threshold:
    """Learn-then-Test with a fixed sequence, strict -> loose.

    For each candidate t, H0(t): the error rate among answers with risk <= t exceeds alpha.
    Its exact binomial p-value is P(Bin(n_t, alpha) <= k_t) (k_t errors among n_t accepted). Tests
    run from the strictest t; the first that fails stops the sequence, and the loosest rejected
    H0 is returned.

    Where the sequence starts matters: with a handful of accepted items one unlucky error fails
    the first test and stops everything. So it starts at the first threshold accepting at least
    ``min_accepted`` items (default :func:`start_size`: enough that an observed error rate of
    alpha / 2 would pass). Given ``start`` (learned on other data by :func:`start_threshold`)
    past that first threshold, a second sequence runs from there, and each of the two is tested
    at delta / 2 (Bonferroni over start points, as Learn-then-Test's multi-start fixed sequence
    does); the looser certified threshold wins. Neither start reads these labels, so
    P(error(t*) > alpha) <= delta still holds; ``upper_bound`` is then the Clopper-Pearson bound
    at delta / 2, the level tested.
    """
    _check_targets(alpha, delta)
    grid, n_acc, k_acc = _accepted(risk, wrong, grid)
    n = int(np.asarray(risk).size)
    n_min = start_size(alpha, delta) if min_accepted is None else max(1, int(min_accepted))
    testable = n_acc >= n_min
    sequences = [np.flatnonzero(testable)]
    if start is not None:
        learned = np.flatnonzero(testable & (grid >= start))
        if 0 < learned.size < sequences[0].size:  # else nothing new: no need to split delta
            sequences.append(learned)
    each = delta / len(sequences)
    found = [b for idx in sequences if (b := _fixed_sequence(n_acc, k_acc, idx, alpha, each)) is not None]
    if not found:
        first = sequences[0]
        if first.size:
            why = (
                f"the test starts at risk <= {grid[first[0]]:g}, accepting {int(n_acc[first[0]])} "
                f"items with {int(k_acc[first[0]])} wrong, and fails there"
            )
            if len(sequences) > 1:
                why += f"; so does the one starting at risk <= {start:g}, learned on the fit split"
        else:
            why = f"need at least {n_min} items accepted with few errors"
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
                f"{1 - delta:g} on these {n} calibration items; nothing would be accepted ({why})"
            ),
            start=start,
        )
    best = max(found)  # the grid ascends: the loosest certified threshold
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
        upper_bound=clopper_pearson_upper(ka, na, each),
        start=start,
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
