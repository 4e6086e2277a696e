"""The method's claims across model sizes: one table and one plot from the scoring caches.

    python benchmarks/scale.py \
        --cache 'smollm2-135m-instruct=scores/cache/smollm2-135m-instruct/*.jsonl' \
        --cache 'qwen2.5-coder-1.5b-instruct=scores/cache/qwen2.5-coder-1.5b-instruct/*.jsonl' \
        [--cost 'qwen2.5-coder-1.5b-instruct=docs/results/scale/cost_qwen2.5-coder-1.5b-instruct.json']

Per model (no model is loaded; caches are read from private copies, so live ones are fine):

* accuracy per dataset, n;
* AUROC for wrong answers of each single signal (test split, bootstrap 95% intervals), pooled and
  per dataset, including ``log_epistemic_norm`` = log ||grad log p̄||²;
* the calibrated risk (``same-pass``, fitted pooled on the fit split, as the shipped calibrators
  are) pooled and on each dataset's test items, and, beside it, a fit on each dataset's own fit
  split (what a calibrator for that kind of traffic alone would do), and the mean/min over datasets
  left out of the fit;
* the gain of the gradient features, paired on the pooled test split: ``same-pass`` against the
  same set without any gradient feature, and each of ``log_epistemic`` and ``log_epistemic_norm``
  added alone to that set;
* a risk model per dataset (what a calibrator fitted per traffic group gives when the group is
  known), pooled, paired against the pooled risk, each dataset's error rate and the best single
  signal;
* the strictest alpha certified on the threshold split (delta 0.1), its test coverage and whether
  it held;
* seconds per guarded answer and peak memory, where ``--cost`` gives the model's
  ``benchmarks/scale_cost.py`` output.

Writes ``scale.json``, ``scale.md`` and ``scale_auroc.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pages import write_page  # noqa: E402
from risk import group_of, labelled, load_cache, parts  # noqa: E402

from guarduq.calibration.analysis import (  # noqa: E402
    Candidate,
    bootstrap_auroc,
    fit_and_test,
    leave_one_dataset_out,
    paired_bootstrap_diff,
    single_signals,
)
from guarduq.calibration.features import GRAD_PROFILE, LIKELIHOOD  # noqa: E402
from guarduq.calibration.splits import split_of  # noqa: E402
from guarduq.policy.context import group_threshold, risk_group  # noqa: E402

ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
DELTA = 0.1
SIGNALS = ("log_epistemic", "log_epistemic_norm", "aleatoric", *LIKELIHOOD, *GRAD_PROFILE)
NO_GRAD = ("aleatoric", *LIKELIHOOD)  # same-pass without any gradient feature
SETS = {
    "no gradient": NO_GRAD,
    "+ log_epistemic": ("log_epistemic", *NO_GRAD),
    "+ log_epistemic_norm": ("log_epistemic_norm", *NO_GRAD),
    "same-pass": ("log_epistemic", *NO_GRAD, *GRAD_PROFILE),
}
RISK_SET = "same-pass"  # the shipped calibrators' set


def _strictest(guarantees: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The smallest alpha with a certified threshold (its test coverage and whether it held)."""
    ok = [g for g in guarantees if g.get("threshold") is not None]
    return min(ok, key=lambda g: g["alpha"]) if ok else None


