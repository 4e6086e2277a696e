"""Score FRESH items for the drift evidence (``benchmarks/drift.py``): items the shipped
calibrator never saw, with the real model, into resumable caches under ``scores/cache/drift/``.

* in-mix: items of the calibration files *outside* the subset ``--limit 1000`` picked (the 1000
  smallest ``hash_unit(id, "limit")``; see ``Dataset._load``), the next ones in that same order,
  so a larger ``--per-dataset`` extends a smaller one;
* left out: SST-2 dev as a two-option question (``sst2`` loader), a task outside the mix.

Datasets are scored round-robin in steps of ``--step`` items, so a run stopped at any point has
a balanced sample of every dataset. Run one process per lane (``--lane 0 --lanes 2``) with
``OMP_NUM_THREADS=1`` to use two cores.

    OMP_NUM_THREADS=1 python benchmarks/drift_score.py --lane 0 --lanes 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from guarduq.calibration.datasets import Dataset, Item, default_data_dir, load_dataset
from guarduq.calibration.splits import hash_unit

MODEL = "smollm2-135m-instruct"
CAL_LIMIT = 1000  # the Makefile's CAL_LIMIT for the five files with more items than that
CACHE_DIR = Path(__file__).resolve().parent.parent / "scores" / "cache" / "drift" / MODEL
# (loader, file under the data dir, items to score): BoolQ's passages make it ~3x slower.
# The committed run (docs/results/drift.md): 1,721 answers, ~30 min on 2 cores (two lanes).
PLAN: list[tuple[str, str, int]] = [
    ("sst2", "sst2/dev.tsv", 600),
    ("triviaqa", "triviaqa/triviaqa_dev_extra_2k.jsonl", 250),
    ("arc", "arc_easy/ARC-Easy-Test.jsonl", 250),
    ("nq-open", "nq_open/NQ-open.dev.jsonl", 250),
    ("commonsenseqa", "commonsense_qa/dev_rand_split.jsonl", 221),  # every item beyond the 1,000
    ("boolq", "boolq/dev.jsonl", 150),
]
IN_MIX = {"triviaqa", "arc", "nq-open", "commonsenseqa", "boolq"}


def fresh_items(ds: Dataset, n: int) -> list[Item]:
    """The first ``n`` items after the calibration subset, in the ``--limit`` hash order (why:
    the calibrator's fit/threshold/test items are exactly the first ``CAL_LIMIT``)."""
    order = sorted(ds.items, key=lambda it: hash_unit(it.id, "limit"))
    skip = CAL_LIMIT if ds.name in IN_MIX else 0
    return order[skip: skip + n]


def cache_path(ds: Dataset) -> Path:
    return CACHE_DIR / f"{ds.name}-{ds.sha256[:12]}-{ds.prompt_style}.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lane", type=int, default=0)
    p.add_argument("--lanes", type=int, default=1)
    p.add_argument("--step", type=int, default=25)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every dataset's item count")
    p.add_argument("--n", action="append", default=[], metavar="DATASET=N",
                   help="items of one dataset (repeatable; overrides the plan and --scale)")
    args = p.parse_args(argv)
    counts = dict(x.split("=", 1) for x in args.n)
    from guarduq.calibration.evaluation import score_dataset
    from guarduq.guard import Guard

    data = default_data_dir()
    plan = [x for i, x in enumerate(PLAN) if i % args.lanes == args.lane]
    sets = [(load_dataset(name, data / rel), int(counts.get(name, n * args.scale))) for name, rel, n in plan]
    guard = Guard(MODEL)
    print(f"lane {args.lane}: {[(d.name, n) for d, n in sets]} fingerprint={guard.info.fingerprint}",
          file=sys.stderr, flush=True)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    top = max(n for _, n in sets)
    for k in range(args.step, top + args.step, args.step):
        for ds, n in sets:
            if k - args.step >= n:
                continue
            score_dataset(guard, fresh_items(ds, min(k, n)), cache_path(ds), desc=f"{ds.name}<={min(k, n)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
