"""Costly features against `same-pass`, for benchmarks/risk.py (issue 24 item 3).

A costly set (P(True), an SVE second opinion) earns its extra forward passes only if it ranks wrong
answers better than the free `same-pass` set on the *same* answers. Two AUROCs on one test split
share its items, so each comparison here is paired (both risks resampled on the same items), and
each set is priced next to what it buys: per cell, pooled, left one dataset out, and at the
certified error levels.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from guarduq.calibration.analysis import (
    Candidate,
    Labelled,
    LodoResult,
    leave_one_dataset_out,
    paired_bootstrap_diff,
)
from guarduq.calibration.features import COSTLY, SVEShape, forward_equivalents

BASE = "same-pass"
TITLE = "### Costly features against same-pass (issue 24)"
Diff = tuple[float | None, float | None, float | None]


def costly_sets(sets: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The measurable sets that need work beyond the pass guarduq runs; none without `same-pass`
    (nothing free to hold them against)."""
    if BASE not in sets:
        return {}
    return {k: tuple(v) for k, v in sets.items() if set(v) & COSTLY}


def _f(x: float | None, nd: int = 2, sign: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def _diff(d: Diff) -> str:
    point, lo, hi = d
    if point is None:
        return "–"
    return f"{point:+.3f} [{_f(lo, 3, True)}, {_f(hi, 3, True)}]" if lo is not None else f"{point:+.3f}"


def _coverage(m: Mapping[str, Any], alpha: float) -> str:
    """Test coverage at the threshold certified for ``alpha``; `none` if none was certified."""
    if "error" in m:
        return "–"
    row = next((g for g in m.get("guarantees", []) if g["alpha"] == alpha), None)
    if row is None or row["threshold"] is None:
        return "none"
    return f"{row['coverage']:.2f}" + ("" if row["held"] else " (failed)")


def _side(d: Diff) -> int:
    """+1: the paired interval is above 0; -1: below; 0: it holds 0 (or there is none)."""
    _, lo, hi = d
    if lo is None or hi is None:
        return 0
    return 1 if lo > 0 else -1 if hi < 0 else 0


def costly_section(
    results: Mapping[str, Mapping[str, Mapping[str, Any]]],
    cells: Mapping[str, Mapping[str, Labelled]],
    sets: Mapping[str, tuple[str, ...]],
    groups: Mapping[str, Labelled],
    shapes: Counter[SVEShape],
    alphas: Sequence[float],
    n_boot: int,
    progress: Callable[[Any], Any] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and data: each costly set against `same-pass`; ``([], {})`` when no costly
    set is measurable.

    ``results``: cell -> set -> :func:`fit_and_test` output (with ``risk`` on the cell's test
    split); ``cells``: cell -> fit / threshold / test; ``groups``: dataset -> every item of it (for
    leave-one-dataset-out, run when there are at least 3).
    """
    costly = costly_sets(sets)
    if not costly:
        return [], {}
    names = [BASE, *costly]
    shape = shapes.most_common(1)[0][0] if shapes else None
    cost = {s: forward_equivalents(sets[s], shape) for s in names}

    paired: dict[str, dict[str, Diff]] = {}
    for d, p in cells.items():
        wrong = 1 - np.asarray(p["test"][1], int)
        base = results[d][BASE]
        paired[d] = {
            s: paired_bootstrap_diff(wrong, results[d][s]["risk"], base["risk"], n_boot=n_boot)
            if "risk" in results[d][s] and "risk" in base else (None, None, None)
            for s in costly
        }

    lines = [
        "", TITLE, "",
        f"Each costly set next to `{BASE}` on the same test items (those holding every available "
        "feature), both fitted on the cell's fit split: AUROC, and the paired bootstrap difference "
        f"AUROC(set) − AUROC(`{BASE}`) with its 95% interval (both risks resampled on the same "
        f"items, {n_boot} resamples). Coverage at each α: share of test answers accepted at the "
        f"threshold certified on the threshold split, `{BASE}` → set; `none`: no threshold "
        "certified; `(failed)`: error among the accepted above α on the test split.",
        "",
        f"| data | set | n test (wrong) | AUROC `{BASE}` | AUROC set | set − `{BASE}` [95%] | "
        + " | ".join(f"α={a:g} coverage" for a in alphas) + " |",
        "|---|---|---|---:|---:|---|" + "---|" * len(alphas),
    ]
    for d in cells:
        y = np.asarray(cells[d]["test"][1], int)
        base = results[d][BASE]
        for s in costly:
            m = results[d][s]
            lines.append(
                f"| {d} | `{s}` | {y.size} ({int((1 - y).sum())}) | {_f(base.get('auroc'))} | "
                f"{_f(m.get('auroc'))} | {_diff(paired[d][s])} | "
                + " | ".join(f"{_coverage(base, a)} → {_coverage(m, a)}" for a in alphas) + " |"
            )

    lodo: LodoResult | None = None
    lodo_diff: dict[str, float | None] = {}
    if len(groups) >= 3:
        lodo = leave_one_dataset_out(groups, [Candidate(s, sets[s]) for s in names], (),
                                     progress=progress, n_boot=0)
        lines += _lodo_lines(lodo, names, groups)
        lodo_diff = {s: _mean([_lodo_delta(lodo, d, s) for d in groups]) for s in costly}
    else:
        lines += ["", f"Leave one dataset out: not run ({len(groups)} dataset(s); it needs 3)."]

    lines += ["", "Cost per answer beyond generating it, in forward-pass equivalents (counted as in "
              "the cost line above): " + "; ".join(f"`{s}` {_f(cost[s])}" for s in names) + "."]
    verdict = {s: _verdict(s, paired, cost, lodo_diff.get(s), lodo is not None) for s in costly}
    lines += ["", "Verdict:", "", *(f"- {v}" for v in verdict.values())]
    return lines, {"sets": list(costly), "paired": paired, "lodo": lodo, "lodo_diff": lodo_diff,
                   "cost": cost, "verdict": verdict}


def _mean(xs: Sequence[float | None]) -> float | None:
    """Mean over the left-out datasets where both sets could be fitted; None where none could."""
    vals = [x for x in xs if x is not None]
    return float(np.mean(vals)) if vals else None


def _lodo_delta(lodo: LodoResult, d: str, s: str) -> float | None:
    a, b = lodo.rows[d][s].get("auroc"), lodo.rows[d][BASE].get("auroc")
    return None if a is None or b is None else a - b


def _lodo_lines(lodo: LodoResult, names: list[str], groups: Mapping[str, Labelled]) -> list[str]:
    """Per left-out dataset: each set's AUROC, and each costly set's simple difference to `same-pass`."""
    costly = names[1:]
    head = [f"`{BASE}`"] + [x for s in costly for x in (f"`{s}`", f"`{s}` − `{BASE}`")]
    out = ["", "Left one dataset out (fitted on all the others, tested on all of the left-out one): "
           "AUROC, and the plain difference of the two left-out AUROCs (not a paired interval).", "",
           "| left out | n | " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(head)]
    for d in groups:
        row = [d, str(len(groups[d][1])), _f(lodo.rows[d][BASE].get("auroc"))]
        for s in costly:
            row += [_f(lodo.rows[d][s].get("auroc")), _f(_lodo_delta(lodo, d, s), 3, True)]
        out.append("| " + " | ".join(row) + " |")
    summ = lodo.summary()
    row = ["**mean**", "", _f(summ[BASE]["mean_auroc"])]
    for s in costly:
        row += [_f(summ[s]["mean_auroc"]), _f(_mean([_lodo_delta(lodo, d, s) for d in groups]), 3, True)]
    out.append("| " + " | ".join(row) + " |")
    return out


def _verdict(s: str, paired: Mapping[str, Mapping[str, Diff]], cost: Mapping[str, float | None],
             lodo_diff: float | None, lodo_ran: bool) -> str:
    """One plain sentence: does ``s`` beat `same-pass` pooled, in how many cells, at what cost."""
    c, b = cost[s], cost[BASE]
    price = (f"costs {_f(c)} forward-pass equivalents per answer against {_f(b)} "
             f"({_f(c - b, 2, True)})" if c is not None and b is not None else
             "cost unknown (the cache does not say the SVE ensemble's shape)")
    if "pooled" in paired:
        d = paired["pooled"][s]
        side = _side(d)
        pooled = (f"pooled {'beats' if side > 0 else 'is worse than' if side < 0 else 'does not beat'} "
                  f"`{BASE}` ({_diff(d)}" + ("" if side else ", interval holds 0" if d[1] is not None else "")
                  + ")")
    else:
        pooled = "no pooled cell (one dataset)"
    ds = [d for d in paired if d != "pooled"]
    up = sum(_side(paired[d][s]) > 0 for d in ds)
    down = sum(_side(paired[d][s]) < 0 for d in ds)
    cells = f"interval above 0 in {up} of {len(ds)} dataset cell(s), below 0 in {down}"
    lodo = (f"left one dataset out, mean difference {_f(lodo_diff, 3, True)}" if lodo_ran
            else "no leave-one-dataset-out (< 3 datasets)")
    return f"`{s}`: {pooled}; {cells}; {lodo}; {price}."
