"""Learning-rate selection on dev for the ensemble harness: a log grid that grows past an edge,
and SVE's one rate carried unchanged from one cell to the others.

Why (issue 33): a rate chosen at the edge of its grid says only that the best lies beyond it
(SST-2's baseline rates were the smallest of their grids, and their loss was flat). Every family
gets the same treatment: each rate is one member trained on train and scored by its dev NLL;
while the best sits at an edge, the grid grows by one step past that edge (the edge's own log
spacing) and the best is chosen again, at most ``max_extensions`` times. A rate still at the
edge after that is marked on the page (``RateSearch.at_edge``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_EXTENSIONS = 3


@dataclass
class RateSearch:
    """One family's rates tried on dev (rate → dev NLL), the chosen one and where it sits."""

    family: str
    dev_nll: dict[float, float] = field(default_factory=dict)
    initial: list[float] = field(default_factory=list)
    extensions: int = 0
    chosen: float | None = None
    at_edge: str | None = None  # "low" / "high": still the smallest / largest rate tried
    own_best: float | None = None  # this dev's best (``chosen`` unless a rate is transferred)
    transferred: float | None = None  # SVE: a rate chosen on another cell, scored here and used instead

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "curve": sorted([lr, nll] for lr, nll in self.dev_nll.items()),
                "initial": self.initial, "extensions": self.extensions, "chosen": self.chosen,
                "at_edge": self.at_edge, "own_best": self.own_best, "transferred": self.transferred}

    def transfer(self, lr: float, score: Callable[[float], float]) -> dict[str, Any]:
        """Use ``lr`` (chosen on another cell) instead of this search's own best, scored on this
        dev beside it; returns what the page shows of the two."""
        own = self.own_best
        if own is None:
            raise ValueError("transfer() before the search ran")
        if lr not in self.dev_nll:
            self.dev_nll[lr] = score(lr)
        self.transferred = self.chosen = lr
        return {"lr": lr, "dev_nll": self.dev_nll[lr], "own_best_lr": own, "own_best_dev_nll": self.dev_nll[own],
                "own_best_at_edge": self.at_edge}


def _round(x: float) -> float:
    """Two significant digits: stage keys (``lr{x:g}``) stay short and a rerun finds them."""
    return float(f"{x:.2g}")


def _edge(grid: list[float], best: float) -> str | None:
    if len(grid) < 2:
        return None
    return "low" if best == grid[0] else "high" if best == grid[-1] else None


def search_rate(family: str, grid: list[float], score: Callable[[float], float], *,
                max_extensions: int = MAX_EXTENSIONS) -> RateSearch:
    """Score every rate of ``grid``; extend past the edge the best sits at, one step at a time.

    The step is the ratio of the two rates at that edge (a grid 1e-4, 3e-4, 1e-3 whose best is
    1e-4 next tries 1e-4 / 3 = 3.3e-5). A grid of one rate is scored and kept (nothing to select)."""
    if not grid:
        raise ValueError(f"{family}: an empty learning-rate grid")
    search = RateSearch(family, initial=sorted(grid))
    for lr in search.initial:
        search.dev_nll[lr] = score(lr)
    while True:
        rates = sorted(search.dev_nll)
        best = min(rates, key=search.dev_nll.__getitem__)
        edge = _edge(rates, best)
        if edge is None or search.extensions >= max_extensions:
            break
        step = rates[1] / rates[0] if edge == "low" else rates[-1] / rates[-2]
        nxt = _round(best / step if edge == "low" else best * step)
        if nxt in search.dev_nll or nxt <= 0:
            break
        search.dev_nll[nxt] = score(nxt)
        search.extensions += 1
    search.chosen = search.own_best = best
    search.at_edge = edge
    return search


def transferred_rate(results_path: Path, source: str, parametrisation: dict[str, str]) -> float:
    """SVE's rate as chosen on ``source``'s dev in ``results_path`` (a finished run), refused
    unless that run trained SVE with the same parametrisation: a raw rate means nothing for a
    relative Σ and the other way round."""
    if not results_path.is_file():
        raise SystemExit(f"SVE rate of {source}: no {results_path} yet; run that cell first (make ensembles)")
    res = json.loads(results_path.read_text()).get(source, {})
    facts = res.get("facts")
    if not facts:
        raise SystemExit(f"SVE rate of {source}: {results_path} has no finished run of that cell")
    theirs = facts.get("sve_parametrisation", {"parametrisation": "raw", "bias": "raw"})
    if theirs != parametrisation:
        raise SystemExit(f"SVE rate of {source}: its SVE was {theirs}, this run's is {parametrisation}")
    if facts.get("sve_transfer"):  # a transferred cell's rate was not chosen there
        raise SystemExit(f"SVE rate of {source}: that cell's SVE rate was itself transferred "
                         f"from {facts['sve_transfer']['from']}; name the cell the rate was chosen on")
    return float(facts["chosen_lr"]["sve"])
