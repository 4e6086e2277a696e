"""Does the calibrated risk beat the free single signals it is built from? From scoring caches.

Reads the JSON Lines scoring caches that ``guarduq calibrate`` (``ScoreCache``) writes, one or
more per model (merged, one record per item), opened read-only (a live cache being written by a running calibrate is fine), and writes
``docs/results/risk.md`` + ``risk_*.png``:

* per dataset cell and for one calibrator pooled over every dataset: AUROC (bootstrap 95%
  interval) of each feature set's risk next to every single signal (each feature alone, oriented
  by its prior direction, and the best one chosen in hindsight on the test split), ECE,
  risk-coverage curves, coverage at alpha = 0.3 ... 0.7 (delta = 0.1) and whether each
  guarantee held on the test split. Splits are guarduq's id-hash splits (``split_of``: 40% fit,
  30% threshold, 30% test, the same within every dataset; TruthfulQA gen/mc share a question's
  split);
* per-dataset coefficients of the largest free feature set: which directions flip;
* leave-one-dataset-out: every candidate (feature set x regularisation, and a rule that keeps
  only the features whose sign agrees on the training datasets) fitted on all other datasets and
  tested on the whole left-out one, next to every single signal;
* the candidate that analysis picks for traffic unlike the calibration data, and which of the
  issue's goals it and the shipped set (``MIXED_SET``, pooled) meet;
* what each feature set costs per answer, in forward-pass equivalents
  (``features.forward_equivalents``; the SVE shape is read from the cache's SVE records);
* each costly set next to ``same-pass`` (paired AUROC differences, LODO, coverage, cost;
  ``_risk_costly``). Cascade second stages (``first_stage_logit``) belong to benchmarks/cascade.py.

Opt-in features (P(True), the SVE second opinion) are measured where the cache holds them:
``guarduq calibrate --features same-pass+ptrue+sve --sve FILE`` adds them to the cache; a set
whose features no record holds is listed as not measurable.

    python benchmarks/risk.py --cache 'smollm2-135m-instruct=runs/cache/smollm2-135m-instruct/*.jsonl' \
        [--cache 'gemma-3-270m=runs/cache/gemma-3-270m/*.jsonl']

No model is loaded; a run over a few thousand cached answers takes about a minute.
"""

from __future__ import annotations

import argparse
import glob
import logging
import math
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pages import write_page  # noqa: E402
from _risk_costly import costly_section  # noqa: E402

from guarduq.calibration.analysis import (  # noqa: E402
    Candidate,
    Labelled,
    available,
    bootstrap_auroc,
    choose_candidate,
    coefficient_signs,
    fit_and_test,
    leave_one_dataset_out,
    paired_bootstrap_diff,
    robust_single_rule,
    sign_stable_rule,
    single_signals,
)
from guarduq.calibration.evaluation import ScoreCache  # noqa: E402
from guarduq.calibration.features import (  # noqa: E402
    COSTLY,
    DEFAULT_FEATURE_SET,
    FEATURE_SETS,
    GRAD_PROFILE,
    LIKELIHOOD,
    PAPER,
    SVE,
    SVEShape,
    feature_matrix,
    forward_equivalents,
)
from guarduq.calibration.metrics import risk_coverage  # noqa: E402
from guarduq.calibration.splits import split_of  # noqa: E402

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7)  # the issue asks for 0.3-0.5; SmolLM2 is wrong 60-97% of the time
DELTA = 0.1
MIN_CELL = 300  # the goals apply to cells with at least this many evaluated items
ALL_SIGNALS = PAPER + LIKELIHOOD + GRAD_PROFILE + ("p_true",) + SVE
STRONG_C = 0.01
# The shipped calibrator's set (Makefile CAL_FEATURES), fitted pooled: the choice for traffic like
# the calibration mix, whose goals are reported next to those of the leave-one-out choice.
MIXED_SET = "same-pass"
# The sets this page measures: a cascade's second stage reads a first stage's risk, which no cache holds.
RISK_SETS = {k: v for k, v in FEATURE_SETS.items() if "first_stage_logit" not in v}


def group_of(item_id: str) -> str:
    """The split key: TruthfulQA gen and mc items of one question share it (as in calibrate)."""
    ds, _, raw = item_id.partition(":")
    return f"truthfulqa:{raw}" if ds.startswith("truthfulqa-") else item_id