def analyse(model: str, records: list[Any], n_boot: int) -> dict[str, Any]:
    """Every figure of the scale table for one model."""
    by_ds: dict[str, list[Any]] = defaultdict(list)
    for r in records:
        by_ds[r.dataset].append(r)
    res: dict[str, Any] = {"model": model, "n": len(records), "datasets": {}, "pooled": {}}
    n_params = {r.scores.get("n_params") for r in records if r.scores.get("n_params")}
    res["n_params"] = max(n_params) if n_params else None
    cells = {"pooled": parts(records)} | {d: parts(rs) for d, rs in sorted(by_ds.items())}
    test_ds = np.array([r.dataset for r in records if split_of(group_of(r.id)) == "test"])
    pooled_risk: Any = None
    for d, split in cells.items():
        test_scores, y = split["test"]
        wrong = 1 - y
        cell: dict[str, Any] = {
            "n": int(sum(len(p[1]) for p in split.values())), "n_test": int(y.size),
            "accuracy": float(np.mean(np.concatenate([p[1] for p in split.values()]))),
            "singles": {k: bootstrap_auroc(wrong, v, n_boot=n_boot)
                        for k, v in single_signals(test_scores, SIGNALS).items()},
        }
        fits = {name: fit_and_test(feats, split["fit"], split["test"], threshold=split["threshold"],
                                   alphas=ALPHAS, delta=DELTA, n_boot=n_boot)
                for name, feats in SETS.items()}
        cell["risk"] = {name: {"auroc": (m.get("auroc"), *m.get("ci", (None, None))), "ece": m.get("ece"),
                               "strictest": _strictest(m.get("guarantees", []))} if "error" not in m
                        else {"error": m["error"]} for name, m in fits.items()}
        if all("risk" in m for m in fits.values()):
            base = fits["no gradient"]["risk"]
            cell["gain"] = {name: paired_bootstrap_diff(wrong, fits[name]["risk"], base, n_boot=n_boot)
                            for name in SETS if name != "no gradient"}
            best = max((k for k, v in cell["singles"].items() if v[0] is not None),
                       key=lambda k: cell["singles"][k][0], default=None)
            if best is not None:
                sig = single_signals(test_scores, [best])[best]
                cell["best_single"] = best
                cell["risk_vs_best_single"] = paired_bootstrap_diff(wrong, fits[RISK_SET]["risk"], sig,
                                                                    n_boot=n_boot)
        if d == "pooled":
            res["pooled"] = cell
            pooled_risk = fits[RISK_SET].get("risk")
        else:
            if pooled_risk is not None:  # the pooled calibrator on this dataset's test items
                mask = test_ds == d
                cell["pooled_fit"] = bootstrap_auroc(1 - cells["pooled"]["test"][1][mask],
                                                     np.asarray(pooled_risk)[mask], n_boot=n_boot)
            res["datasets"][d] = cell
    if by_ds and pooled_risk is not None:
        res["per_group"] = per_group(records, cells, np.asarray(pooled_risk), res["pooled"].get("best_single"),
                                     n_boot)
    if len(by_ds) >= 3:
        lodo = leave_one_dataset_out({d: labelled(rs) for d, rs in by_ds.items()},
                                     [Candidate(RISK_SET, SETS[RISK_SET])], SIGNALS, n_boot=0)
        res["lodo"] = {d: {"risk": lodo.rows[d][RISK_SET].get("auroc"), **lodo.singles[d]} for d in lodo.rows}
    return res


def per_group(records: list[Any], cells: dict[str, Any], pooled_risk: np.ndarray, best: str | None,
              n_boot: int) -> dict[str, Any]:
    """``Calibrator(per_group=True)`` with each item's dataset as its traffic group: a model per
    dataset (the pooled one for a dataset too small for its own), certified and measured on the
    risk as served when each request's group is known.

    Knowing the group is itself a signal: its error rate on the fit split ranks the pooled test
    items too. So the per-group risk is compared, paired, with that base rate, with the pooled
    risk and with the best single signal.
    """
    names: dict[str, list[str]] = defaultdict(list)
    for r in records:  # in the order parts() keeps
        names[split_of(group_of(r.id))].append(r.dataset)
    split = cells["pooled"]
    m = fit_and_test(SETS[RISK_SET], split["fit"], split["test"], threshold=split["threshold"],
                     per_group=names, keep_calibrator=True, alphas=ALPHAS, delta=DELTA, n_boot=n_boot)
    if "error" in m:
        return {"error": m["error"]}
    test_scores, y = split["test"]
    wrong, risk, test_ds = 1 - y, np.asarray(m["risk"]), np.array(names["test"])
    base = np.zeros(test_ds.size)
    for d in np.unique(test_ds):
        base[test_ds == d] = 1 - float(np.mean(cells[d]["fit"][1])) if len(cells[d]["fit"][1]) else np.nan
    out: dict[str, Any] = {
        "auroc": (m["auroc"], *m["ci"]),
        "ece": m["ece"],
        "group_strictest": {d: _strictest(gs) for d, gs in m.get("group_guarantees", {}).items()},
        "pooled_for": m["pooled_for"],
        "base_rate": bootstrap_auroc(wrong, base, n_boot=n_boot),
        "vs_base_rate": paired_bootstrap_diff(wrong, risk, base, n_boot=n_boot),
        "vs_pooled": paired_bootstrap_diff(wrong, risk, pooled_risk, n_boot=n_boot),
        "policies": policies(m["calibrator"], test_scores, names["test"], wrong),
    }
    if best is not None:  # the pooled table's best single signal
        out["best_single"] = best
        sig = single_signals(test_scores, [best])[best]
        out["vs_best_single"] = paired_bootstrap_diff(wrong, risk, sig, n_boot=n_boot)
    return out


