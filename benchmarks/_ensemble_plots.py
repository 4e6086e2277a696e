"""The ensemble page's figures, drawn so a reader takes each in at a glance.

Why: the first page's trade-off plots wrote each method's name beside its point, and near points
("SVE M=4/8/16", "LoRA M=1 / LoRA-Ensemble") wrote over each other. Here no text is placed at a
data point: methods are told apart by colour (family) and marker (members) and named in one
legend; differences against the best baseline get their own plot with paired intervals, one row
per method; and each reliability bin states its count once, upright, in a strip above the diagram.
``tests/unit/test_ensembles_bench.py`` checks that no two texts of a figure overlap.
Each ``*_figure`` returns the figure (tests measure it); ``save`` writes and closes it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from guarduq.calibration.metrics import ECE_BINS

FAMILY_COLOURS = {"base": "0.35", "sve": "tab:blue", "fine": "tab:blue", "lora": "tab:orange", "deep": "tab:green",
                  "full": "tab:green"}  # by a row's first word: "fine-tuned (SVE M=1)", "full fine-tune (M=1)"
MEMBER_MARKERS = {1: "o", 2: "v", 4: "s", 8: "D", 16: "P"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)


def members_of(name: str) -> int:
    """'SVE M=8, lr 0.01' → 8; a name without M= (base) → 1."""
    found = re.search(r"M=(\d+)", name)
    return int(found.group(1)) if found else 1


def style(name: str) -> dict[str, Any]:
    """Colour by family (the name's first word), marker by member count; sensitivity rows hollow."""
    colour = FAMILY_COLOURS.get(name.split()[0].split("-")[0].lower(), "tab:purple")
    hollow = ", lr " in name
    return {"color": colour, "marker": MEMBER_MARKERS.get(members_of(name), "*"), "mfc": "none" if hollow else colour}


def _spread(mid: float, lo: float, hi: float) -> list[list[float]]:
    """Error-bar lengths; a bootstrap interval of a biased statistic (ECE) may miss its point."""
    return [[max(mid - lo, 0.0)], [max(hi - mid, 0.0)]]


def _count(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def reliability_figure(rows: list[tuple[str, list[dict[str, float]], float]], title: str) -> Any:
    """One diagram per method (name, ``reliability_bins``, ECE): accuracy per confidence bin, its
    count written upright (7 pt) in a strip above the plot's 1 (empty bins have none)."""
    plt = _pyplot()
    cols = 4
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 3.5 * nrows), squeeze=False)
    for ax, (name, bins, ece) in zip(axes.ravel(), rows, strict=False):
        ax.bar([b["lo"] for b in bins], [b["accuracy"] for b in bins], width=1 / ECE_BINS, align="edge",
               alpha=0.6, edgecolor="k")
        ax.plot([b["confidence"] for b in bins], [b["confidence"] for b in bins], "r.", ms=4)
        for b in bins:  # in a strip above 1, clear of the bars, the diagonal and the red points
            ax.text(b["lo"] + 0.5 / ECE_BINS, 1.03, _count(b["count"]), fontsize=7, ha="center", va="bottom",
                    rotation=90)
        ax.axhline(1.0, color="0.6", lw=0.6)
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_title(f"{name}\nECE {ece:.3f}", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.25)
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[len(rows):]:
        ax.axis("off")
    fig.suptitle(f"{title}\nbars: accuracy per confidence bin; red: its mean confidence; numbers above the line: its items",
                 fontsize=10)
    fig.tight_layout()
    return fig


def tradeoff_figure(points: list[dict[str, Any]], title: str) -> Any:
    """Accuracy and ECE (95% intervals) against stored extra parameters (log scale), one point per
    method, named in one legend beside the plots."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, key, label in ((axes[0], "accuracy", "accuracy"), (axes[1], "ece", "ECE")):
        for p in points:
            mid, lo, hi = p[key]
            ax.errorbar([max(p["stored"], 1)], [mid], yerr=_spread(mid, lo, hi), capsize=3, ms=6, ls="none",
                        label=p["name"], **style(p["name"]))
        ax.set_xscale("log")
        ax.set_xlim(left=0.5)  # no tick left of the base model's 1: it would touch the y labels at the corner
        ax.set_xlabel("stored parameters beyond the pretrained model (1 = none)", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def paired_figure(rows: list[tuple[str, dict[str, list[float]]]], reference: str, title: str) -> Any:
    """Each method minus ``reference`` (the best baseline) on the same resampled test items:
    ECE and accuracy, point and 95% paired bootstrap interval, one row per method."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.8 + 0.32 * max(len(rows), 2)), sharey=True)
    ys = list(range(len(rows)))[::-1]
    for ax, key, label in ((axes[0], "ece", "ECE"), (axes[1], "accuracy", "accuracy")):
        for y, (name, diffs) in zip(ys, rows, strict=True):
            mid, lo, hi = diffs[key]
            ax.errorbar([mid], [y], xerr=_spread(mid, lo, hi), capsize=3, ls="none", **style(name))
        ax.axvline(0, color="k", lw=0.8)
        ax.set_xlabel(f"{label}: method − {reference}", fontsize=8)
        ax.grid(alpha=0.3, axis="x")
        ax.tick_params(labelsize=8)
    axes[0].set_yticks(ys, [name for name, _ in rows])
    axes[0].set_ylim(-0.7, len(rows) - 0.3)
    fig.suptitle(f"{title}\n(lower ECE and higher accuracy than the reference lie left and right of 0)", fontsize=10)
    fig.tight_layout()
    return fig


def dev_curves_figure(searches: list[dict[str, Any]], title: str, transferred: float | None = None) -> Any:
    """Each family's rate → dev NLL (one member each); the cell's own best starred, rates added
    past an edge ringed, and SVE's transferred rate (if any) marked by a dashed line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in searches:
        lrs, nll = zip(*s["curve"], strict=True)
        colour = style(s["family"])["color"]
        ax.plot(lrs, nll, "-o", color=colour, ms=4, label=s["family"] + (" (still at the edge)" if s["at_edge"] else ""))
        added = [(lr, v) for lr, v in s["curve"] if lr not in s["initial"] and lr != s.get("transferred")]
        if added:
            ax.plot(*zip(*added, strict=True), "o", ms=10, mfc="none", color=colour)
        curve = dict(map(tuple, s["curve"]))
        own = s.get("own_best") or s["chosen"]
        ax.plot([own], [curve[own]], "*", ms=14, color=colour)
    if transferred is not None:
        ax.axvline(transferred, color="tab:blue", ls="--", lw=1, label=f"SVE's transferred rate {transferred:g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("dev NLL (one member)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    ax.set_title(f"{title}\n★ best on this dev; ○ added past the grid's edge", fontsize=10)
    fig.tight_layout()
    return fig
