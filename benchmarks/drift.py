"""Does the drift alarm predict trouble, and does it say which kind? (issue item 7)

Windows of live scores are drawn from three kinds of source and classified by
:class:`guarduq.calibration.drift_groups.CaseClassifier` (ok / slice:<dataset> / unseen), and on
each window the shipped calibrator's risk is checked: its AUROC for wrong answers and whether the
alpha = 0.7 guarantee (error rate among accepted answers <= 0.7) holds there.

* **mix** (false alarms): fresh items of the calibration datasets, drawn in the reference's
  dataset proportions; TruthfulQA has no item outside calibration (all 817 were used), so half
  of the artifact's held-out TruthfulQA items (by id hash) are taken out of the reference and
  serve as its fresh items;
* **one in-mix dataset** (should read ``slice:<dataset>``): fresh items of one of them;
* **left out** (should read ``unseen``): SST-2 sentiment as a two-option question;
* **leave one dataset out** (:func:`lodo`): per in-mix dataset with fresh items, a calibrator
  refitted on the fresh items of the others, and windows of the left-out one against its reference.

Fresh items are scored by ``benchmarks/drift_score.py`` (the real model) into
``scores/cache/drift/``; this script loads no model:

    python benchmarks/drift.py            # writes docs/results/drift.md + drift.png
    python benchmarks/drift.py --quick    # synthetic data, seconds (tests/unit/test_drift_bench.py)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _drift_folds import fold_windows, folds_report, print_folds, write_folds  # noqa: E402
from _drift_windows import (  # noqa: E402
    ALPHA,
    FEATURES,
    HELD_ASIDE,
    Pool,
    auroc,
    guarantee,
    psi_max,
    run,
    summarize,
    wilson,
    windows,
)
from _pages import write_page  # noqa: E402

from guarduq.calibration.drift_groups import CaseClassifier, GroupReference, group_reference  # noqa: E402
from guarduq.calibration.splits import hash_unit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARTIFACT = ROOT / "policies" / "calibrators" / "smollm2-135m-instruct.json"
CACHES = ROOT / "scores" / "cache" / "drift" / "smollm2-135m-instruct"
LEFT_OUT = ("sst2",)


# --------------------------------------------------------------------------- data


def _features(rec: dict[str, Any]) -> list[float]:
    from guarduq.calibration.features import FEATURES as F

    out = []
    for f in FEATURES:
        try:
            out.append(float(F[f](rec)))
        except (KeyError, TypeError, ValueError):
            out.append(math.nan)
    return out


def scored_records(folder: Path | None, pattern: str = "*.jsonl") -> list[dict[str, Any]]:
    """The usable score records (with ``dataset``) of the caches ``folder/pattern``."""
    from guarduq.calibration.evaluation import ScoreCache

    paths = sorted(glob.glob(str(folder / pattern))) if folder else []
    return [{**r.scores, "dataset": r.dataset} for path in paths
            for r in ScoreCache(path, read_only=True).entries.values() if r.usable]


def calibration_items(folder: Path | None) -> list[dict[str, Any]]:
    """Calibration items outside the test share, rescored by ``benchmarks/drift_trace.py --score``
    into ``folder`` (``*-rest.jsonl``): what a refitted artifact's ``drift_reference`` adds to a
    group besides its test items."""
    return scored_records(folder, "*-rest.jsonl")


def cache_reference(folder: Path) -> GroupReference:
    """Every usable item of the calibration score caches in ``folder``, with its dataset: the
    reference a calibrator refitted on them stores (``drift_reference``), before refitting it."""
    recs = scored_records(folder)
    counts = ", ".join(f"{g} {n}" for g, n in sorted(Counter(r["dataset"] for r in recs).items()))
    return group_reference(recs, FEATURES, f"calibration items in {folder} ({counts})")


def real_data(extend: Path | None = None) -> tuple[GroupReference, dict[str, Pool], float, dict[str, Any]]:
    """The artifact's drift reference (``drift_reference``: every calibration item; older artifacts:
    the held-out ``evaluation_data``) less half of the held-out TruthfulQA items, which become its
    fresh pool (plus, for an old artifact, the calibration items in ``extend``), and the fresh pools."""
    from guarduq.calibration.calibrator import Calibrator
    from guarduq.calibration.evaluation import ScoreCache

    art = json.loads(ARTIFACT.read_text())
    cal = Calibrator.load(ARTIFACT)
    threshold = cal.threshold_for(ALPHA)
    recs = _columns(art["evaluation_data"])
    # evaluation_data keeps no ids; its order is fixed, so the item's index decides the hold-aside
    aside = [r["dataset"] in HELD_ASIDE and hash_unit(f"{r['dataset']}:{i}", "drift-aside") < 0.5
             for i, r in enumerate(recs)]
    if art.get("drift_reference"):
        base, name = _columns(art["drift_reference"]), "drift_reference (every calibration item)"
        kept = _without(base, [r for r, a in zip(recs, aside, strict=True) if a])
    else:
        more = calibration_items(extend)
        extra = "".join(f" plus {k} {g} calibration items outside the test share"
                        for g, k in Counter(r["dataset"] for r in more).items())
        base, name = recs + more, f"evaluation_data{extra}"
        kept = [r for r, a in zip(recs, aside, strict=True) if not a] + more
    ref = group_reference(kept, FEATURES, f"{ARTIFACT.name} {name} less half of the held-out TruthfulQA")
    pools: dict[str, Pool] = {}
    for ds in HELD_ASIDE:
        rows = [r for r, a in zip(recs, aside, strict=True) if a and r["dataset"] == ds]
        pools[ds] = Pool(ds, np.array([_features(r) for r in rows]), np.array([r["risk"] for r in rows]),
                         np.array([1 - r["label"] for r in rows]), np.array([ds] * len(rows)))
    for path in sorted(glob.glob(str(CACHES / "*.jsonl"))):
        items = [r for r in ScoreCache(path, read_only=True).entries.values() if r.usable]
        if not items:
            continue
        ds = items[0].dataset
        scores = [r.scores for r in items]
        pools[ds] = Pool(ds, np.array([_features(s) for s in scores]), cal.predict_risk(scores),
                         np.array([1 - r.label for r in items]), np.array([ds] * len(items)))
    info = {"reference": ref.source, "threshold": threshold, "artifact": ARTIFACT.name,
            "fingerprint": art["model"]["fingerprint"],
            "shipped": group_reference(base, FEATURES, f"{ARTIFACT.name} {name} (all {len(base)})")}
    return ref, pools, float(threshold), info


def _columns(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of an artifact's column table (``evaluation_data``, ``drift_reference``)."""
    keys = [k for k, v in data.items() if isinstance(v, list)]
    return [{k: data[k][i] for k in keys} for i in range(len(data["dataset"]))]


