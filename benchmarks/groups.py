"""Certificates per kind of traffic on a two-group simulation: ARC-Easy plus TruthfulQA-MC.

Traffic is the shipped SmolLM2 calibrator's held-out answers of two of its datasets (its
``evaluation_data``: label, dataset and the pooled calibrator's risk per answer; no model is
loaded). ARC-Easy is a group the pooled α = 0.7 certificate holds on; TruthfulQA-MC one it fails
on (76% wrong among the answers the shipped threshold lets through).

A simulation: each group's held-out answers are its population. Each of ``--runs`` labellings
draws ``--labels`` answers per group (with replacement) as the uniform sample a certificate
rests on, and as many to place the test's start (the fit split's role). The pooled certificate
is computed on both groups' labels together, a group certificate on each group's alone
(:func:`guarduq.calibration.groups.certify_groups`: the same fixed-sequence test, its start
learned per group); a group cut to ``--small`` labels shows the fallback. Each threshold is then
checked against the whole population: coverage, the true error rate among accepted answers, and
how often it exceeds α (a failed guarantee; δ = 0.1 allows up to 10% of runs).

    python benchmarks/groups.py            # writes docs/results/groups.md
    python benchmarks/groups.py --quick    # 50 runs, prints only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pages import write_page  # noqa: E402

from guarduq.calibration.groups import accepted_error, certify_groups, group_starts  # noqa: E402
from guarduq.calibration.thresholds import select_threshold, start_threshold  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARTIFACT = ROOT / "policies" / "calibrators" / "smollm2-135m-instruct.json"
GROUPS = ("arc", "truthfulqa-mc")
ALPHA, DELTA = 0.7, 0.1


def load(path: Path = ARTIFACT) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Group -> (risk, wrong) of the artifact's held-out answers."""
    ed = json.loads(path.read_text())["evaluation_data"]
    ds, risk, label = np.asarray(ed["dataset"]), np.asarray(ed["risk"], float), np.asarray(ed["label"], int)
    return {g: (risk[ds == g], 1 - label[ds == g]) for g in GROUPS}


