"""Does the second opinion pay? The first stage alone, the cascade, and the second opinion on
every answer, on the QA scoring caches (issue 24, item 4).

Reads the caches `make risk-data-costly` writes (same-pass scores + the shipped SVE's opinion
per answer), loads no model, and writes ``docs/cascade/README.md`` (the GENERATED block),
``results.json`` and two PNGs. Every method is fitted on guarduq's fit split, certified on the
threshold split and measured on the test split (``split_of``: 40/30/30 within each dataset),
pooled over every dataset (mixed traffic), on the same answers:

* **first stage**: the ``same-pass`` calibrator, threshold certified at ``delta``;
* **cascade** (``guarduq.calibration.cascade``): the first stage certified at ``delta/2``; the
  next ``share`` of the fit split's answers by first-stage risk pay for the SVE; a second stage
  over the first stage's logit and the SVE's features, fitted on the fit split's band answers and
  certified at ``delta/2`` on the threshold split's, so the whole cascade holds at ``delta``;
* **second opinion on everything**: ``same-pass+sve`` for every answer, certified at ``delta``.

Reported per alpha: test coverage and error rate among the accepted (bootstrap 95% intervals),
whether the guarantee held, the share that paid for the SVE, the paired bootstrap difference of
coverage (cascade minus first stage), and the lowest alpha each method certifies.

    python benchmarks/cascade.py --cache 'runs/cache/smollm2-135m-instruct/*.jsonl'
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pages import write_page  # noqa: E402
from risk import group_of, load_cache  # noqa: E402

from guarduq.calibration import Calibrator  # noqa: E402
from guarduq.calibration.cascade import (  # noqa: E402
    band_of,
    cascade_accepts,
    fit_second_stage,
    with_first_risk,
)
from guarduq.calibration.features import FEATURE_SETS, SVEShape, feature_matrix, forward_equivalents  # noqa: E402
from guarduq.calibration.splits import split_of  # noqa: E402
from guarduq.errors import CalibrationError  # noqa: E402

DELTA = 0.1
ALPHAS = tuple(round(a, 3) for a in np.arange(0.30, 0.801, 0.05))
FINE_ALPHAS = tuple(round(a, 3) for a in np.arange(0.20, 0.801, 0.025))
SHARES = (1 / 3, 0.2)
SECOND_SETS = ("cascade", "cascade+agree")
FIRST_SET, EVERYTHING_SET = "same-pass", "same-pass+sve"


def _labelled(records: list[Any]) -> tuple[list[dict[str, Any]], np.ndarray]:
    return [r.scores for r in records], np.array([int(r.label) for r in records])


def load(patterns: list[str]) -> tuple[dict[str, tuple[list[dict[str, Any]], np.ndarray]], list[str], SVEShape | None]:
    """The fit/threshold/test parts of every answer valid for every method, and their datasets."""
    records = [r for p in patterns for f in sorted(glob.glob(p)) for r in load_cache(Path(f))]
    need = tuple(dict.fromkeys(FEATURE_SETS[EVERYTHING_SET] + FEATURE_SETS[FIRST_SET]))
    _, ok = feature_matrix([r.scores for r in records], need)
    recs = [r for r, k in zip(records, ok, strict=True) if k]
    if not recs:
        raise SystemExit("no cached answer holds the SVE features: run `make risk-data-costly` first")
    parts: dict[str, list[Any]] = {"fit": [], "threshold": [], "test": []}
    for r in recs:
        parts[split_of(group_of(r.id))].append(r)
    shape = next((s for r in recs if (s := SVEShape.of(r.scores)) is not None), None)
    return {k: _labelled(v) for k, v in parts.items()}, [r.dataset for r in parts["test"]], shape


def _outcome(accepted: np.ndarray, y: np.ndarray, alpha: float) -> dict[str, Any]:
    n = int(accepted.sum())
    err = float((y[accepted] == 0).mean()) if n else None
    return {"coverage": float(accepted.mean()), "accepted": n, "error_rate": err,
            "held": None if err is None else err <= alpha}


def _boot_ci(values: np.ndarray, idx: np.ndarray) -> tuple[float, float]:
    b = values[idx].mean(axis=1)
    return float(np.percentile(b, 2.5)), float(np.percentile(b, 97.5))


def _error_ci(accepted: np.ndarray, y: np.ndarray, idx: np.ndarray) -> tuple[float | None, float | None]:
    acc = accepted[idx]
    wrong = (y[idx] == 0) & acc
    n = acc.sum(axis=1)
    rates = wrong.sum(axis=1)[n > 0] / n[n > 0]
    if rates.size == 0:
        return None, None
    return float(np.percentile(rates, 2.5)), float(np.percentile(rates, 97.5))


def _name(feats: str, share: float) -> str:
    return f"{feats} {share:.0%}"  # e.g. "cascade 33%": the second stage's features, the share that pays


MAIN = _name("cascade", 1 / 3)


def run(parts: dict[str, Any], n_boot: int, policy_alpha: float, alphas: tuple[float, ...] = FINE_ALPHAS,
        seed: int = 0) -> dict[str, Any]:
    """Every method at every alpha; test-split outcomes with paired bootstrap intervals."""
    (fit_s, fit_y), (thr_s, thr_y), (test_s, y) = parts["fit"], parts["threshold"], parts["test"]
    first = Calibrator(FIRST_SET).fit(fit_s, fit_y)
    everything = Calibrator(EVERYTHING_SET).fit(fit_s, fit_y)
    r1, r_all = first.predict_risk(test_s), everything.predict_risk(test_s)
    idx = np.random.default_rng(seed).integers(0, y.size, size=(n_boot, y.size))

    def certified(cal: Calibrator, delta: float) -> Calibrator:
        c = copy.deepcopy(cal)
        c.fit_thresholds(thr_s, thr_y, alphas=alphas, delta=delta)
        return c

    first_full, first_half, every_full = certified(first, DELTA), certified(first, DELTA / 2), certified(everything, DELTA)
    none = np.zeros(y.size, bool)
    rows: dict[str, Any] = {}
    lowest: dict[str, float | None] = {}
    curves: dict[str, Any] = {"first stage": r1.tolist(), "second opinion on everything": r_all.tolist()}
    coefficients: dict[str, Any] = {}
    band_auroc: dict[str, Any] = {}
    for alpha in tqdm(alphas, desc="cascade alphas", file=sys.stderr):
        accepted: dict[str, np.ndarray] = {}
        info: dict[str, dict[str, Any]] = {}
        t1, ta = first_full.threshold_for(alpha), every_full.threshold_for(alpha)
        accepted["first stage"] = r1 <= t1 if t1 is not None else none
        info["first stage"] = {"paid": 0.0, "threshold": t1, "certified": t1 is not None}
        accepted["second opinion on everything"] = r_all <= ta if ta is not None else none
        info["second opinion on everything"] = {"paid": 1.0, "threshold": ta, "certified": ta is not None}
        for feats in SECOND_SETS:
            for share in SHARES:
                name = _name(feats, share)
                try:
                    second = fit_second_stage(first_half, fit_s, fit_y, thr_s, thr_y, alpha=alpha,
                                              delta=DELTA / 2, share=share, features=feats)
                except CalibrationError as exc:  # e.g. the first stage accepts everything: no band above it
                    info[name] = {"error": str(exc)}
                    continue
                band, t2, t1h = band_of(second), second.threshold_for(alpha), first_half.threshold_for(alpha)
                r2 = second.predict_risk(with_first_risk(test_s, r1))
                accepted[name] = cascade_accepts(r1, r2, t1h, band, t2)
                info[name] = {"paid": float(band.contains(r1).mean()), "share": band.share, "threshold": t2,
                              "first_threshold": t1h,
                              "band": [band.lower, band.upper], "certified": t1h is not None or t2 is not None}
                if feats == "cascade" and math.isclose(share, 1 / 3):
                    coefficients[str(alpha)] = second.coefficients()
                    band_auroc[str(alpha)] = {**_inside_band(band.contains(r1), y, r1, r2, test_s, n_boot),
                                              "band": [band.lower, band.upper]}
                    # one risk per answer: the second stage's in the band, the first stage's elsewhere
                    curves[f"cascade at alpha {alpha:g}"] = np.where(band.contains(r1), r2, r1).tolist()
        base = accepted["first stage"].astype(float)
        row: dict[str, Any] = {}
        for name, inf in info.items():
            if name not in accepted:
                row[name] = inf
                continue
            acc = accepted[name]
            row[name] = {**inf, **_outcome(acc, y, alpha), "coverage_ci": _boot_ci(acc.astype(float), idx),
                         "error_ci": _error_ci(acc, y, idx)}
            if name != "first stage":
                d = acc.astype(float) - base
                row[name]["coverage_gain"] = float(d.mean())
                row[name]["coverage_gain_ci"] = _boot_ci(d, idx)
            if inf["certified"] and lowest.get(name) is None:
                lowest[name] = alpha
            lowest.setdefault(name, None)
        rows[str(alpha)] = row
    return {"alphas": rows, "lowest": lowest, "curves": curves, "labels": y.tolist(),
            "coefficients": coefficients, "band_auroc": band_auroc, "n": {k: int(v[1].size) for k, v in parts.items()}}


def _inside_band(inside: np.ndarray, y: np.ndarray, r1: np.ndarray, r2: np.ndarray,
                 scores: list[dict[str, Any]], n_boot: int) -> dict[str, Any]:
    """How well each signal tells wrong from right among the test answers in the band: the
    second opinion is worth its cost only if it separates what the first stage could not."""
    from guarduq.calibration.analysis import bootstrap_auroc
    from guarduq.calibration.features import FEATURES, ORIENTATION

    wrong = (y[inside] == 0).astype(float)
    rows = [s for s, k in zip(scores, inside, strict=True) if k]
    signals = {"first-stage risk": r1[inside], "second-stage risk": r2[inside]}
    for f in FEATURE_SETS["cascade+agree"][1:]:
        signals[f] = ORIENTATION[f] * np.array([FEATURES[f](s) for s in rows])
    return {"n": int(inside.sum()), "wrong": int(wrong.sum()),
            **{k: bootstrap_auroc(wrong, v, n_boot=n_boot) for k, v in signals.items()}}


def _lowest_line(lowest: dict[str, float | None]) -> str:
    return "; ".join(f"{k}: {'none' if v is None else f'{v:g}'}" for k, v in lowest.items())


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _ci(ci: tuple[float | None, float | None] | list[Any] | None) -> str:
    if not ci or ci[0] is None:
        return ""
    return f" [{_pct(ci[0])}, {_pct(ci[1])}]"


def page(res: dict[str, Any], shape: SVEShape | None, datasets: list[str], policy_alpha: float) -> str:
    """The GENERATED block: setup, the table per alpha, lowest alphas, goals, per-dataset split."""
    n = res["n"]
    sve_cost = (forward_equivalents(FEATURE_SETS[EVERYTHING_SET], shape) or math.nan) - 3.0
    methods = ["first stage", *(_name(f, s) for f in SECOND_SETS for s in SHARES), "second opinion on everything"]
    lines = [
        f"Answers valid for every method: fit {n['fit']}, threshold {n['threshold']}, test {n['test']} "
        f"({len(set(datasets))} datasets pooled; test answers per dataset: "
        + ", ".join(f"{d} {datasets.count(d)}" for d in sorted(set(datasets))) + ").",
        "",
        f"SVE as cached: M = {shape.members if shape else '?'} members in the last "
        f"{shape.targeted_blocks if shape else '?'} of {shape.total_blocks if shape else '?'} blocks, greedy "
        f"answer ≤ {shape.answer_tokens if shape else '?'} tokens. Cost per answer in forward-pass equivalents: "
        f"first stage 3 (forward + backward); the SVE opinion adds {sve_cost:.2f}, paid by the share in the "
        "band only (the `paid` column). δ = 0.1 for every method; the cascade splits it, 0.05 per stage.",
        "",
        "Coverage (share of test answers accepted) and error rate among them, in %, with bootstrap 95% "
        "intervals over the test answers; `held`: error rate ≤ α; `gain`: coverage minus the first "
        "stage's on the same answers (paired). `–`: nothing certified at that α. `cascade 33%`: second "
        "stage over the first stage's logit and the SVE's member mean, variance and mutual information, "
        "the next third of answers above the first stage's threshold paying; `cascade+agree`: also whether "
        "the members' own greedy answer agrees.",
        "",
        "| α | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for a in [a for a in ALPHAS if str(a) in res["alphas"]]:
        row = res["alphas"][str(a)]
        cells = []
        for m in methods:
            c = row.get(m, {})
            if "coverage" not in c or not c.get("certified"):
                cells.append("–" if "error" not in c else "no band above")
                continue
            txt = f"{_pct(c['coverage'])}{_ci(c['coverage_ci'])}, err {_pct(c['error_rate'])}"
            txt += "" if c["held"] in (True, None) else " (NOT held)"
            if m != "first stage":
                txt += f", gain {_pct(c['coverage_gain'])}{_ci(c['coverage_gain_ci'])}"
            if m.startswith("cascade"):
                txt += f", paid {_pct(c['paid'])}"
            cells.append(txt)
        lines.append(f"| {a:g} | " + " | ".join(cells) + " |")
    lines += ["", f"Lowest α each method certifies (of {min(map(float, res['alphas'])):g} to "
              f"{max(map(float, res['alphas'])):g}, {len(res['alphas'])} values): " + _lowest_line(res["lowest"]) + ".", ""]
    lines += ["### Goal", "", goal_text(res), ""]
    lines += ["![coverage per alpha](cascade_coverage.png)", "", "![risk-coverage](cascade_risk_coverage.png)", ""]
    shown = [a for a in (str(policy_alpha), res["lowest"].get(MAIN)) if a is not None]
    for a in dict.fromkeys(str(float(x)) if not isinstance(x, str) else x for x in shown):
        band = res["band_auroc"].get(a)
        if not band:
            continue
        lo, hi = band["band"]
        lines += [f"Inside the band at α = {a} (first-stage risk {'from the lowest' if lo is None else f'> {lo:.3f}'} "
                  f"to ≤ {hi:.3f}; {band['n']} test answers, {band['wrong']} wrong): AUROC for wrong answers, "
                  "bootstrap 95% interval: " + "; ".join(
                      f"{k} {v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]" if v[1] is not None else f"{k} –"
                      for k, v in band.items() if k not in ("n", "wrong", "band")) + ".", ""]
    coef = res["coefficients"].get(str(policy_alpha))
    if coef:
        lines += [f"Second stage at α = {policy_alpha:g} (share 1/3), standardised coefficients on P(wrong): "
                  + ", ".join(f"{k} {v:+.2f}" for k, v in coef.items()) + "."]
    return "\n".join(lines)


def goal_text(res: dict[str, Any]) -> str:
    """Issue 24's goal: a lower certified alpha, or >= 5 points more coverage at the same alpha,
    with at most a third paying; else say by how much it falls short."""
    main = MAIN
    lo_first, lo_c = res["lowest"].get("first stage"), res["lowest"].get(main)
    best = None
    for a, row in res["alphas"].items():
        c, f = row.get(main, {}), row["first stage"]
        # the cost bound is the band's design share (on the fit split); `paid` is what test answers paid
        usable = "coverage_gain" in c and f.get("certified") and c.get("certified") and c.get("share", 1) <= 1 / 3 + 1e-9
        if usable and (best is None or c["coverage_gain"] > best[1]["coverage_gain"]):
            best = (a, c)
    lower = lo_c is not None and (lo_first is None or lo_c < lo_first)
    parts = [f"Lowest certified α: first stage {lo_first}, cascade {lo_c} "
             f"({'lower: met' if lower else 'not lower'})."]
    if best is not None:
        a, c = best
        lo, hi = c["coverage_gain_ci"]
        met = c["coverage_gain"] >= 0.05
        where = "interval above 0" if lo > 0 else ("interval below 0: the cascade covers less" if hi < 0 else "interval includes 0")
        parts.append(f"Largest coverage gain at a common certified α: {_pct(c['coverage_gain'])} points "
                     f"[{_pct(c['coverage_gain_ci'][0])}, {_pct(c['coverage_gain_ci'][1])}] at α = {a}, "
                     f"with {_pct(c['paid'])}% of test answers paying ({'≥ 5 points: met' if met else 'short of 5 points'}; "
                     f"{where}).")
    else:
        parts.append("No α is certified by both the first stage and the cascade.")
    for name, lo in res["lowest"].items():  # every other variant that certifies below the first stage
        if name in (MAIN, "first stage") or lo is None or (lo_first is not None and lo >= lo_first):
            continue
        c = res["alphas"][str(lo)][name]
        parts.append(f"`{name}` certifies α = {lo:g}, below the first stage: coverage {_pct(c['coverage'])}"
                     f"{_ci(c['coverage_ci'])}, error rate {_pct(c['error_rate'])}, {_pct(c['paid'])}% paying.")
    return " ".join(parts)


def figures(res: dict[str, Any], out: Path, policy_alpha: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    alphas = [float(a) for a in res["alphas"]]
    for m, style in (("first stage", "k-"), (MAIN, "C0-"), (_name("cascade+agree", 1 / 3), "C0--"),
                     (_name("cascade", 0.2), "C2-"), ("second opinion on everything", "C3-")):
        cov = [row.get(m, {}).get("coverage") if row.get(m, {}).get("certified") else np.nan
               for row in res["alphas"].values()]
        ax.plot(alphas, [np.nan if c is None else c for c in cov], style, label=m, marker=".")
    _save(fig, ax, out / "cascade_coverage.png", "α (target error rate among accepted answers, δ = 0.1)",
          "test coverage", "Coverage at the certified threshold, pooled QA mix")

    y = np.asarray(res["labels"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, risk in res["curves"].items():
        if risk is None or (name.startswith("cascade") and name != f"cascade at alpha {policy_alpha:g}"):
            continue
        order = np.argsort(np.asarray(risk), kind="stable")
        wrong = (y[order] == 0).astype(float)
        k = np.arange(1, y.size + 1)
        ax.plot(k / y.size, np.cumsum(wrong) / k, label=name)
    _save(fig, ax, out / "cascade_risk_coverage.png", "coverage (answers accepted, lowest risk first)",
          "error rate among accepted", "Risk–coverage on the test split")


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    import matplotlib.pyplot as plt

    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", action="append", required=True, help="glob of scoring caches with SVE features")
    ap.add_argument("--out", type=Path, default=Path("docs/cascade"))
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--policy-alpha", type=float, default=0.7, help="the alpha the shipped cascade policy uses")
    ap.add_argument("--alpha", type=float, action="append", help="only these alphas (default 0.2 to 0.8 by 0.025)")
    args = ap.parse_args(argv)
    logging.getLogger("guarduq").setLevel(logging.ERROR)  # "no threshold met" is in the tables
    parts, datasets, shape = load(args.cache)
    res = run(parts, args.n_boot, args.policy_alpha, tuple(args.alpha) if args.alpha else FINE_ALPHAS)
    args.out.mkdir(parents=True, exist_ok=True)
    figures(res, args.out, args.policy_alpha)
    (args.out / "results.json").write_text(json.dumps(
        {k: v for k, v in res.items() if k not in ("curves", "labels")}, indent=1, default=float))
    write_page(args.out / "README.md", page(res, shape, datasets, args.policy_alpha), "The calibrated cascade")
    print(goal_text(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
