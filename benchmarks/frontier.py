"""The parameter frontier: what the risk loses when the gradient covers fewer parameters. From caches.

    .venv/bin/python benchmarks/frontier.py \\
        --cache 'smollm2-135m-instruct=runs/cache/smollm2-135m-instruct/*.jsonl' \\
        [--cache 'gemma-3-270m=runs/cache/gemma-3-270m-q4_k_m/*.jsonl']

Every cache line of an all-parameter pass holds the gradient's profile by group (embeddings,
each block's attention / MLP / norms, final norm, head). The gradient over a union of groups is
the full gradient restricted to them, so one all-parameter pass gives every such subset's
scores (``features.restrict_profile``; tested against scoring the subset directly). For each
subset: AUROC of ``log_epistemic`` alone and of the calibrated ``same-pass`` risk (one pooled
calibrator, risk.py's id-hash splits), each with a bootstrap interval and a paired bootstrap
difference against all parameters on the same test items; per dataset; leave one dataset out;
coverage at the certified alphas and whether each held; and the cost (scoring / forward) that
benchmarks/long_context.py measured for the same set. Writes docs/results/frontier.{md,json,png}.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pages import write_page  # noqa: E402
from risk import group_of, load_cache  # noqa: E402

from guarduq.calibration.analysis import (  # noqa: E402
    Candidate,
    available,
    bootstrap_auroc,
    fit_and_test,
    leave_one_dataset_out,
    paired_bootstrap_diff,
    single_signals,
)
from guarduq.calibration.features import FEATURE_SETS, feature_matrix, restrict_profile  # noqa: E402
from guarduq.calibration.splits import split_of  # noqa: E402
from guarduq.scoring.uncertainty import parameter_set_id  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FEATURES = FEATURE_SETS["same-pass"]
ALPHAS = (0.5, 0.6, 0.7)
DELTA = 0.1
MIN_CELL = 300
_BLOCK = re.compile(r"^block\.(\d+)\.")


def subsets(n_blocks: int) -> dict[str, tuple[str, Any]]:
    """Name -> (parameter_set id, which profile groups it holds)."""

    def last(n: int) -> Any:
        return lambda g: bool(m := _BLOCK.match(g)) and int(m.group(1)) >= n_blocks - n

    out: dict[str, tuple[str, Any]] = {"all": ("all", lambda g: True)}
    for n in (8, 4, 2, 1):
        out[f"last {n} block{'s' if n > 1 else ''}"] = (parameter_set_id(None, n), last(n))
    out["MLPs only"] = (parameter_set_id(r"\.mlp\.", None), lambda g: g.endswith(".mlp"))
    out["attention only"] = (parameter_set_id(r"\.self_attn\.", None), lambda g: g.endswith(".attn"))
    out["final norm + head"] = (parameter_set_id([r"^model\.norm\.", "lm_head", "embed_tokens"], None),
                                lambda g: g in ("final_norm", "head", "embed"))
    return out


def costs(path: Path) -> dict[str, dict[int, float]]:
    """Set name -> {tokens: scoring / forward} from benchmarks/long_context.py's JSON."""
    if not path.exists():
        return {}
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for row in json.loads(path.read_text()).get("scoring", []):
        for k, v in row.items():
            if k not in ("tokens", "forward_s"):
                out[k][int(row["tokens"])] = v / row["forward_s"]
    return out