def one_split(data: dict[str, tuple[np.ndarray, np.ndarray]], rng: np.random.Generator, labels: int,
              small: int) -> dict[str, Any]:
    """One simulated labelling: per group, ``labels`` answers drawn from its population to learn a
    test's start on (the fit split's role) and ``labels`` more as the uniform sample a certificate
    rests on; each threshold is then checked on the whole population (its true error rate)."""
    draws: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for g, (r, w) in data.items():
        draws[g] = [(r[i], w[i]) for i in (rng.integers(0, r.size, labels) for _ in range(2))]

    def joined(k: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
        return (np.concatenate([draws[g][k][0] for g in GROUPS]), np.concatenate([draws[g][k][1] for g in GROUPS]),
                [g for g in GROUPS for _ in range(labels)])

    (fr, fw, fg), (cr, cw, cg) = joined(0), joined(1)
    pooled = select_threshold(cr, cw, ALPHA, DELTA, start=start_threshold(fr, fw, ALPHA, DELTA)).threshold
    starts = group_starts(fr, fw, fg, [ALPHA], DELTA)
    table = certify_groups(cr, cw, cg, [ALPHA], DELTA, starts)
    out: dict[str, Any] = {"pooled": pooled}
    for g in GROUPS:
        own = table[g][0].threshold
        r, w = draws[g][1]
        few = select_threshold(r[:small], w[:small], ALPHA, DELTA, start=starts[(g, ALPHA)]).threshold
        out[g] = {"own": own, "few": few, "pooled_check": accepted_error(*data[g], pooled),
                  "own_check": accepted_error(*data[g], own)}
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(checks: list[dict[str, Any]]) -> dict[str, Any]:
        errs = [c["error_rate"] for c in checks if c["error_rate"] is not None]
        return {"coverage": float(np.mean([c["coverage"] for c in checks])),
                "error": float(np.mean(errs)) if errs else None,
                "fails": sum(e > ALPHA for e in errs) / len(checks),
                "answered_runs": len(errs)}

    out: dict[str, Any] = {"runs": len(runs), "pooled_certified": sum(r["pooled"] is not None for r in runs)}
    for g in GROUPS:
        out[g] = {"pooled": stats([r[g]["pooled_check"] for r in runs]),
                  "group": stats([r[g]["own_check"] for r in runs]),
                  "certified": sum(r[g]["own"] is not None for r in runs) / len(runs),
                  "few_certified": sum(r[g]["few"] is not None for r in runs) / len(runs),
                  "threshold_median": _median([r[g]["own"] for r in runs])}
    out["pooled_threshold_median"] = _median([r["pooled"] for r in runs])
    return out


def _median(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return float(np.median(v)) if v else None


def shipped(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """The shipped certificate (certified on the seven-dataset mix) on each group's held-out answers."""
    from guarduq.calibration.calibrator import Calibrator

    t = Calibrator.load(ARTIFACT).threshold_for(ALPHA)
    return {"threshold": t, **{g: accepted_error(*data[g], t) for g in GROUPS}}


def page(s: dict[str, Any], ship: dict[str, Any], data: dict[str, Any], labels: int, small: int, seed: int) -> str:
    n = {g: data[g][0].size for g in GROUPS}
    lines = [
        f"Traffic: the shipped `{ARTIFACT.name}` held-out answers of ARC-Easy ({n['arc']}) and "
        f"TruthfulQA-MC ({n['truthfulqa-mc']}), risk from the pooled calibrator; α = {ALPHA}, δ = {DELTA}; "
        f"{s['runs']} simulated labellings (seed {seed}): each group's held-out answers are its "
        f"population; {labels} labels per group drawn from it (with replacement) certify, {labels} more "
        "place the test's start, and each threshold is checked against the whole population (its true "
        "error rate among accepted answers).",
        "",
        f"The shipped pooled certificate (risk ≤ {ship['threshold']:.3f}, certified on the seven-dataset mix), "
        "on each group's held-out answers:",
        "",
        "| group | n | coverage | wrong among accepted | guarantee |",
        "|---|---|---|---|---|",
    ]
    for g in GROUPS:
        c = ship[g]
        lines.append(f"| {g} | {c['n']} | {c['coverage']:.2f} | {c['error_rate']:.2f} | "
                     f"{'held' if c['error_rate'] <= ALPHA else 'FAILED'} |")
    lines += ["", "Pooled (both groups' labels together) against group certificates (each group's labels "
              "alone), checked on each group's population:", "",
              "| group | certificate | certified in | median threshold | coverage | wrong among accepted "
              "(mean over runs that answer) | runs where it exceeds α |",
              "|---|---|---|---|---|---|---|"]
    for g in GROUPS:
        for kind in ("pooled", "group"):
            st = s[g][kind]
            where = s["pooled_certified"] / s["runs"] if kind == "pooled" else s[g]["certified"]
            thr = s["pooled_threshold_median"] if kind == "pooled" else s[g]["threshold_median"]
            err = f"{st['error']:.3f}" if st["error"] is not None else "n/a (nothing accepted)"
            lines.append(f"| {g} | {kind} | {where:.0%} | {thr if thr is None else f'{thr:.3f}'} | "
                         f"{st['coverage']:.2f} | {err} | {st['fails']:.0%} |")
    lines += ["", f"With only {small} labels of a group, its own certificate is possible in "
              + ", ".join(f"{g} {s[g]['few_certified']:.0%}" for g in GROUPS)
              + " of runs; elsewhere the group falls back (the pooled threshold or `escalate`, "
              "as the policy's `groups.fallback` says).", "",
              "Regenerate: `python benchmarks/groups.py`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=500)
    p.add_argument("--labels", type=int, default=600, help="uniform labels per group (and as many for the start)")
    p.add_argument("--small", type=int, default=40, help="labels of a group too small to certify")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="50 runs, print only")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "groups.md")
    args = p.parse_args(argv)
    data = load()
    rng = np.random.default_rng(args.seed)
    runs = [one_split(data, rng, args.labels, args.small) for _ in range(50 if args.quick else args.runs)]
    s, ship = summarize(runs), shipped(data)
    body = page(s, ship, data, args.labels, args.small, args.seed)
    print(body)
    if not args.quick:
        write_page(args.out, body, "Certificates per kind of traffic (two-group simulation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