def policies(cal: Any, scores: list[Any], groups: list[str], wrong: np.ndarray) -> dict[float, dict[str, Any]]:
    """What a policy at each alpha decides on the test split, as ``Guard`` decides: the pooled
    calibrator alone (pooled risk and threshold) against the per-group one (a certified group's
    own risk and threshold, every other reply the pooled ones: ``policy.context.risk_group``).
    Accepted share and error rate among the accepted, per alpha either certifies anything."""
    pooled = cal.predict_risk(scores)
    out: dict[float, dict[str, Any]] = {}
    for alpha in ALPHAS:
        pol = SimpleNamespace(config=SimpleNamespace(alpha=alpha))
        t = cal.threshold_for(alpha)
        plain = pooled <= t if t is not None else np.zeros(len(scores), bool)
        served = [risk_group(pol, cal, g) for g in groups]
        grouped = plain.copy()
        for i, g in enumerate(served):
            if g is not None:
                grouped[i] = cal.risk(scores[i], group=g) <= group_threshold(cal, alpha, g)
        if plain.any() or grouped.any():
            out[alpha] = {name: {"accepted": float(acc.mean()), "error_rate": float(wrong[acc].mean()) if acc.any()
                                 else None, "n": int(acc.size)} for name, acc in (("pooled", plain), ("per_group", grouped))}
            out[alpha]["groups_own"] = sorted({g for g in served if g is not None})
    return out


def _f(x: float | None, nd: int = 2) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def _ci(t: Any) -> str:
    if not t or t[0] is None:
        return "–"
    return f"{t[0]:.2f} [{_f(t[1])}, {_f(t[2])}]" if t[1] is not None else f"{t[0]:.2f}"


def _gain(t: Any) -> str:
    if not t or t[0] is None:
        return "–"
    return f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"