def analyse(model: str, records: list[Any], n_boot: int, cost: dict[str, dict[int, float]]) -> tuple[list[str], dict[str, Any]]:
    n_blocks = 1 + max(int(m.group(1)) for r in records for g in r.scores.get("grad_profile", {})
                       if (m := _BLOCK.match(g)))
    sets = subsets(n_blocks)
    base = [r for r in records if r.scores.get("grad_profile") and r.parameter_set == "all"]
    _, ok = feature_matrix([r.scores for r in base], FEATURES)
    recs = [r for r, k in zip(base, ok, strict=True) if k]
    split = [split_of(group_of(r.id)) for r in recs]
    labels = np.array([int(r.label) for r in recs], int)
    datasets = sorted({r.dataset for r in recs})
    test = np.array([s == "test" for s in split])
    wrong_test = 1 - labels[test]
    ds_test = np.array([r.dataset for r in recs])[test]
    out: dict[str, Any] = {"model": model, "n": len(recs), "n_test": int(test.sum()), "n_blocks": n_blocks, "sets": {}}
    ref: dict[str, np.ndarray] = {}
    # every single signal of the all-parameter pass, on the same test items as each risk
    test_scores = [r.scores for r, t in zip(recs, test, strict=True) if t]
    out["singles"] = {f: bootstrap_auroc(wrong_test, v, n_boot=n_boot)
                      for f, v in single_signals(test_scores, FEATURES).items()}
    for name, (set_id, keep) in tqdm(sets.items(), desc=f"{model} sets", file=sys.stderr):
        scores = [restrict_profile(r.scores, keep, set_id) for r in recs]

        def part(which: str, scores: list[dict[str, Any]] = scores) -> tuple[list[Any], np.ndarray]:
            idx = [i for i, s in enumerate(split) if s == which]
            return [scores[i] for i in idx], labels[idx]

        feats = available(scores, FEATURES)  # a set without blocks has no block shares
        m = fit_and_test(feats, part("fit"), part("test"), threshold=part("threshold"),
                         alphas=ALPHAS, delta=DELTA, n_boot=n_boot)
        eps = np.array([np.log(max(s["epistemic"], 1e-12)) for s, t in zip(scores, test, strict=True) if t])
        row: dict[str, Any] = {"parameter_set": set_id, "cost": cost.get(name, {}),
                               "dropped_features": [f for f in FEATURES if f not in feats]}
        row["epistemic"] = bootstrap_auroc(wrong_test, eps, n_boot=n_boot)
        if "error" in m:
            row["error"] = m["error"]
            out["sets"][name] = row
            continue
        risk = m["risk"]
        row["risk"] = (m["auroc"], *m["ci"])
        row["ece"] = m["ece"]
        row["guarantees"] = m.get("guarantees", [])
        if name == "all":
            ref = {"risk": risk, "eps": eps}
        row["risk_diff"] = paired_bootstrap_diff(wrong_test, risk, ref["risk"], n_boot=n_boot)
        row["epistemic_diff"] = paired_bootstrap_diff(wrong_test, eps, ref["eps"], n_boot=n_boot)
        row["cells"] = {}
        for d in datasets:
            sel = ds_test == d
            row["cells"][d] = {
                "n": int(sel.sum()),
                "risk": bootstrap_auroc(wrong_test[sel], risk[sel], n_boot=0)[0],
                "diff": paired_bootstrap_diff(wrong_test[sel], risk[sel], ref["risk"][sel], n_boot=n_boot),
            }
        if len(datasets) >= 3:
            by_ds: dict[str, tuple[list[Any], np.ndarray]] = {}
            for d in datasets:
                idx = [i for i, r in enumerate(recs) if r.dataset == d]
                by_ds[d] = ([scores[i] for i in idx], labels[idx])
            lodo = leave_one_dataset_out(by_ds, [Candidate("same-pass", feats)], ("log_epistemic",), n_boot=0)
            aucs = {d: lodo.rows[d]["same-pass"].get("auroc") for d in datasets}
            row["lodo"] = aucs
        out["sets"][name] = row
    return _page(out), out


def _f(x: float | None, nd: int = 3) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def _ci(t: tuple[Any, ...] | None, signed: bool = False) -> str:
    if not t or t[0] is None:
        return "–"
    fmt = "{:+.3f}" if signed else "{:.3f}"
    lo, hi = t[1], t[2]
    inner = f" [{fmt.format(lo)}, {fmt.format(hi)}]" if lo is not None else ""
    return fmt.format(t[0]) + inner