def labelled(records: list[Any]) -> Labelled:
    """(score dicts, labels with 1 = correct) of cached records."""
    return [r.scores for r in records], np.array([int(r.label) for r in records], int)


def parts(records: list[Any]) -> dict[str, Labelled]:
    """The records' fit, threshold and test splits (guarduq's id-hash splits, by question)."""
    out: dict[str, list[Any]] = {"fit": [], "threshold": [], "test": []}
    for r in records:
        out[split_of(group_of(r.id))].append(r)
    return {k: labelled(v) for k, v in out.items()}


def load_cache(path: Path) -> list[Any]:
    """Usable records of one cache, read from a private copy (the original may be growing).

    One record per item and model, the latest: the cache is append-only, so when a loader change
    gives an item new options (a new prompt hash), its re-scored record follows the stale one.
    """
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        cache = ScoreCache(copy, read_only=True)
        latest = {(r.id, r.model_fingerprint, r.parameter_set): r for r in cache.entries.values()}
        return [r for r in latest.values() if r.usable]


def measurable_sets(feats: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The feature sets whose every feature some record holds; the others (e.g. ``+sve`` on a
    cache without SVE opinions) are listed as not measurable."""
    return {k: v for k, v in RISK_SETS.items() if all(f in feats for f in v)}


def sve_shapes(records: list[Any]) -> Counter[SVEShape]:
    """How many records had their SVE features computed with each ensemble shape."""
    return Counter(shape for r in records if (shape := SVEShape.of(r.scores or {})) is not None)


def cost_lines(sets: dict[str, tuple[str, ...]], shapes: Counter[SVEShape]) -> list[str]:
    """Markdown: each set's work per answer in forward-pass equivalents, and how it is counted."""
    shape = shapes.most_common(1)[0][0] if shapes else None
    costs = []
    for name, feats in sets.items():
        c = forward_equivalents(feats, shape)
        costs.append(f"`{name}` {c:.2f}" if c is not None else f"`{name}` ?")
    lines = ["Cost per answer beyond generating it, in forward-pass equivalents over prompt + answer "
             "(FLOPs: forward 1, backward ≈ 2, so the gradient features cost 3, over all parameters; "
             "P(True) +1; an SVE opinion + (L − N + M·N)/L with SVE in the last N of L blocks and "
             "M members, the blocks below shared, and + M for the members' greedy answer behind "
             "`sve_agree`): " + "; ".join(costs) + "."]
    if shape is not None:
        lines[0] += (f" SVE as cached: M = {shape.members}, N = {shape.targeted_blocks} of "
                     f"L = {shape.total_blocks} blocks, "
                     + (f"greedy answer ≤ {shape.answer_tokens} tokens" if shape.answer_tokens else "no greedy answer")
                     + (f" ({sum(shapes.values()) - shapes[shape]} records computed with another "
                        "ensemble shape)" if len(shapes) > 1 else "") + ".")
    return lines


def _fmt(x: float | None, nd: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _ci(auc: float | None, ci: tuple[float | None, float | None]) -> str:
    if auc is None:
        return "–"
    lo, hi = ci
    return f"{auc:.2f} [{_fmt(lo)}, {_fmt(hi)}]" if lo is not None else f"{auc:.2f}"


def analyse_model(model: str, records: list[Any], n_boot: int, out_dir: Path,
                  costly: bool = True) -> tuple[list[str], dict[str, Any]]:
    """Every table for one model; returns (markdown lines, figures data + goal checks).

    Only answers that hold every available feature are measured, so a cache where some answers
    also hold P(True) or SVE features measures those answers alone; ``costly=False`` ignores the
    costly features and measures every answer on the free ones."""
    lines: list[str] = []
    scores = [r.scores for r in records]
    feats = available(scores, ALL_SIGNALS if costly else tuple(f for f in ALL_SIGNALS if f not in COSTLY))
    free = tuple(f for f in feats if f not in COSTLY)
    sets = measurable_sets(feats)
    skipped_sets = sorted(set(RISK_SETS) - set(sets))
    # Every set and signal is measured on the same items: those valid for every available feature.
    _, ok = feature_matrix(scores, feats)
    recs = [r for r, k in zip(records, ok, strict=True) if k]
    dropped = len(records) - len(recs)
    by_ds: dict[str, list[Any]] = defaultdict(list)
    for r in recs:
        by_ds[r.dataset].append(r)
    datasets = sorted(by_ds)

    lines += [
        f"## {model}",
        "",
        f"{len(records)} usable answers in the cache; {len(recs)} valid for every available "
        f"feature ({dropped} dropped). Features available: {', '.join(feats)}. "
        + (f"Feature sets not measurable here (a feature is missing from every score): "
           f"{', '.join(skipped_sets)}." if skipped_sets else ""),
        "",
        "| data | n | accuracy | fit / threshold / test |",
        "|---|---:|---:|---|",
    ]
    cells = {d: parts(by_ds[d]) for d in datasets}
    if len(datasets) > 1:  # one calibrator over every dataset: the traffic a deployment sees
        cells["pooled"] = parts(recs)
    for d, p in cells.items():
        n = sum(len(v[1]) for v in p.values())
        acc = np.mean(np.concatenate([v[1] for v in p.values()])) if n else float("nan")
        lines.append(f"| {d} | {n} | {_fmt(acc)} | {' / '.join(str(len(v[1])) for v in p.values())} |")
    lines.append("")

    # ---- LODO first: it chooses the default candidate the cell tables then single out.
    candidates = [Candidate(k, v) for k, v in sets.items() if not set(v) & COSTLY]
    if "paper+likelihood" in sets:
        candidates.append(Candidate("paper+likelihood@C=0.01", sets["paper+likelihood"], C=STRONG_C,
                                    note="strong prior toward the base rate"))
    candidates.append(Candidate("sign-stable", sign_stable_rule(free),
                                note="free features whose sign agrees on every training dataset"))
    candidates.append(Candidate("robust-single", robust_single_rule(free),
                                note="the one free feature with the best worst-case AUROC over the training datasets"))
    candidates.append(Candidate("sign-stable/within", sign_stable_rule(free), within=True,
                                note="the sign-stable features, directions learned within each training "
                                     "dataset (one free intercept per dataset, one shared to serve)"))
    if "same-pass" in sets:
        candidates.append(Candidate("same-pass/within", sets["same-pass"], within=True,
                                    note="every free feature, directions learned within each training dataset"))
    lodo = None
    chosen, reason = None, "fewer than 3 datasets: no leave-one-dataset-out"
    if len(datasets) >= 3:
        lodo = leave_one_dataset_out(
            {d: labelled(by_ds[d]) for d in datasets}, candidates, feats,
            progress=lambda xs: tqdm(xs, desc=f"{model} LODO", file=sys.stderr), n_boot=n_boot // 5,
        )
        chosen, reason = choose_candidate(lodo)

    # ---- cells
    show_sets = dict(sets)
    if chosen and chosen not in show_sets:
        cand = next(c for c in candidates if c.name == chosen)
        show_sets[chosen] = cand.resolve({d: cells[d]["fit"] for d in datasets})
    cand_C = {c.name: c.C for c in candidates}
    within = {c.name for c in candidates if c.within}
    # Within a single dataset a within fit is the pooled fit, so only the pooled cell gets groups.
    pooled_fit_names = [r.dataset for r in recs if split_of(group_of(r.id)) == "fit"]
    results: dict[str, dict[str, Any]] = {}
    singles: dict[str, dict[str, tuple[float | None, float | None, float | None]]] = {}
    for d in tqdm(list(cells), desc=f"{model} cells", file=sys.stderr):
        p = cells[d]
        results[d] = {
            s: fit_and_test(f, p["fit"], p["test"], threshold=p["threshold"], C=cand_C.get(s, "cv"),
                            fit_groups=pooled_fit_names if s in within and d == "pooled" else None,
                            alphas=ALPHAS, delta=DELTA, n_boot=n_boot)
            for s, f in show_sets.items()
        }
        wrong = 1 - p["test"][1]
        singles[d] = {k: bootstrap_auroc(wrong, v, n_boot=n_boot)
                      for k, v in single_signals(p["test"][0], feats).items()}

    def best_single(d: str) -> tuple[str | None, float | None]:
        vals = {k: v[0] for k, v in singles[d].items() if v[0] is not None}
        if not vals:
            return None, None
        k = max(vals, key=vals.__getitem__)
        return k, vals[k]

    lines += [
        "### Risk AUROC per cell (test split), with bootstrap 95% intervals",
        "",
        "Risk of each feature set (fitted on the cell's fit split, C by 5-fold CV on log loss) next "
        "to the best single signal in hindsight (the best test AUROC among the features alone, "
        "each oriented by its prior direction). `–`: the fit split cannot be fitted (< 10 items or "
        "one class) or the test split holds one class. A `/within` set is fitted within datasets "
        "only in the pooled row: inside one dataset it is the same set fitted as usual.",
        "",
        "| data | n test (wrong) | " + " | ".join(show_sets) + " | best single |",
        "|---|---|" + "---|" * len(show_sets) + "---|",
    ]
    for d in cells:
        y = cells[d]["test"][1]
        bs, bv = best_single(d)
        row = [f"{d}", f"{y.size} ({int((1 - y).sum())})"]
        row += [_ci(results[d][s].get("auroc"), results[d][s].get("ci", (None, None))) for s in show_sets]
        row.append(f"{bs}: {_ci(bv, singles[d][bs][1:])}" if bs else "–")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", *cost_lines(show_sets, sve_shapes(recs))]
    lines += ["", "### Every single signal alone (test split AUROC, oriented higher = more wrong)", "",
              "| data | " + " | ".join(feats) + " |", "|---|" + "---|" * len(feats)]
    for d in cells:
        lines.append(f"| {d} | " + " | ".join(_fmt(singles[d][f][0]) for f in feats) + " |")

    lines += ["", "### ECE and guarantees (test split)", "",
              "ECE of 1 − risk against correctness (15 bins); `floor (95%)`: the ECE a perfectly "
              "calibrated risk would show on these items (labels drawn from the risk itself, "
              "`metrics.ece_floor`), mean and 95th percentile: the part of ECE that is sampling "
              "noise at this n. An ECE above the 95% figure is miscalibration at the 5% level (one "
              "test per row, no correction for the many rows; the fitted risk taken as fixed). "
              "Coverage at each α (δ = 0.1) is the "
              "share of test answers accepted at the threshold certified on the threshold split; "
              "held = error among them ≤ α; `none` = no threshold certified.", "",
              "| data | set | ECE | floor (95%) | C | " + " | ".join(f"α={a:g} coverage (held)" for a in ALPHAS)
              + " |", "|---|---|---|---|---|" + "---|" * len(ALPHAS)]
    for d in cells:
        for s in show_sets:
            m = results[d][s]
            if "error" in m:
                continue
            g = {row["alpha"]: row for row in m.get("guarantees", [])}
            cov = []
            for a in ALPHAS:
                row = g.get(a)
                if row is None or row["threshold"] is None:
                    cov.append("none")
                else:
                    cov.append(f"{row['coverage']:.2f} ({'yes' if row['held'] else 'NO'})")
            lines.append(f"| {d} | {s} | {_fmt(m['ece'], 3)} | {_fmt(m.get('ece_floor'), 3)} ({_fmt(m.get('ece_floor_p95'), 3)}) | {m['C']:.3g} | "
                         + " | ".join(cov) + " |")

    # ---- coefficient directions per dataset
    big = max((v for v in sets.values() if not set(v) & COSTLY), key=len, default=None)
    coefs = coefficient_signs({d: labelled(by_ds[d]) for d in datasets}, big) if big else {}
    if coefs:
        lines += ["", f"### Direction of each feature per dataset ({'/'.join(big)} fitted on each "
                  "dataset alone; standardised coefficient on P(wrong))", "",
                  "| feature | " + " | ".join(coefs) + " | sign stable |", "|---|" + "---|" * (len(coefs) + 1)]
        for f in big:
            vals = [coefs[d][f] for d in coefs]
            strong = [v for v in vals if abs(v) >= 0.05]
            stable = bool(strong) and (all(v > 0 for v in strong) or all(v < 0 for v in strong))
            lines.append(f"| {f} | " + " | ".join(f"{v:+.2f}" for v in vals) + f" | {'yes' if stable else 'no'} |")

    # ---- LODO table
    goals: dict[str, Any] = {}
    if lodo is not None:
        summ = lodo.summary()
        bs_name, bs_mean = lodo.best_single()
        lines += ["", "### Leave one dataset out (fit on all the others, test on all of the left-out one)", "",
                  "| left out | n | " + " | ".join(c.name for c in candidates) + " | " + " | ".join(feats) + " |",
                  "|---|---:|" + "---|" * (len(candidates) + len(feats))]
        for d in datasets:
            row = [d, str(len(by_ds[d]))]
            for c in candidates:
                m = lodo.rows[d][c.name]
                row.append(f"{_fmt(m.get('auroc'))} / {_fmt(m.get('ece'), 3)}")
            row += [_fmt(lodo.singles[d].get(f)) for f in feats]
            lines.append("| " + " | ".join(row) + " |")
        row = ["**mean**", ""]
        row += [f"{_fmt(summ[c.name]['mean_auroc'])} / {_fmt(summ[c.name]['mean_ece'], 3)}" for c in candidates]
        row += [_fmt(summ.get('single:' + f, {}).get("mean_auroc")) for f in feats]
        lines.append("| " + " | ".join(row) + " |")
        lines += ["", "Cells: risk AUROC / ECE. Candidates: " + "; ".join(
            f"`{c.name}` = {c.note or ', '.join(c.resolve({}) if not callable(c.features) else ())}"
            + (f" (C = {c.C})" if c.C != 'cv' else " (C by CV)") for c in candidates) + ".",
            "", "Features the `sign-stable` rule kept, per left-out dataset: " + "; ".join(
                f"{d}: {', '.join(lodo.features[d]['sign-stable'])}" for d in datasets) + ".",
            "", f"Best single signal in hindsight (best mean over left-out datasets): "
            f"`{bs_name}` {_fmt(bs_mean)}.", "",
            f"**Choice for traffic unlike the calibration data: `{chosen}`**: {reason}.", ""]
        goals["lodo"] = _lodo_goal(summ, chosen, bs_mean)
        if MIXED_SET in summ and chosen != MIXED_SET:
            goals[f"lodo, `{MIXED_SET}`"] = _lodo_goal(summ, MIXED_SET, bs_mean)
    else:
        goals["lodo"] = f"not assessable ({len(datasets)} dataset(s); leave-one-out needs 3)"

    measured = chosen or (DEFAULT_FEATURE_SET if DEFAULT_FEATURE_SET in show_sets else next(iter(show_sets)))
    goals.update(_cell_goals(results, singles, measured, cells, best_single, n_boot))
    if MIXED_SET in show_sets and measured != MIXED_SET:
        goals.update({f"{k}, `{MIXED_SET}`": v for k, v in
                      _cell_goals(results, singles, MIXED_SET, cells, best_single, n_boot).items() if k != "set measured"})
    costly_lines, costly = costly_section(
        results, cells, sets, {d: labelled(by_ds[d]) for d in datasets}, sve_shapes(recs), ALPHAS, n_boot,
        progress=lambda xs: tqdm(xs, desc=f"{model} costly LODO", file=sys.stderr))
    lines += [*costly_lines, "", "### Goals of issue 12", ""] + [f"- {k}: {v}" for k, v in goals.items()] + [""]
    fig = {"costly": costly, "results": results, "singles": singles, "cells": cells, "sets": list(show_sets),
           "lodo": lodo, "candidates": candidates, "goals": goals, "feats": feats, "chosen": chosen, "best_single": best_single}
    _figures(model, fig, out_dir)
    return lines, fig


def _lodo_goal(summ: dict[str, Any], chosen: str | None, bs_mean: float | None) -> str:
    if chosen is None:
        return "not assessable"
    m = summ[chosen]
    ok_min = (m["min_auroc"] or 0) >= 0.5
    ok_mean = bs_mean is not None and (m["mean_auroc"] or 0) >= bs_mean
    return (f"`{chosen}` min {_fmt(m['min_auroc'])} ≥ 0.5: {'MET' if ok_min else 'NOT met'}; mean "
            f"{_fmt(m['mean_auroc'])} ≥ best single in hindsight {_fmt(bs_mean)}: "
            f"{'MET' if ok_mean else 'NOT met'}")


def _cell_goals(results: dict[str, Any], singles: dict[str, Any], chosen: str,
                cells: dict[str, Any], best_single: Any, n_boot: int) -> dict[str, str]:
    out: dict[str, str] = {}
    big, passed, missed, eces, held, bad = [], [], [], [], [], []
    for d, r in results.items():
        m = r.get(chosen, {})
        if "error" in m or m.get("auroc") is None:
            continue
        _, bv = best_single(d)
        n = len(cells[d]["test"][1])
        if d != "pooled" and n >= MIN_CELL and bv is not None:
            big.append(d)
            if m["auroc"] >= bv - 0.01:
                passed.append(d)
            else:
                missed.append(f"{d} {m['auroc']:.3f} vs {bv:.3f}")
        if m.get("ece") is not None:
            eces.append((d, m["ece"], m.get("ece_floor"), m.get("ece_floor_p95")))
        for g in m.get("guarantees", []):
            if g["threshold"] is not None:
                held.append(g["held"])
                if not g["held"]:
                    bad.append(f"{d} α={g['alpha']:g}")
    out["cells (≥ 300 test items): risk ≥ best single − 0.01"] = (
        (f"{len(passed)}/{len(big)} met" + (f" (missed: {', '.join(missed)})" if missed else "")) if big
        else f"not assessable (no cell has ≥ {MIN_CELL} test items)")
    if "pooled" not in results:
        out["pooled: risk ≥ best single + 0.03"] = "not assessable (one dataset)"
    pm = results.get("pooled", {}).get(chosen, {})
    bs, pb = best_single("pooled") if "pooled" in results else (None, None)
    if pm.get("auroc") is not None and bs is not None and pb is not None:
        test = cells["pooled"]["test"]
        best = single_signals(test[0], [bs])[bs]
        diff, lo, hi = paired_bootstrap_diff(1 - test[1], pm["risk"], best, n_boot=n_boot)
        out["pooled: risk ≥ best single + 0.03"] = (
            f"{pm['auroc']:.3f} vs {pb:.3f} + 0.03: {'MET' if pm['auroc'] >= pb + 0.03 else 'NOT met'}"
            + (f" (paired difference {diff:+.3f} [{lo:+.3f}, {hi:+.3f}])" if lo is not None else "")
            + ("" if len(test[1]) >= MIN_CELL else " (n < 300: indicative only)"))
    if eces:
        over = [f"{d} {e:.3f}" + (f" (floor {f:.3f}, 95% {q:.3f}{'' if e <= q else ': beyond noise'})"
                                  if f is not None and q is not None else "")
                for d, e, f, q in eces if e > 0.05]
        out["ECE ≤ 0.05 on test splits"] = f"{len(eces) - len(over)}/{len(eces)} met" + (
            f" (over: {', '.join(over)})" if over else "")
    out["certified guarantees held on test"] = (
        f"{sum(held)}/{len(held)} held" + (f" (failed: {', '.join(bad)})" if bad else "")
        if held else "no α certified in any cell")
    out["set measured"] = f"`{chosen}`"
    return out


def _figures(model: str, fig: dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    safe = model.replace("/", "_")
    results, sets = fig["results"], fig["sets"]
    cells = list(results)
    # AUROC per cell: each set's risk vs the best single signal
    f, ax = plt.subplots(figsize=(max(6, 1.4 * len(cells)), 4))
    w = 0.8 / (len(sets) + 1)
    for i, s in enumerate(sets):
        ys = [results[d][s].get("auroc") or np.nan for d in cells]
        ax.bar(np.arange(len(cells)) + i * w, ys, w, label=s)
    ys = [fig["best_single"](d)[1] or np.nan for d in cells]
    ax.bar(np.arange(len(cells)) + len(sets) * w, ys, w, label="best single (hindsight)", color="k")
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(cells)) + 0.4 - w / 2, cells, rotation=20)
    ax.set_ylabel("AUROC (test split)")
    ax.set_ylim(0.2, 1.0)
    ax.legend(fontsize=7)
    ax.set_title(f"{model}: risk AUROC per cell")
    f.tight_layout()
    f.savefig(out_dir / f"risk_{safe}_auroc.png", dpi=110)
    plt.close(f)
    # risk-coverage on the pooled test split (the only cell when there is one dataset)
    where = "pooled" if "pooled" in results else cells[0]
    f, ax = plt.subplots(figsize=(6, 4))
    y = fig["cells"][where]["test"][1]
    for s in sets:
        r = results[where][s]
        if "risk" in r:
            c, rk = risk_coverage(r["risk"], 1 - y)
            ax.plot(c, rk, label=f"risk: {s}")
    bs, _ = fig["best_single"](where)
    if bs:
        sig = single_signals(fig["cells"][where]["test"][0], [bs])[bs]
        c, rk = risk_coverage(sig, 1 - y)
        ax.plot(c, rk, "k--", label=f"single: {bs}")
    for a in ALPHAS:
        ax.axhline(a, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("coverage (share of answers accepted)")
    ax.set_ylabel("error among accepted")
    ax.legend(fontsize=7)
    ax.set_title(f"{model}: risk-coverage, {where} test split (n={y.size})", fontsize=9)
    f.tight_layout()
    f.savefig(out_dir / f"risk_{safe}_coverage.png", dpi=110)
    plt.close(f)
    lodo = fig["lodo"]
    if lodo is not None:
        ds = list(lodo.rows)
        f, ax = plt.subplots(figsize=(max(6, 1.3 * len(ds)), 4))
        names = [c.name for c in fig["candidates"]]
        w = 0.8 / (len(names) + 1)
        for i, c in enumerate(names):
            ax.bar(np.arange(len(ds)) + i * w, [lodo.rows[d][c].get("auroc") or np.nan for d in ds], w, label=c)
        bs, _ = lodo.best_single()
        ax.bar(np.arange(len(ds)) + len(names) * w, [lodo.singles[d].get(bs) or np.nan for d in ds], w,
               color="k", label=f"single: {bs}")
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(ds)) + 0.4 - w / 2, ds, rotation=20)
        ax.set_ylim(0.2, 1.0)
        ax.set_ylabel("AUROC on the left-out dataset")
        ax.legend(fontsize=7)
        ax.set_title(f"{model}: leave one dataset out")
        f.tight_layout()
        f.savefig(out_dir / f"risk_{safe}_lodo.png", dpi=110)
        plt.close(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", action="append", required=True, metavar="MODEL=PATH[,PATH...]",
                    help="scoring cache JSONL file(s) or glob(s) and the model they belong to "
                    "(repeatable; calibrate writes one cache per dataset under runs/cache/MODEL/)")
    ap.add_argument("--out", type=Path, default=Path("docs/results"), help="folder for risk.md + PNGs")
    ap.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples per AUROC interval")
    ap.add_argument("--free-only", action="store_true",
                    help="ignore P(True) and SVE features: measure every answer on the free ones (else only "
                    "the answers that hold the costly features are measured)")
    args = ap.parse_args(argv)
    logging.getLogger("guarduq").setLevel(logging.ERROR)  # "no threshold met" is in the tables
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    body = [f"Generated by `python benchmarks/risk.py {' '.join('--cache ' + c for c in args.cache)}"
            f" --n-boot {args.n_boot}{' --free-only' if args.free_only else ''}` from the scoring caches (no model loaded)."]
    by_model: dict[str, list[Any]] = defaultdict(list)
    for spec in args.cache:
        model, sep, paths = spec.partition("=")
        if not sep:
            ap.error(f"--cache wants MODEL=PATH, got {spec!r}")
        for pattern in paths.split(","):
            found = sorted(glob.glob(pattern)) or ap.error(f"no cache file matches {pattern!r}")
            for path in found:
                by_model[model].extend(load_cache(Path(path)))
    for model, recs in by_model.items():
        records = list({(r.id, r.model_fingerprint): r for r in recs}.values())  # cached twice: counted once
        lines, fig = analyse_model(model, records, args.n_boot, args.out, costly=not args.free_only)
        safe = model.replace("/", "_")
        body += ["", *lines, f"![AUROC per cell](risk_{safe}_auroc.png)", "",
                 f"![risk-coverage](risk_{safe}_coverage.png)"]
        if fig["lodo"] is not None:
            body += ["", f"![LODO](risk_{safe}_lodo.png)"]
        print(f"{model}: goals of issue 12")
        for k, v in fig["goals"].items():
            print(f"  {k}: {v}")
    body.append(f"\n({time.perf_counter() - t0:.0f} s this invocation.)")
    write_page(args.out / "risk.md", "\n".join(body), "Risk that earns its thresholds")
    print(f"wrote {args.out / 'risk.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