def render(results: list[dict[str, Any]], costs: dict[str, dict[str, Any]], command: str) -> str:
    models = [r["model"] for r in results]
    head = "| | " + " | ".join(models) + " |"
    sep = "|---|" + "---:|" * len(models)
    lines = [f"Generated by `{command}` from the scoring caches (no model loaded). Test-split AUROC for "
             "wrong answers with bootstrap 95% intervals; gains are paired (both sets on the same test "
             "items). The calibrated risk is `same-pass` fitted pooled on the fit split (40%), its "
             "thresholds certified on the threshold split (30%, δ = 0.1), everything measured on the "
             "test split (30%). The risk with a model per dataset is what a calibrator fitted per traffic "
             "group gives when each request's group is known (`Calibrator(per_group=True)`, `guarduq "
             "calibrate --per-dataset`): each dataset's own `same-pass` fit, the pooled one for a dataset "
             "whose fit split is too small; each dataset's model certified on its own answers; every modelled dataset is served its own "
             "model here, where a policy serves only the certified ones. Knowing the "
             "group is a signal by itself, so it is compared with each dataset's error rate as well.", "", "## The scale table", "", head, sep,
             "| parameters | " + " | ".join(f"{r['n_params'] / 1e6:,.0f} M" if r["n_params"] else "–"
                                           for r in results) + " |",
             "| answers (test) | " + " | ".join(f"{r['n']:,} ({r['pooled']['n_test']:,})" for r in results) + " |",
             "| accuracy, pooled | " + " | ".join(_f(r["pooled"]["accuracy"]) for r in results) + " |"]
    datasets = sorted({d for r in results for d in r["datasets"]})
    for d in datasets:
        lines.append(f"| accuracy, {d} | " + " | ".join(
            f"{_f(r['datasets'][d]['accuracy'])} (n {r['datasets'][d]['n']})" if d in r["datasets"] else "–"
            for r in results) + " |")
    lines.append("| **calibrated risk AUROC, pooled** | " + " | ".join(
        f"**{_ci(r['pooled']['risk'][RISK_SET].get('auroc'))}**" for r in results) + " |")
    lines.append("| risk − best single, paired | " + " | ".join(
        f"{_gain(r['pooled'].get('risk_vs_best_single'))} vs `{r['pooled'].get('best_single')}`" for r in results) + " |")
    pg = [r.get("per_group", {}) for r in results]
    lines.append("| **risk with a model per dataset** (the group known), pooled | " + " | ".join(
        f"**{_ci(g.get('auroc'))}**" for g in pg) + " |")
    lines.append("| its error rate per dataset alone (fit split), pooled | " + " | ".join(
        _ci(g.get("base_rate")) for g in pg) + " |")
    for key, what in (("vs_pooled", "pooled risk"), ("vs_base_rate", "error rate per dataset"),
                      ("vs_best_single", "best single")):
        lines.append(f"| per-dataset risk − {what}, paired | " + " | ".join(_gain(g.get(key)) for g in pg) + " |")
    def decided(r: dict[str, Any]) -> str:
        rows = []
        for a, d in sorted(r.get("per_group", {}).get("policies", {}).items(), key=lambda kv: float(kv[0])):
            p, g = d["pooled"], d["per_group"]
            rows.append(f"α = {float(a):g}: {p['accepted']:.0%} ({_f(p['error_rate'])}) → {g['accepted']:.0%} "
                        f"({_f(g['error_rate'])})")
        return "<br>".join(rows) or "nothing certified"

    lines.append("| a policy at α on the test split: share answered (error rate among them), pooled → "
                 "per-dataset calibrator | " + " | ".join(decided(r) for r in results) + " |")
    for s in SIGNALS:
        lines.append(f"| {s}, pooled | " + " | ".join(_ci(r["pooled"]["singles"].get(s)) for r in results) + " |")
    for name in ("+ log_epistemic", "+ log_epistemic_norm", "same-pass"):
        lines.append(f"| **gain of {name if name != 'same-pass' else 'every gradient feature'}** over "
                     "no gradient | " + " | ".join(_gain(r["pooled"].get("gain", {}).get(name)) for r in results) + " |")
    lines.append("| risk AUROC left out, mean / min over datasets | " + " | ".join(
        (lambda v: f"{_f(np.mean(v))} / {_f(np.min(v))}" if v else "–")(
            [x["risk"] for x in r.get("lodo", {}).values() if x.get("risk") is not None]) for r in results) + " |")

    def strictest(r: dict[str, Any]) -> str:
        g = r["pooled"]["risk"][RISK_SET].get("strictest")
        if not g:
            return "none"
        return f"α = {g['alpha']:g}: coverage {g['coverage']:.2f}, {'held' if g['held'] else 'NOT held'}"

    lines.append("| strictest α certified (test coverage, held?) | " + " | ".join(strictest(r) for r in results) + " |")
    def own(r: dict[str, Any]) -> str:
        got = {d: g for d, g in r.get("per_group", {}).get("group_strictest", {}).items() if g}
        return ", ".join(f"{d} α = {g['alpha']:g} ({g['coverage']:.2f}{'' if g['held'] else ', NOT held'})"
                         for d, g in sorted(got.items())) or "none"

    lines.append("| datasets certified with their own model: strictest α (test coverage) | " + " | ".join(
        own(r) for r in results) + " |")
    lines.append("| ECE of the risk, pooled | " + " | ".join(
        _f(r["pooled"]["risk"][RISK_SET].get("ece"), 3) for r in results) + " |")

    def cost(m: str, key: str) -> str:
        c = costs.get(m, {})
        s = c.get("short")
        if key == "short":
            return f"{s['ratio']['all']:.2f}× / {s['ratio']['last_n_blocks=2']:.2f}×" if s else "–"
        if key == "seconds":  # per answer, the fastest repeat of the run
            if not s or "seconds" not in s:
                return "–"
            per = (s["seconds"][k] / s["n"] for k in ("unguarded", "all", "last_n_blocks=2"))
            return "/".join(f"{x:.0f}" for x in per) + f" s ({s['tokens']} tokens)"
        d = c.get("dtype", {}).get("float32")
        return f"{d['peak'] / 2**30:.1f} GB" if d else "–"

    lines.append("| guarded ÷ unguarded short answer, all / last 2 blocks | " + " | ".join(cost(m, "short") for m in models) + " |")
    lines.append("| seconds per answer: unguarded / all / last 2 blocks | " + " | ".join(cost(m, "seconds") for m in models) + " |")
    lines.append("| peak memory while scoring (fp32) | " + " | ".join(cost(m, "peak") for m in models) + " |")
    lines += ["", "![AUROC against model size](scale_auroc.png)", "",
              "## Per dataset: the calibrated risk and each single signal (test split)", ""]
    for r in results:
        lines += [f"### {r['model']}", "", "| data | n test | risk, pooled fit | risk, own fit | "
                  + " | ".join(SIGNALS) + " |", "|---|---:|---:|---:|" + "---:|" * len(SIGNALS)]
        for d, c in [*r["datasets"].items(), ("pooled", r["pooled"])]:
            own = c["risk"][RISK_SET].get("auroc", (None,))
            lines.append(f"| {d} | {c['n_test']} | {_ci(c.get('pooled_fit', own))} | {_f(own[0])} | "
                         + " | ".join(_f(c["singles"].get(s, (None,))[0]) for s in SIGNALS) + " |")
        if r.get("lodo"):
            lines += ["", "Left out of the fit (fitted on the other datasets, tested on all of this one):", "",
                      "| left out | risk | " + " | ".join(SIGNALS) + " |", "|---|---:|" + "---:|" * len(SIGNALS)]
            for d, x in r["lodo"].items():
                lines.append(f"| {d} | {_f(x.get('risk'))} | " + " | ".join(_f(x.get(s)) for s in SIGNALS) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out: Path) -> None:
    """AUROC (pooled test split, 95% interval) against parameters, one line per signal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in results if r["n_params"]), key=lambda r: r["n_params"])
    if not rows:
        return
    x = np.array([r["n_params"] for r in rows], float)
    series = {"calibrated risk (same-pass)": lambda r: r["pooled"]["risk"][RISK_SET].get("auroc"),
              "risk, a model per dataset": lambda r: r.get("per_group", {}).get("auroc"),
              "epistemic ‖∇p̄‖²": lambda r: r["pooled"]["singles"].get("log_epistemic"),
              "normalised ‖∇log p̄‖²": lambda r: r["pooled"]["singles"].get("log_epistemic_norm"),
              "mean log-probability": lambda r: r["pooled"]["singles"].get("mean_logprob"),
              "aleatoric p̄(1−p̄)": lambda r: r["pooled"]["singles"].get("aleatoric")}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    offsets = np.linspace(-0.04, 0.04, len(series))  # in log10 units, so intervals do not overlap
    for (label, get), off in zip(series.items(), offsets, strict=True):
        vals = [get(r) or (None, None, None) for r in rows]
        y = np.array([v[0] if v[0] is not None else np.nan for v in vals], float)
        lo = np.array([v[1] if v[1] is not None else np.nan for v in vals], float)
        hi = np.array([v[2] if v[2] is not None else np.nan for v in vals], float)
        xs = x * 10**off
        style = ({"lw": 2.5, "color": "k"} if label.startswith("calibrated") else
                 {"lw": 2.5, "color": "k", "ls": ":"} if label.startswith("risk,") else {"lw": 1.2})
        ax.errorbar(xs, y, yerr=[y - lo, hi - y], marker="o", capsize=3, label=label, **style)
    ax.axhline(0.5, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{r['model'].split('-instruct')[0]}\n{r['n_params'] / 1e6:,.0f} M" for r in rows], fontsize=7)
    ax.minorticks_off()
    ax.set_ylabel("AUROC for wrong answers (pooled test split)")
    ax.set_ylim(0.3, 1.0)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_title("Does the signal rank wrong answers better as models grow? (95% intervals)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", action="append", required=True, metavar="MODEL=GLOB")
    ap.add_argument("--cost", action="append", default=[], metavar="MODEL=JSON")
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--skip-missing", action="store_true", help="leave out a model whose glob matches no cache")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results" / "scale")
    args = ap.parse_args(argv)
    logging.getLogger("guarduq").setLevel(logging.ERROR)
    results = []
    for spec in args.cache:
        model, _, pattern = spec.partition("=")
        paths = sorted(glob.glob(os.path.expanduser(pattern)))
        if not paths:
            if args.skip_missing:
                print(f"{model}: no cache matches {pattern!r}; left out", file=sys.stderr)
                continue
            ap.error(f"no cache matches {pattern!r}")
        recs = {(r.id, r.model_fingerprint): r for p in paths for r in load_cache(Path(p))}
        results.append(analyse(model, list(recs.values()), args.n_boot))
    costs = {}
    for spec in args.cost:
        model, _, path = spec.partition("=")
        costs[model] = json.loads(Path(path).read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    plot(results, args.out / "scale_auroc.png")
    command = "python benchmarks/scale.py " + " ".join(f"--cache '{c}'" for c in args.cache)
    write_page(args.out / "scale.md", render(results, costs, command), "The method across model sizes")
    print(f"wrote {args.out / 'scale.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
