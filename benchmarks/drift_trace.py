"""Why fresh BoolQ windows read ``unseen`` (issue 35): is the shipped drift reference (the
calibrator's held-out ``evaluation_data``) what today's code gives for those items, and is it
like the *other* items of the same population?

* ``--score N``: rescores, with the real model, the first ``N`` (in a fixed hash order) of the
  dataset's stored test items and of its calibration items *outside* the test split (the fit and
  threshold items: the same ``--limit`` subset, the same code, but not in the reference), into
  ``runs/cache/drift-trace/``. Fresh items (beyond the subset) come from ``drift_score.py``'s cache.
* analysis (always): the stored and rescored values of the test items side by side, then the
  stored test items against every other item scored, per watched feature (scaled KS, medians)
  with a permutation p-value of the largest scaled KS.

    OMP_NUM_THREADS=1 python benchmarks/drift_trace.py --score 40
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drift_score import CAL_LIMIT, MODEL, cache_path  # noqa: E402

from guarduq.calibration.datasets import default_data_dir, load_dataset  # noqa: E402
from guarduq.calibration.drift_groups import scaled_ks  # noqa: E402
from guarduq.calibration.evaluation import ScoreCache, score_dataset  # noqa: E402
from guarduq.calibration.features import FEATURES as F  # noqa: E402
from guarduq.calibration.splits import hash_unit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARTIFACT = ROOT / "policies" / "calibrators" / f"{MODEL}.json"
TRACE_DIR = Path("runs/cache/drift-trace") / MODEL
FEATURES = ("log_epistemic", "aleatoric", "mean_logprob")
FILES = {"boolq": "boolq/dev.jsonl"}


def parts(name: str) -> tuple[list, list, object]:
    """(stored test items in file order, non-test calibration items in trace order, the whole file)."""
    path = default_data_dir() / FILES[name]
    full = load_dataset(name, path)
    cal = load_dataset(name, path, limit=CAL_LIMIT)
    test = [it for it in cal.items if it.split == "test"]
    rest = sorted((it for it in cal.items if it.split != "test"), key=lambda it: hash_unit(it.id, "diag"))
    return test, rest, full


def _values(rec: dict) -> list[float]:
    return [float(F[f](rec)) for f in FEATURES]


def max_scaled_ks(a: np.ndarray, b: np.ndarray) -> float:
    return max(scaled_ks(np.sort(a[:, j]), b[:, j]) for j in range(a.shape[1]))


def analyse(name: str, draws: int, seed: int = 0) -> dict:
    art = json.loads(ARTIFACT.read_text())
    ed = art["evaluation_data"]
    rows = [i for i, d in enumerate(ed["dataset"]) if d == name]
    stored = [{k: ed[k][i] for k in ed if isinstance(ed[k], list)} for i in rows]
    test, rest, full = parts(name)
    if len(test) != len(stored):
        raise SystemExit(f"{name}: {len(test)} test items today, {len(stored)} stored")
    at = {it.id: k for k, it in enumerate(test)}

    def usable(path: Path) -> list:
        return [r for r in ScoreCache(path, read_only=True).entries.values() if r.usable] if path.exists() else []

    again = usable(TRACE_DIR / f"{name}-test.jsonl")
    gaps = np.array([[abs(r.scores[k] - stored[at[r.id]][k]) for k in ("mean_logprob", "epistemic", "aleatoric")]
                     + [r.label != stored[at[r.id]]["label"]] for r in again]).reshape(len(again), 4)
    others = {"calibration, not test": usable(TRACE_DIR / f"{name}-rest.jsonl"), "fresh": usable(cache_path(full))}
    s = np.array([_values(r) for r in stored])
    out = {"dataset": name, "stored": len(stored), "rescored": len(again),
           "max_gap": dict(zip(("mean_logprob", "epistemic", "aleatoric", "labels"), gaps.max(0).tolist() if len(again) else [math.nan] * 4, strict=True)),
           "stored_median": dict(zip(FEATURES, np.median(s, 0).tolist(), strict=True)), "versus": {}}
    rng = np.random.default_rng(seed)
    for label, recs in [*others.items(), ("both", [r for v in others.values() for r in v])]:
        if not recs:
            continue
        o = np.array([_values(r.scores) for r in recs])
        d = max_scaled_ks(s, o)
        both = np.concatenate([s, o])
        null = [max_scaled_ks(*np.split(both[rng.permutation(len(both))], [len(s)])) for _ in range(draws)]
        out["versus"][label] = {"n": len(recs), "median": dict(zip(FEATURES, np.median(o, 0).tolist(), strict=True)),
                                "scaled_ks": {f: scaled_ks(np.sort(s[:, j]), o[:, j]) for j, f in enumerate(FEATURES)},
                                "max_scaled_ks": d, "p_permutation": (1 + sum(x >= d for x in null)) / (1 + draws)}
    rest, fresh = (np.array([_values(r.scores) for r in v]) for v in others.values())
    if len(rest) and len(fresh):  # are the two kinds of item not in the reference alike?
        out["fresh_vs_calibration"] = {"max_scaled_ks": max_scaled_ks(rest, fresh)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="boolq", choices=sorted(FILES))
    p.add_argument("--score", type=int, default=0, metavar="N", help="rescore N test and N non-test items first")
    p.add_argument("--draws", type=int, default=2000, help="permutations for the p-value")
    args = p.parse_args(argv)
    if args.score:
        from guarduq.guard import Guard

        test, rest, _ = parts(args.dataset)
        guard = Guard(MODEL)
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
        for k in range(10, args.score + 10, 10):  # alternating, so a stopped run has both
            for label, items in (("test", sorted(test, key=lambda it: hash_unit(it.id, "diag"))), ("rest", rest)):
                score_dataset(guard, items[:min(k, args.score)], TRACE_DIR / f"{args.dataset}-{label}.jsonl",
                              desc=f"{label}<={k}", progress=False)
    print(json.dumps(analyse(args.dataset, args.draws), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