def _without(rows: list[dict[str, Any]], drop: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` less one row per row of ``drop`` with the same dataset and raw signals (both tables
    round them to the same 6 significant digits, and neither keeps item ids)."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["dataset"], r.get("epistemic"), r.get("aleatoric"), r.get("mean_logprob"))

    left = Counter(key(r) for r in drop)
    out = []
    for r in rows:
        if left[key(r)] > 0:
            left[key(r)] -= 1
        else:
            out.append(r)
    missing = sum(left.values())
    if missing:
        raise SystemExit(f"{missing} held-aside items are not in the drift reference: artifact tables disagree")
    return out


def quick_data(seed: int = 0) -> tuple[GroupReference, dict[str, Pool], float, dict[str, Any]]:
    """Synthetic: four Gaussian groups, fresh pools like them, and a shifted left-out one whose
    risk ranks wrong answers backwards (so it degrades)."""
    rng = np.random.default_rng(seed)
    centres = {"a": (0, 0, 0), "b": (2, 0, -1), "c": (0, 2, 1), "d": (-2, -1, 0)}

    def draw(name: str, centre: tuple[float, ...], n: int, flip: bool = False) -> Pool:
        x = rng.normal(centre, 0.7, size=(n, 3))
        risk = 1 / (1 + np.exp(-(x[:, 0] - np.mean(centre[:1]))))
        p_wrong = 1 - risk if flip else risk
        wrong = (rng.random(n) < p_wrong).astype(float)
        return Pool(name, x, risk, wrong, np.array([name] * n))

    recs = []
    for g, c in centres.items():
        p = draw(g, c, 200)
        recs += [{"dataset": g, **dict(zip(("epistemic", "aleatoric", "mean_logprob"),
                                           (math.exp(r[0]), r[1], r[2]), strict=True))} for r in p.x]
    ref = group_reference(recs, FEATURES, "synthetic")
    pools = {g: draw(g, c, 120) for g, c in centres.items()}
    pools["left-out"] = draw("left-out", (4, 3, 3), 200, flip=True)
    return ref, pools, 0.5, {"reference": "synthetic", "threshold": 0.5, "shipped": ref}


# --------------------------------------------------------------------------- leave one dataset out

LODO_FEATURES = "same-pass"  # the shipped set: the fresh caches carry the grad profile it needs
LODO_QUICK_FEATURES = "log_epistemic,aleatoric,mean_logprob"


def lodo_part(ident: str) -> str:
    """Which part of a fresh item a LODO refit uses: ``fit`` (half), ``ref`` (a quarter: the α
    thresholds and the drift reference) or ``probe`` (a quarter: the in-distribution windows)."""
    if hash_unit(ident, "lodo-fit") < 0.5:
        return "fit"
    return "ref" if hash_unit(ident, "lodo-ref") < 0.5 else "probe"


def lodo_real_records() -> dict[str, list[dict[str, Any]]]:
    """Fresh scored items of the in-mix datasets (SST-2 is not in the mix; TruthfulQA has no
    fresh items with the grad profile: its held-aside half is ``evaluation_data`` only)."""
    from guarduq.calibration.evaluation import ScoreCache

    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(glob.glob(str(CACHES / "*.jsonl"))):
        items = [r for r in ScoreCache(path, read_only=True).entries.values() if r.usable]
        if items and items[0].dataset not in LEFT_OUT:
            out[items[0].dataset] = [{"id": r.id, "scores": r.scores, "label": int(r.label)} for r in items]
    return out


def lodo_quick_records(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Synthetic: four groups whose risk follows ``log_epistemic``, and a far group ``e`` where
    it runs backwards (left out, it should read ``unseen`` and degrade)."""
    rng = np.random.default_rng(seed)
    centres = {"a": (0, 0, 0), "b": (2, 0, -1), "c": (0, 2, 1), "d": (-2, -1, 0), "e": (4, 3, 3)}
    out = {}
    for g, c in centres.items():
        x = rng.normal(c, 0.7, size=(200, 3))
        p_wrong = 1 / (1 + np.exp(-2 * (x[:, 0] - c[0])))
        wrong = rng.random(200) < (1 - p_wrong if g == "e" else p_wrong)
        out[g] = [{"id": f"{g}{i}", "label": int(not w),
                   "scores": {"epistemic": math.exp(r[0]), "aleatoric": r[1], "mean_logprob": r[2],
                              "mean_token_prob": math.exp(r[2]), "valid": True}}
                  for i, (r, w) in enumerate(zip(x, wrong, strict=True))]
    return out


def _lodo_pool(name: str, items: list[tuple[str, dict[str, Any]]], features: tuple[str, ...],
               cal: Any) -> Pool:
    from guarduq.calibration.features import FEATURES as F

    def val(s: dict[str, Any], f: str) -> float:
        try:
            return float(F[f](s))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return math.nan

    scores = [r["scores"] for _, r in items]
    return Pool(name, np.array([[val(s, f) for f in features] for s in scores]).reshape(len(items), len(features)),
                cal.predict_risk(scores), np.array([1 - r["label"] for _, r in items], dtype=float),
                np.array([d for d, _ in items]))


def lodo(records: dict[str, list[dict[str, Any]]], features: str, *, size: int, count: int,
         seed: int = 3) -> dict[str, Any]:
    """For each dataset D: refit the calibrator without D, certify α on held-out items of the
    others, build the drift reference the way an artifact's is (``evaluate`` → ``attach_evaluation``
    → ``to_dict`` → ``reference_from_artifact``), then classify windows of D's items and of the
    others' probe items, with AUROC and the α guarantee of the refit on each window."""
    from guarduq.calibration.analysis import bootstrap_auroc
    from guarduq.calibration.calibrator import Calibrator
    from guarduq.calibration.drift import reference_from_artifact

    rng = np.random.default_rng(seed)
    part = {d: [lodo_part(f"{d}:{r['id']}") for r in rs] for d, rs in records.items()}
    folds: dict[str, Any] = {}
    for left in tqdm(records, desc="LODO refits", file=sys.stderr):
        def sel(k: str, left: str = left) -> list[tuple[str, dict[str, Any]]]:
            return [(d, r) for d in records if d != left for r, p in zip(records[d], part[d], strict=True) if p == k]

        fit, ref, probe = sel("fit"), sel("ref"), sel("probe")
        cal = Calibrator(features)
        cal.fit([r["scores"] for _, r in fit], [r["label"] for _, r in fit])
        cal.fit_thresholds([r["scores"] for _, r in ref], [r["label"] for _, r in ref], alphas=(ALPHA,))
        thr = cal.threshold_for(ALPHA)
        cal.attach_evaluation(cal.evaluate([r["scores"] for _, r in ref], [r["label"] for _, r in ref],
                                           datasets=[d for d, _ in ref]))
        grouped = reference_from_artifact(cal.to_dict(), f"LODO without {left}").grouped
        if grouped is None:
            continue
        clf = CaseClassifier(grouped, window=size)
        t = -math.inf if thr is None else float(thr)
        fold: dict[str, Any] = {"n_fit": len(fit), "n_ref": dict(Counter(d for d, _ in ref)), "n_probe": len(probe),
                                "threshold": thr, "C": cal.C_, "features": list(cal.features),
                                "ref_features": list(grouped.features), "case_thresholds": clf.thresholds.to_dict()}
        for name, items in (("left-out", [(left, r) for r in records[left]]), ("mix", probe)):
            pool = _lodo_pool(name, items, grouped.features, cal)
            a, lo, hi = bootstrap_auroc(pool.wrong, pool.risk, n_boot=500, seed=seed)
            cov, err, held = guarantee(pool, t)
            whole = clf.classify({f: pool.x[:, j] for j, f in enumerate(grouped.features)}) if pool.n >= size else None
            rows = []
            for win in windows(pool, size, count, rng, replace=False) if pool.n >= size else []:
                c = clf.classify({f: win.x[:, j] for j, f in enumerate(grouped.features)})
                wc, we, wh = guarantee(win, t)
                rows.append({"label": c.label, "auroc": auroc(win.wrong, win.risk), "coverage": wc, "error": we, "held": wh})
            cases = Counter(r["label"] for r in rows)
            au = np.array([r["auroc"] for r in rows], dtype=float)
            alarm = sum(r["label"] != "ok" for r in rows)
            fold[name] = {"n": pool.n, "wrong": float(pool.wrong.mean()),
                          "auroc": a, "auroc_ci": (lo, hi), "coverage": cov, "error": err, "held": held,
                          "whole_case": whole.label if whole else None, "windows": len(rows),
                          "cases": dict(cases.most_common()), "alarm": alarm / max(len(rows), 1),
                          "alarm_ci": wilson(alarm, len(rows)),
                          "auroc_median": float(np.nanmedian(au)) if np.isfinite(au).any() else math.nan,
                          "auroc_q": [float(np.nanpercentile(au, q)) for q in (10, 90)] if np.isfinite(au).any() else [math.nan] * 2,
                          "window_held": float(np.mean([r["held"] for r in rows])) if rows else math.nan,
                          "window_error_median": float(np.nanmedian([r["error"] for r in rows])) if rows else math.nan,
                          "window_coverage_median": float(np.median([r["coverage"] for r in rows])) if rows else math.nan}
        folds[left] = fold
    fa = sum(round(f["mix"]["alarm"] * f["mix"]["windows"]) for f in folds.values())
    nw = sum(f["mix"]["windows"] for f in folds.values())
    return {"features": features, "size": size, "count": count, "folds": folds,
            "mix_false_alarm": fa / max(nw, 1), "mix_false_alarm_ci": wilson(fa, nw), "mix_windows": nw}


def _f(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def lodo_report(res: dict[str, Any]) -> list[str]:
    folds = res["folds"]
    if not folds:
        return []
    any_fold = next(iter(folds.values()))
    lines = [f"### Leave one dataset out (windows of {res['size']} without replacement, {res['count']} per source)", "",
             f"Per left-out dataset D: a calibrator (`{res['features']}`: {', '.join(any_fold['features'])}) fitted "
             "on the fresh items of the other datasets with `hash_unit(id, \"lodo-fit\") < 0.5`, α = 0.7 certified "
             "on half of the rest (`ref`), the drift reference built from the same `ref` items through "
             "`evaluate` → `attach_evaluation` → `to_dict` → `reference_from_artifact` (features "
             f"{', '.join(any_fold['ref_features'])}), and the last quarter (`probe`) kept for in-distribution "
             "windows. D's items: all its fresh items, never seen by that refit.", "",
             "| left out | n fit / ref / probe | α = 0.7 threshold (risk ≤) | D: n, wrong | D whole pool: case, AUROC [95%] | "
             "D windows read | D windows: median AUROC [10–90%] | D: guarantee held (pool; windows) | "
             "mix windows read | mix: median AUROC | mix: guarantee held (windows) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, f in folds.items():
        L, M = f["left-out"], f["mix"]

        def shares(v: dict[str, Any]) -> str:
            return ", ".join(f"{k} {c / max(v['windows'], 1):.2f}" for k, c in v["cases"].items()) or "n/a"

        ci = L["auroc_ci"]
        if f["threshold"] is None:  # nothing certified: every answer abstains, the guarantee is vacuous
            pool_held, mix_held = "not certified (nothing accepted)", "n/a (not certified)"
        else:
            pool_held = (f"{'held' if L['held'] else 'FAILS'} (cov {L['coverage']:.2f}, err {_f(L['error'])}); "
                         f"{_f(L['window_held'])}")
            mix_held = f"{_f(M['window_held'])} (median cov {_f(M['window_coverage_median'])})"
        lines.append(
            f"| {d} | {f['n_fit']} / {sum(f['n_ref'].values())} / {f['n_probe']} | {_f(f['threshold'], '.3f')} | "
            f"{L['n']}, {L['wrong']:.2f} | {L['whole_case'] or 'n/a'}, {_f(L['auroc'])} [{_f(ci[0])}, {_f(ci[1])}] | "
            f"{shares(L)} | {_f(L['auroc_median'])} [{_f(L['auroc_q'][0])}, {_f(L['auroc_q'][1])}] | "
            f"{pool_held} | {shares(M)} | {_f(M['auroc_median'])} | {mix_held} |")
    lo, hi = res["mix_false_alarm_ci"]
    lines += ["", f"* In-distribution false alarms of the refit references (probe windows not read `ok`), all folds: "
              f"{res['mix_false_alarm']:.3f} [{_f(lo, '.3f')}, {_f(hi, '.3f')}] of {res['mix_windows']} windows; per fold: "
              + ", ".join(f"without {d} {f['mix']['alarm']:.2f} (probe pool {f['mix']['n']})" for d, f in folds.items()) + ".",
              "* Reference groups (`ref` items per dataset): "
              + "; ".join(f"without {d}: " + ", ".join(f"{g} {n}" for g, n in f["n_ref"].items()) for d, f in folds.items()) + ".",
              ""]
    return lines


# --------------------------------------------------------------------------- report


def pool_table(pools: dict[str, Pool], threshold: float, seed: int = 0) -> list[str]:
    from guarduq.calibration.analysis import bootstrap_auroc

    lines = ["| source | n | wrong | risk AUROC [95%] | coverage at α = 0.7 | error among accepted | guarantee |",
             "|---|---|---|---|---|---|---|"]
    for name, p in pools.items():
        a, lo, hi = bootstrap_auroc(p.wrong, p.risk, n_boot=500, seed=seed)
        cov, err, held = guarantee(p, threshold)
        au = f"{a:.2f} [{lo:.2f}, {hi:.2f}]" if a is not None else "n/a"
        lines.append(f"| {name} | {p.n} | {p.wrong.mean():.2f} | {au} | {cov:.2f} | "
                     f"{'n/a' if math.isnan(err) else f'{err:.2f}'} | {'held' if held else 'FAILS'} |")
    return lines


def whole_pool_table(shipped: GroupReference, pools: dict[str, Pool]) -> list[str]:
    """What ``guarduq drift`` says of each whole fresh pool against the shipped artifact's full
    reference (every held-out item, TruthfulQA included; its own pools are then not fresh)."""
    lines = ["| pool | n | case | mix distance / threshold | nearest group (distance / threshold) | max PSI (old level) |",
             "|---|---|---|---|---|---|"]
    for name, p in pools.items():
        if name in HELD_ASIDE:
            continue
        clf = CaseClassifier(shipped, window=min(p.n, 1000))
        c = clf.classify({f: p.x[:, j] for j, f in enumerate(FEATURES)})
        near = c.nearest or "n/a"
        ratio = c.group_distances.get(near, math.nan) / clf.thresholds.groups.get(near, math.nan)
        pm = psi_max(shipped, p)
        lines.append(f"| {name} | {p.n} | {c.label} | {c.mix_distance / c.mix_threshold:.1f} | {near} ({ratio:.1f}) | "
                     f"{pm:.2f} ({'alarm' if pm >= 0.25 else 'watch' if pm >= 0.1 else 'ok'}) |")
    return lines


def window_table(s: dict[str, Any]) -> list[str]:
    lines = ["| source | windows | should read | reads (count) | exactly right [95%] | right case | alarm (not ok) | "
             "old PSI alarm | median AUROC | guarantee held |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in s["per_source"].items():
        cases = ", ".join(f"{k} {c}" for k, c in v["cases"].items())
        lo, hi = v["correct_ci"]
        lines.append(f"| {name} | {v['n']} | {v['expected']} | {cases} | {v['correct']:.2f} [{lo:.2f}, {hi:.2f}] | {v['case_correct']:.2f} | "
                     f"{v['alarm']:.2f} | {v['psi_alarm']:.2f} | {v['auroc_median']:.2f} | {v['held']:.2f} |")
    return lines


def _case_bars(ax: Any, res: dict[str, Any]) -> None:
    """Stacked share of windows per case read, per source."""
    by = defaultdict(list)
    for r in res["rows"]:
        by[r["source"]].append(r)
    names = list(by)
    kinds = {"ok": "#4c9a2a", "slice (right group)": "#3a78c2", "slice (other group)": "#9ab8e0", "unseen": "#c23b3b"}
    bottoms = np.zeros(len(names))
    for kind, color in kinds.items():
        vals = []
        for s in names:
            rs = by[s]
            if kind in ("ok", "unseen"):
                k = sum(r["label"] == kind for r in rs)
            elif kind == "slice (right group)":
                k = sum(r["label"] == f"slice:{s}" for r in rs)
            else:
                k = sum(r["label"].startswith("slice:") and r["label"] != f"slice:{s}" for r in rs)
            vals.append(k / len(rs))
        ax.bar(names, vals, bottom=bottoms, color=color, label=kind)
        bottoms += np.array(vals)
    ax.set_ylabel("share of windows")
    ax.set_title(f"case read, windows of {res['size']} {'with' if res['replace'] else 'without'} replacement",
                 fontsize=10)
    ax.tick_params(axis="x", rotation=40)


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = results[:2]
    fig, axes = plt.subplots(1, len(bars) + 1, figsize=(6.2 * (len(bars) + 1), 4.6))
    for ax, res in zip(axes, bars, strict=False):
        _case_bars(ax, res)
    axes[0].legend(fontsize=8, loc="lower left")
    res = results[0]
    ax = axes[-1]
    for i, s in enumerate(dict.fromkeys(r["source"] for r in res["rows"])):
        rs = [r for r in res["rows"] if r["source"] == s]
        ax.scatter([r["mix_distance"] for r in rs], [r["auroc"] for r in rs], s=8, alpha=0.5,
                   label=s, color=plt.cm.tab10(i % 10))
    ax.axvline(res["thresholds"]["mix"], color="k", ls="--", lw=1, label="mix threshold")
    ax.axhline(0.5, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("distance to the calibration mix (max scaled KS)")
    ax.set_ylabel(f"risk AUROC on the window (windows of {res['size']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def report(info: dict[str, Any], pools: dict[str, Pool], threshold: float, results: list[dict[str, Any]],
           summaries: list[dict[str, Any]], auroc_floor: float, png: str,
           lodo_res: dict[str, Any] | None = None, folded: list[dict[str, Any]] | None = None) -> str:
    lines = [f"Reference: {info['reference']}; fresh items from `scores/cache/drift/` (model fingerprint "
             f"{info.get('fingerprint', 'n/a')}); α = {ALPHA} threshold risk ≤ {threshold:.3f}. "
             f"A window is **degraded** when the α guarantee clearly fails on it (the 95% Wilson lower "
             f"bound of its error rate among accepted answers is above {ALPHA}) or its risk AUROC is below {auroc_floor}.", "",
             "### Pools (every fresh item of a source, once)", "", *pool_table(pools, threshold), "",
             "### What `guarduq drift` says of each whole pool (shipped reference, all held-out items)", "",
             *whole_pool_table(info["shipped"], pools), ""]
    for res, s in zip(results, summaries, strict=True):
        t = res["thresholds"]
        how = "with replacement (a window may repeat items)" if res["replace"] else "without replacement"
        fa = s["per_source"].get("mix", {})
        if not fa:
            continue
        lines += [f"### Windows of {res['size']}, drawn {how}, {res['count']} per source", "",
                  f"Thresholds (5% false-alarm bootstrap, {t['draws']} draws): mix {t['mix']:.2f}; groups "
                  + ", ".join(f"{g} {v:.2f}" for g, v in t["groups"].items()) + ".", "",
                  *window_table(s), "",
                  f"* False alarms (mix windows not read `ok`): {fa.get('alarm', math.nan):.3f} "
                  f"[{fa.get('alarm_ci', (math.nan, math.nan))[0]:.3f}, {fa.get('alarm_ci', (math.nan, math.nan))[1]:.3f}] "
                  f"of {fa.get('n', 0)} windows.",
                  f"* Degraded windows: {s['degraded_n']}; alarmed (not `ok`): {s['detected']} "
                  f"({s['detected'] / max(s['degraded_n'], 1):.2f} [{s['detected_ci'][0]:.2f}, {s['detected_ci'][1]:.2f}]); "
                  f"read `unseen`: {s['unseen_of_degraded']}. Windows not degraded: {s['fine_n']}, "
                  f"of which alarmed {s['fine_alarm']}.", "",
                  "Trouble by the case read (does the case predict a degraded window?):", "",
                  "| case read | windows | degraded [95%] | guarantee failed | AUROC < floor | median AUROC | from |",
                  "|---|---|---|---|---|---|---|",
                  *[f"| {c} | {v['n']} | "
                    + (f"{v['degraded'] / v['n']:.2f} [{v['degraded_ci'][0]:.2f}, {v['degraded_ci'][1]:.2f}]" if v["n"] else "n/a")
                    + f" | {v['guarantee_failed']} | {v['auroc_below']} | {v['auroc_median']:.2f} | "
                    + ", ".join(f"{k} {n}" for k, n in v["sources"].items()) + " |"
                    for c, v in s["by_case"].items()], ""]
    if folded:
        lines += folds_report(folded)
    if lodo_res:
        lines += lodo_report(lodo_res)
    lines += [f"![cases per source and AUROC against distance]({png})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="synthetic data, no caches needed")
    p.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "results")
    p.add_argument("--size", type=int, default=500)
    p.add_argument("--small", type=int, default=100, help="window drawn without replacement")
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--auroc-floor", type=float, default=0.5)
    p.add_argument("--folds", type=int, action="append", default=None, metavar="K",
                   help="in-distribution false alarms on K folds of the reference (repeatable; default 10 and 20)")
    p.add_argument("--folds-only", action="store_true",
                   help="only the fold windows (no fresh pools needed): writes drift_folds.md and .json")
    p.add_argument("--reference-caches", type=Path, metavar="DIR",
                   help="with --folds-only: the reference is every usable item of the score caches DIR/*.jsonl "
                   "(what a refitted artifact's drift_reference holds), not the artifact's")
    p.add_argument("--extend-reference", type=Path, metavar="DIR",
                   help="add the calibration items drift_trace.py rescored (DIR/*-rest.jsonl) to the reference")
    args = p.parse_args(argv)
    args.folds = args.folds or ([5] if args.quick else [10, 20])
    if args.quick:
        ref, pools, threshold, info = quick_data()
        args.count = min(args.count, 40)
        args.size, args.small = min(args.size, 200), min(args.small, 60)
    else:
        ref, pools, threshold, info = real_data(args.extend_reference)
    if args.reference_caches:
        info["shipped"] = cache_reference(args.reference_caches)
    folded = [fold_windows(info["shipped"], folds=k, draws=100 if args.quick else 400) for k in args.folds]
    if args.folds_only:
        write_folds(args.out_dir / ("drift_folds_quick.md" if args.quick else "drift_folds.md"), folded)
        return 0
    results = [run(ref, pools, threshold, size=args.size, count=args.count, replace=True),
               run(ref, pools, threshold, size=args.small, count=args.count, replace=False, seed=1),
               run(ref, pools, threshold, size=args.size, count=args.count, replace=False, seed=2)]
    results = [r for r in results if r["rows"]]  # without replacement: only pools of >= size items
    lodo_res = lodo(lodo_quick_records() if args.quick else lodo_real_records(),
                    LODO_QUICK_FEATURES if args.quick else LODO_FEATURES, size=args.small, count=args.count)
    summaries = [summarize(r, args.auroc_floor) for r in results]
    name = "drift_quick" if args.quick else "drift"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(results, args.out_dir / f"{name}.png")
    body = report(info, pools, threshold, results, summaries, args.auroc_floor, f"{name}.png", lodo_res, folded)
    write_page(args.out_dir / f"{name}.md", body, "Drift that predicts trouble: ok, slice or unseen")
    (args.out_dir / f"{name}.json").write_text(json.dumps(
        {"info": {k: v for k, v in info.items() if k != "shipped"}, "summaries": summaries,
         "thresholds": [r["thresholds"] for r in results], "lodo": lodo_res,
         "fold_windows": folded}, indent=1, default=float))
    for s, r in zip(summaries, results, strict=True):
        print(f"windows of {r['size']} ({'with' if r['replace'] else 'without'} replacement):")
        for src, v in s["per_source"].items():
            print(f"  {src:<16} {v['expected']:<22} correct {v['correct']:.2f} alarm {v['alarm']:.2f} "
                  f"cases {v['cases']}")
    for d, f in lodo_res["folds"].items():
        L = f["left-out"]
        print(f"  LODO without {d:<14} cases {L['cases']} AUROC {L['auroc']} held {L['held']} "
              f"mix alarm {f['mix']['alarm']:.2f}")
    print_folds(folded)
    print(f"wrote {args.out_dir / name}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