def _page(res: dict[str, Any]) -> list[str]:
    sets = res["sets"]
    toks = sorted({t for r in sets.values() for t in r.get("cost", {})})
    lines = [
        f"## {res['model']}",
        "",
        f"{res['n']} answers valid for every feature, {res['n_test']} on the pooled test split; "
        f"{res['n_blocks']} blocks. Risk = one `same-pass` calibrator fitted on the pooled fit split "
        "of each parameter set's scores. Differences are paired bootstraps against all parameters "
        "on the same test items.",
        "",
        "| parameters | log_epistemic AUROC | vs all | risk AUROC | vs all | ECE |"
        + "".join(f" cost @ {t:,} tokens |" for t in toks),
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(toks),
    ]
    dropped = {n: r["dropped_features"] for n, r in sets.items() if r.get("dropped_features")}
    for name, r in sets.items():
        if "error" in r:
            lines.append(f"| {name} | {_ci(r['epistemic'])} | – | {r['error']} | – | – |" + " – |" * len(toks))
            continue
        lines.append(
            f"| {name} | {_ci(r['epistemic'])} | {_ci(r['epistemic_diff'], True)} | {_ci(r['risk'])} | "
            f"{_ci(r['risk_diff'], True)} | {_f(r['ece'])} |"
            + "".join(f" {r['cost'][t]:.2f}× |" if t in r["cost"] else " – |" for t in toks)
        )
    singles = sorted(res["singles"].items(), key=lambda kv: -(kv[1][0] or 0))
    lines += ["", f"Every single signal of the all-parameter pass on the same {res['n_test']} test items "
              "(each oriented by its prior direction; bootstrap 95% intervals): "
              + "; ".join(f"{f} {_ci(v)}" for f, v in singles) + "."]
    for n, d in dropped.items():
        lines += ["", f"`{n}` has no block in its profile, so its risk is fitted without {', '.join(d)}."]
    datasets = list(next(iter(sets.values())).get("cells", {}))
    lines += ["", "Per dataset (the pooled calibrator's risk on each dataset's test items; "
              "paired difference against all parameters):", "",
              "| parameters | " + " | ".join(f"{d} (n={sets['all']['cells'][d]['n']})" for d in datasets) + " |",
              "|---|" + "---:|" * len(datasets)]
    for name, r in sets.items():
        if "cells" not in r:
            continue
        lines.append(f"| {name} | " + " | ".join(
            f"{_f(r['cells'][d]['risk'], 2)} ({_ci(r['cells'][d]['diff'], True)})" for d in datasets) + " |")
    if any("lodo" in r for r in sets.values()):
        lines += ["", "Leave one dataset out (fit on the others, AUROC on the whole left-out one):", "",
                  "| parameters | mean | worst | " + " | ".join(datasets) + " |",
                  "|---|---:|---:|" + "---:|" * len(datasets)]
        for name, r in sets.items():
            if "lodo" not in r:
                continue
            vals = [v for v in r["lodo"].values() if v is not None]
            lines.append(f"| {name} | {_f(float(np.mean(vals)) if vals else None)} | {_f(min(vals) if vals else None)} | "
                         + " | ".join(_f(r["lodo"][d], 2) for d in datasets) + " |")
    lines += ["", "Coverage at the certified alphas on the pooled test split (δ = 0.1; coverage, error "
              "rate, held):", "", "| parameters | " + " | ".join(f"α = {a}" for a in ALPHAS) + " |",
              "|---|" + "---:|" * len(ALPHAS)]
    for name, r in sets.items():
        cells = []
        for g in r.get("guarantees", []):
            if g.get("threshold") is None:
                cells.append("not certified")
            else:
                cells.append(f"{g['coverage']:.0%}, {_f(g['error_rate'], 2)}, {'held' if g['held'] else 'FAILED'}")
        lines.append(f"| {name} | " + " | ".join(cells or ["–"] * len(ALPHAS)) + " |")
    lines.append("")
    return lines


def _figure(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        t = max((t for r in res["sets"].values() for t in r.get("cost", {})), default=None)
        for i, (name, r) in enumerate(res["sets"].items()):
            if "risk" not in r:
                continue
            x, (y, lo, hi) = (r["cost"].get(t, np.nan) if t else i), r["risk"]
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
            e = r["epistemic"][0]
            if e is not None:
                ax.plot([x], [e], "x", color="grey")
        ax.set_xlabel(f"scoring cost / one no-grad forward (teacher forcing, {t:,} tokens)" if t
                      else "parameter set (no cost measured for this model)")
        ax.set_ylabel("AUROC for wrong answers (o: calibrated risk; x: log_epistemic alone)")
        ax.set_title(f"{res['model']}: risk–cost frontier (pooled test, n={res['n_test']})")
        ax.axhline(0.5, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", action="append", required=True, metavar="MODEL=GLOB")
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--costs", action="append", metavar="MODEL=JSON",
                    help="benchmarks/long_context.py's figures for MODEL (default: SmolLM2's "
                         "docs/results/long_context.json, and long_context_costs_<model>.json beside it)")
    args = ap.parse_args(argv)
    logging.getLogger("guarduq").setLevel(logging.ERROR)  # "no threshold met" is in the tables
    cost_files = {"smollm2-135m-instruct": ROOT / "docs" / "results" / "long_context.json"}
    cost_files.update({m: Path(p) for m, _, p in (c.partition("=") for c in args.costs or [])})
    lines: list[str] = []
    results = []
    for spec in args.cache:
        model, _, pattern = spec.partition("=")
        records = [r for p in sorted(glob.glob(pattern)) for r in load_cache(Path(p))]
        if not records:
            print(f"no cached answers match {pattern}", file=sys.stderr)
            return 2
        path = cost_files.get(model, ROOT / "docs" / "results" / f"long_context_costs_{model}.json")
        page, res = analyse(model, records, args.n_boot, costs(path))
        lines += page
        results.append(res)
    args.out.mkdir(parents=True, exist_ok=True)
    _figure(results, args.out / "frontier.png")
    lines.append("![risk–cost frontier](frontier.png)")
    (args.out / "frontier.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    write_page(args.out / "frontier.md", "\n".join(lines), "The parameter frontier")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
