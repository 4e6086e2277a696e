"""What bfloat16 does to the calibrated risk, not only to the raw scores.

    .venv/bin/python benchmarks/bf16_risk.py --model qwen2.5-coder-1.5b-instruct \
        --cache 'scores/cache/qwen2.5-coder-1.5b-instruct/*.jsonl' --n 320

A user who serves a model in bf16 (1.4x faster here, on a CPU with AVX512-BF16) keeps the
calibrator fitted on its float32 scores. So: the ``same-pass`` calibrator is fitted on the float32
cache's fit split (and certified on its threshold split), as ``make scale`` fits it; up to ``--n``
answers of the test split, spread evenly over the datasets, are teacher-forced again in bf16 over
all parameters; and the one calibrator ranks both versions of the same answers. Reported: the
risk's AUROC for wrong answers in each dtype with the paired bootstrap interval of bf16 - fp32,
the same for each single signal, each score's relative error, and how many answers change side
at each certified threshold (the decision a policy would take).

The float32 side is the cache's own scores (batched at the risk run's batch size: relative
differences to the one-at-a-time path below 1e-4, far below bf16's ~1%), so only bf16 is computed.
Resumes: each bf16 score is appended to ``--work/<model>.bf16.jsonl`` as it is made, so an
interrupted run goes on where it stopped. Writes ``--out/bf16_risk_<model>.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from risk import group_of, load_cache, parts  # noqa: E402
from scale_cost import DATA, QA_FILES  # noqa: E402

from guarduq.calibration.analysis import bootstrap_auroc, paired_bootstrap_diff, single_signals  # noqa: E402
from guarduq.calibration.calibrator import Calibrator  # noqa: E402
from guarduq.calibration.features import FEATURE_SETS  # noqa: E402
from guarduq.calibration.splits import hash_unit, split_of  # noqa: E402

FEATURES = FEATURE_SETS["same-pass"]  # the shipped calibrators' set
SIGNALS = ("log_epistemic", "log_epistemic_norm", "aleatoric", "mean_logprob", "log_min_token_prob",
           "mean_entropy")
RAW = ("epistemic", "mean_token_prob", "mean_logprob", "min_token_prob", "mean_entropy")
ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7)
DELTA = 0.1


def chosen_test(records: Sequence[Any], n: int) -> list[Any]:
    """Up to ``n`` test-split records, the same share from each dataset (hash order, so a larger
    ``n`` extends a smaller one's choice and a resumed run picks the same answers)."""
    by_ds: dict[str, list[Any]] = defaultdict(list)
    for r in sorted(records, key=lambda r: hash_unit(r.id, "bf16-risk")):
        if split_of(group_of(r.id)) == "test":
            by_ds[r.dataset].append(r)
    out: list[Any] = []
    while len(out) < n and any(by_ds.values()):
        for d in sorted(by_ds):
            if by_ds[d] and len(out) < n:
                out.append(by_ds[d].pop(0))
    return out


def compare(cal: Calibrator, fp32: Sequence[Mapping[str, Any]], bf16: Sequence[Mapping[str, Any]],
            correct: np.ndarray, n_boot: int = 2000) -> dict[str, Any]:
    """One calibrator on the same answers scored in both dtypes: AUROCs, paired differences,
    relative errors, and the answers that change side at each certified threshold."""
    wrong = 1 - np.asarray(correct, int)
    r32, r16 = cal.predict_risk(list(fp32)), cal.predict_risk(list(bf16))
    out: dict[str, Any] = {
        "n": int(wrong.size), "n_wrong": int(wrong.sum()),
        "risk": {"fp32": bootstrap_auroc(wrong, r32, n_boot=n_boot), "bf16": bootstrap_auroc(wrong, r16, n_boot=n_boot),
                 "bf16_minus_fp32": paired_bootstrap_diff(wrong, r16, r32, n_boot=n_boot),
                 "abs_diff_median": float(np.median(np.abs(r16 - r32))),
                 "abs_diff_max": float(np.max(np.abs(r16 - r32)))},
        "signals": {}, "rel_err": {}, "flips": [],
    }
    s32, s16 = single_signals(fp32, SIGNALS), single_signals(bf16, SIGNALS)
    for k in SIGNALS:
        out["signals"][k] = {"fp32": bootstrap_auroc(wrong, s32[k], n_boot=n_boot),
                             "bf16": bootstrap_auroc(wrong, s16[k], n_boot=n_boot),
                             "bf16_minus_fp32": paired_bootstrap_diff(wrong, s16[k], s32[k], n_boot=n_boot)}
    for k in RAW:
        a = np.array([s[k] for s in fp32], float)
        b = np.array([s[k] for s in bf16], float)
        rel = np.abs(b - a) / np.maximum(np.abs(a), 1e-30)
        out["rel_err"][k] = {"median": float(np.median(rel)), "max": float(rel.max())}
    for t in cal.thresholds_:
        if t.threshold is not None:
            a, b = r32 <= t.threshold, r16 <= t.threshold
            out["flips"].append({"alpha": t.alpha, "threshold": t.threshold, "answered_fp32": int(a.sum()),
                                 "answered_bf16": int(b.sum()), "changed_side": int((a != b).sum())})
    return out


def bf16_scores(model: str, todo: Sequence[Any], work: Path, threads: int) -> None:
    """Teacher-force each record's answer in bf16 over all parameters; append each score to ``work``."""
    import torch
    from tqdm.auto import tqdm

    from guarduq import Guard
    from guarduq._storage import append_line
    from guarduq.calibration.datasets import load_dataset

    torch.set_num_threads(threads)
    prompts: dict[str, Any] = {}
    for name in sorted({r.dataset for r in todo}):
        prompts |= {it.id: it for it in load_dataset(name, DATA / QA_FILES[name]).items}
    g = Guard(model, parameters="all", dtype="bfloat16")
    for r in tqdm(todo, desc="bf16 scores", file=sys.stderr):
        item = prompts.get(r.id)
        if item is None or item.prompt_hash != r.prompt_hash:  # not the very prompt the cache scored
            raise SystemExit(f"{r.id}: the dataset's prompt is not the one the cache scored")
        t0 = time.perf_counter()
        s = g.score(item.prompt, r.response, ended=bool(r.ended))
        row = {"id": r.id, "seconds": time.perf_counter() - t0,
               "scores": s.to_dict(with_token_probs=False)}
        append_line(work, (json.dumps(row) + "\n").encode(), "bf16 scores")


def read_done(work: Path) -> dict[str, dict[str, Any]]:
    """Scores already made (the last of each id; a torn last line from a killed run is skipped)."""
    done: dict[str, dict[str, Any]] = {}
    if work.exists():
        for line in work.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[row["id"]] = row
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", required=True, help="glob of the model's float32 scoring caches")
    ap.add_argument("--n", type=int, default=320, help="test answers to re-score in bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=ROOT / "scores" / "bf16")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "scale")
    args = ap.parse_args(argv)
    records = [r for p in sorted(glob.glob(os.path.expanduser(args.cache))) for r in load_cache(Path(p))]
    records = [r for r in records if r.dataset in QA_FILES]
    split = parts(records)
    cal = Calibrator(FEATURES)
    cal.fit(*split["fit"])
    cal.fit_thresholds(*split["threshold"], alphas=ALPHAS, delta=DELTA)
    chosen = chosen_test(records, args.n)
    work = args.work / f"{args.model}.bf16.jsonl"
    done = read_done(work)
    todo = [r for r in chosen if r.id not in done]
    if todo:
        bf16_scores(args.model, todo, work, args.threads)
        done = read_done(work)
    res = compare(cal, [r.scores for r in chosen], [done[r.id]["scores"] for r in chosen],
                  np.array([int(r.label) for r in chosen]))
    res |= {"model": args.model, "n_fit": int(len(split["fit"][1])), "features": list(FEATURES),
            "datasets": {d: sum(r.dataset == d for r in chosen) for d in sorted({r.dataset for r in chosen})},
            "bf16_seconds_median": float(np.median([done[r.id]["seconds"] for r in chosen]))}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bf16_risk_{args.model}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("n", "n_wrong", "risk", "flips")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
