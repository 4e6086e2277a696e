"""How far the scale caches are: answers per model and dataset against the target, and the
core-hours the rest should take at each set's own median seconds per answer so far.

    python benchmarks/scale_status.py --target 504 \
        --cache 'qwen2.5-coder-1.5b-instruct=scores/cache/qwen2.5-coder-1.5b-instruct/*.jsonl'

Reads the caches only (no model); ``make scale-status`` runs it on every scale model. The
estimate is as good as the seconds the records hold: batches scored while other work ran on the
same cores make it an upper bound.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from risk import load_cache  # noqa: E402


def status(records: list[Any], target: int, datasets: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per dataset (those with records, and every one of ``datasets``): answers so far, still to
    score (to ``target``), median seconds an answer and the core-hours the rest takes at that
    rate (None without any timed record)."""
    by_ds: dict[str, list[Any]] = {d: [] for d in datasets}
    for r in records:
        by_ds.setdefault(r.dataset, []).append(r)
    out = {}
    for ds, rs in sorted(by_ds.items()):
        secs = [float(r.seconds) for r in rs if getattr(r, "seconds", None)]
        median = statistics.median(secs) if secs else None
        left = max(target - len(rs), 0)
        out[ds] = {"n": len(rs), "left": left, "seconds": median,
                   "hours": left * median / 3600 if median is not None else None}
    return out


def render(model: str, rows: dict[str, dict[str, Any]], target: int) -> str:
    lines = [f"{model} (target {target} a set)", f"  {'dataset':<16}{'answers':>8}{'left':>6}{'s/answer':>10}{'core-h':>8}"]
    for ds, r in rows.items():
        s = f"{r['seconds']:.1f}" if r["seconds"] is not None else "–"
        h = f"{r['hours']:.1f}" if r["hours"] is not None else "–"
        lines.append(f"  {ds:<16}{r['n']:>8}{r['left']:>6}{s:>10}{h:>8}")
    total = sum(r["hours"] or 0.0 for r in rows.values())
    unknown = [ds for ds, r in rows.items() if r["left"] and r["hours"] is None]
    lines.append(f"  {'total':<16}{sum(r['n'] for r in rows.values()):>8}"
                 f"{sum(r['left'] for r in rows.values()):>6}{'':>10}{total:>8.1f}"
                 + (f"  + {', '.join(unknown)} (no rate yet)" if unknown else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", action="append", required=True, metavar="MODEL=GLOB")
    ap.add_argument("--target", type=int, default=504, help="answers wanted per dataset")
    ap.add_argument("--datasets", default="", help="comma list of datasets every model should have")
    args = ap.parse_args(argv)
    for spec in args.cache:
        model, _, pattern = spec.partition("=")
        records = [r for p in sorted(glob.glob(pattern)) for r in load_cache(Path(p))]
        wanted = [d for d in args.datasets.split(",") if d]
        print(render(model, status(records, args.target, wanted), args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
