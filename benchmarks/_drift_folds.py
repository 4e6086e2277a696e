"""In-distribution false alarms counted on windows that share no item (issue 35's BoolQ reading).

Windows drawn from one fresh pool (150 BoolQ items) share most of their items, so they read the
same case together: their share of alarms measures that one pool's draw, not a rate. Here each
item of the artifact's ``drift_reference`` (every calibration item with its dataset) goes to one of
``folds`` folds by a hash of its group and position. For each fold, a classifier is built on the
other folds, its thresholds recomputed as a server recomputes them on its own reference, and the
fold's items form fresh windows for it: one per group (should read ``ok`` or a slice; ``unseen``
is the false alarm that would trigger a policy's drift action) and windows of the same size cut
from the whole fold (the mix: should read ``ok``). No item is in two windows, nor in the
reference of the classifier that reads it. The classifiers of different folds share
``(folds - 2) / folds`` of their references, so the windows' readings are not quite independent
draws: the Wilson intervals treat them as if they were, and are approximate. Results at two fold
counts come from the same items: two views, not two samples. The reference is
``(folds - 1) / folds`` of the full one.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from _drift_windows import wilson  # benchmarks/ is on sys.path, as drift.py puts it
from _pages import write_page
from tqdm.auto import tqdm

from guarduq.calibration.drift_groups import CaseClassifier, GroupReference
from guarduq.calibration.splits import hash_unit


def fold_of(ref: GroupReference, folds: int, salt: str) -> np.ndarray:
    """Each item's fold: its rank, within its group, in a hash order (so every group splits evenly)."""
    out = np.empty(ref.n, dtype=int)
    for g in np.unique(ref.group):
        idx = np.flatnonzero(ref.group == g)
        order = sorted(idx, key=lambda i: hash_unit(f"{g}:{i}", salt))
        for rank, i in enumerate(order):
            out[i] = rank % folds
    return out


def _window(ref: GroupReference, idx: np.ndarray) -> dict[str, np.ndarray]:
    return {f: ref.matrix[idx, j] for j, f in enumerate(ref.features)}


def fold_windows(ref: GroupReference, *, folds: int = 10, salt: str = "drift-folds", draws: int = 400) -> dict[str, Any]:
    """Classify each fold's group windows and mix windows against a classifier built on the rest."""
    which = fold_of(ref, folds, salt)
    rows: list[dict[str, Any]] = []
    for k in tqdm(range(folds), desc=f"{folds} folds", file=sys.stderr):
        keep = which != k
        sub = GroupReference(ref.features, ref.matrix[keep], ref.group[keep], f"{ref.source} less fold {k}")
        size = max(2, int(round((~keep).sum() / max(len(ref.groups), 1))))
        clf = CaseClassifier(sub, window=size, draws=draws, seed=k)
        held = np.flatnonzero(~keep)
        # the mix: the fold's items in a random order, cut into windows of about `size` (the
        # window the thresholds were set for), each a random draw of the mix
        shuffled = np.random.default_rng(k).permutation(held)
        for idx in np.array_split(shuffled, max(1, round(held.size / size))):
            rows.append({"fold": k, "source": "mix", "n": int(idx.size), "label": clf.classify(_window(ref, idx)).label})
        for g in ref.groups:
            idx = held[ref.group[held] == g]
            rows.append({"fold": k, "source": g, "n": int(idx.size), "label": clf.classify(_window(ref, idx)).label})
    return {"folds": folds, "rows": rows, "reference": ref.source}


def false_alarms(res: dict[str, Any]) -> dict[str, Any]:
    """Per source and over all group windows: the windows that raise a false alarm (a group's:
    ``unseen``, the reading a policy's ``on_drift.unseen`` acts on; the mix's: anything but
    ``ok``), with Wilson intervals; and the group windows read as another group's slice (a
    confusion between two calibration groups, not an alarm: both are seen traffic)."""

    def alarm(r: dict[str, Any]) -> bool:
        return r["label"] != "ok" if r["source"] == "mix" else r["label"] == "unseen"

    per: dict[str, Any] = {}
    for s in dict.fromkeys(r["source"] for r in res["rows"]):
        rs = [r for r in res["rows"] if r["source"] == s]
        k = sum(alarm(r) for r in rs)
        per[s] = {"windows": len(rs), "items": int(np.median([r["n"] for r in rs])), "alarms": k,
                  "rate": k / len(rs), "ci": wilson(k, len(rs)), "cases": dict(Counter(r["label"] for r in rs))}
    groups = [r for r in res["rows"] if r["source"] != "mix"]
    k = sum(alarm(r) for r in groups)
    other = sum(r["label"].startswith("slice:") and r["label"] != f"slice:{r['source']}" for r in groups)
    return {"per_source": per, "groups": {"windows": len(groups), "alarms": k, "rate": k / max(len(groups), 1),
                                          "ci": wilson(k, len(groups)), "other_slice": other}}


def folds_report(results: list[dict[str, Any]]) -> list[str]:
    """Markdown: one table per fold count."""
    lines = ["### In-distribution false alarms on windows that share no item (calibration items, k folds)", "",
             "Each fold's items are fresh to a classifier built on the other folds (thresholds recomputed); "
             "a group window should read `ok` or a slice (its own, or a similar group's); `unseen` is its false "
             "alarm, the reading a policy's `on_drift.unseen` acts on. The mix window should read `ok`. "
             "Intervals: Wilson 95%, as if the windows were independent draws; they share no item, but "
             "the classifiers of different folds share most of their reference, so the intervals are approximate. "
             "The two fold counts are two views of the same items.", ""]
    for res in results:
        fa = false_alarms(res)
        g = fa["groups"]
        lines += [f"**{res['folds']} folds** (reference: {res['reference']}): group windows falsely alarmed "
                  f"{g['alarms']} of {g['windows']} = {g['rate']:.3f} [{g['ci'][0]:.3f}, {g['ci'][1]:.3f}] "
                  f"(read `unseen`); read as another group's slice: {g['other_slice']}.", "",
                  "| source | windows | items per window | false alarms [95%] | cases |", "|---|---|---|---|---|"]
        for s, v in fa["per_source"].items():
            cases = ", ".join(f"{c} {n}" for c, n in sorted(v["cases"].items()))
            lines.append(f"| {s} | {v['windows']} | {v['items']} | {v['alarms']} = {v['rate']:.2f} "
                         f"[{v['ci'][0]:.2f}, {v['ci'][1]:.2f}] | {cases} |")
        lines.append("")
    return lines


def print_folds(results: list[dict[str, Any]]) -> None:
    for res in results:
        fa = false_alarms(res)
        g = fa["groups"]
        mix = fa["per_source"]["mix"]
        print(f"  {res['folds']} folds: group windows unseen {g['alarms']}/{g['windows']}, other slice {g['other_slice']}; "
              f"mix {mix['alarms']}/{mix['windows']}")


def write_folds(page: Path, results: list[dict[str, Any]]) -> None:
    """``drift.py --folds-only``: the fold tables as their own page and JSON, beside drift.md."""
    page.parent.mkdir(parents=True, exist_ok=True)
    write_page(page, "\n".join(folds_report(results)), "Drift: in-distribution false alarms on disjoint windows")
    page.with_suffix(".json").write_text(json.dumps(
        [{**r, "summary": false_alarms(r)} for r in results], indent=1, default=float))
    print_folds(results)
    print(f"wrote {page}")
