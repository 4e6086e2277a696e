"""What guarding a larger model costs on this CPU, and whether bf16 pays: ratios from one run.

    .venv/bin/python benchmarks/scale_cost.py --model qwen2.5-coder-1.5b-instruct \
        --cache 'scores/cache/qwen2.5-coder-1.5b-instruct/*.jsonl'

1. ``short``: greedy 32-token answers to N TriviaQA questions (``min_new_tokens`` = 32, so every
   mode makes the same tokens): unguarded ``model.generate``, ``Guard.generate`` over the last 2
   blocks (hidden states reused from generation) and over all parameters, interleaved, the
   fastest of ``--repeats`` kept per mode; the ratio is summed guarded / summed unguarded time.
2. ``batch``: ``score_batch`` at batch 4 against a loop of ``score`` on the same pairs, with the
   largest relative difference of epistemic and p̄ (the fast path's stated tolerance is 1e-4).
3. ``options``: multiple-choice option probabilities (the risk run's first pass on four of the
   seven sets) on the first ``--options-n`` items of each multiple-choice set, both ways,
   interleaved: the prompt once with every option continuing from its key/value cache
   (``batching.option_mean_probs``, what guarduq runs) against the prompt in every row
   (``padded_option_mean_probs``, the simple path); the ratio of summed seconds, the largest
   relative difference of an option's p̄, and how often the two choose the same option.
4. ``dtype``: the model's own cached answers (spread over the datasets the risk run's cache holds)
   teacher-forced in float32 and in bfloat16, each in a fresh process: seconds, peak resident
   memory (VmHWM), each score's relative error against float32, and the AUROC for wrong answers
   of each signal in both dtypes with a paired bootstrap interval of the difference.

The 4k-token prompt, scoring memory at 4k and the cost per parameter set come from
``benchmarks/long_context.py --model ...`` (``make scale-cost``). Writes
``docs/results/scale/cost_<model>.json``. Seconds depend on the machine and on what else runs;
the ratios within one run are the claim.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from overhead import _vm  # noqa: E402  (a /proc/self/status field in bytes)

DATA = Path(os.environ.get("GUARDUQ_DATA", ROOT.parent / "shared" / "data"))
# The seven QA sets as the Makefile's QA_SETS reads them (the risk run's cache keys their items).
QA_FILES = {"truthfulqa-mc": "truthfulqa/TruthfulQA.csv", "truthfulqa-gen": "truthfulqa/TruthfulQA.csv",
            "triviaqa": "triviaqa/triviaqa_dev_extra_2k.jsonl", "nq-open": "nq_open/NQ-open.dev.jsonl",
            "arc": "arc_easy/ARC-Easy-Test.jsonl", "commonsenseqa": "commonsense_qa/dev_rand_split.jsonl",
            "boolq": "boolq/dev.jsonl"}
MIN_PER_CLASS = 10  # answers of each kind before an AUROC is reported
SCORE_KEYS = ("epistemic", "aleatoric", "mean_token_prob", "mean_logprob", "min_token_prob", "mean_entropy")


def questions(n: int) -> list[str]:
    from guarduq.calibration.datasets import load_dataset

    ds = load_dataset("triviaqa", DATA / QA_FILES["triviaqa"], limit=n)
    return [it.prompt for it in ds.items]


def short_answers(first: Any, n: int, tokens: int, repeats: int) -> dict[str, Any]:
    """Unguarded vs guarded generation of ``tokens``-token answers, modes interleaved
    (``first``: a Guard over all parameters; the last-2-blocks Guard shares its model)."""
    import torch

    from guarduq import Guard, LoadedModel, layout

    spec = LoadedModel(first.model, first.tokenizer, first.info)
    guards = {"all": first, "last_n_blocks=2": Guard(spec, last_n_blocks=2)}
    gen = {"max_new_tokens": tokens, "min_new_tokens": tokens}
    first.generate("Hello", max_new_tokens=2)  # warm-up
    totals = {"unguarded": 0.0, **{k: 0.0 for k in guards}}
    for prompt in questions(n):
        ids = torch.tensor([layout.prompt_ids(first.tokenizer, prompt)])
        best: dict[str, float] = {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            with torch.no_grad():
                first.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     pad_token_id=first._pad_id, **gen)
            best["unguarded"] = min(best.get("unguarded", 1e9), time.perf_counter() - t0)
            for name, g in guards.items():
                t0 = time.perf_counter()
                g.generate(prompt, **gen)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
        for k, v in best.items():
            totals[k] += v
    return {"n": n, "tokens": tokens, "seconds": totals,
            "ratio": {k: totals[k] / totals["unguarded"] for k in guards}}


def batch_vs_loop(g: Any, pairs: list[tuple[str, str]], batch_size: int = 4) -> dict[str, Any]:
    g.score(*pairs[0])  # warm-up
    t0 = time.perf_counter()
    loop = [g.score(p, r) for p, r in pairs]
    loop_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = g.score_batch(pairs, batch_size=batch_size)
    batch_s = time.perf_counter() - t0
    rel = {k: max(abs(getattr(b, k) - getattr(a, k)) / max(abs(getattr(a, k)), 1e-30)
                  for a, b in zip(loop, batched, strict=True))
           for k in ("epistemic", "mean_token_prob")}
    return {"n": len(pairs), "batch_size": batch_size, "loop_s": loop_s, "batch_s": batch_s,
            "speedup": loop_s / batch_s, "max_rel_diff": rel}


def option_paths(g: Any, n: int) -> dict[str, Any]:
    """Shared-prefix against padded option probabilities on ``n`` items of each multiple-choice set."""
    from guarduq import batching, layout
    from guarduq.calibration.datasets import load_dataset

    out: dict[str, Any] = {}
    for name, file in QA_FILES.items():
        items = [it for it in load_dataset(name, DATA / file, limit=n).items if it.kind == "mc"]
        if not items:
            continue
        seconds, rel, same = {"shared": 0.0, "padded": 0.0}, 0.0, 0
        for item in items:
            stop = item.stop_strings[0] if item.stop_strings else ""
            prompt = layout.prompt_ids(g.tokenizer, item.prompt)
            rows = [layout.response_ids(g.tokenizer, o + stop, ended=not stop) for o in item.options]
            probs = {}
            for path, fn in (("shared", batching.option_mean_probs), ("padded", batching.padded_option_mean_probs)):
                t0 = time.perf_counter()
                probs[path] = fn(g.model, prompt, rows, g.tokenizer.pad_token_id or 0, g.model.device)
                seconds[path] += time.perf_counter() - t0
            rel = max(rel, *(abs(a - b) / b for a, b in zip(probs["shared"], probs["padded"], strict=True)))
            same += int(np.argmax(probs["shared"]) == np.argmax(probs["padded"]))
        out[name] = {"n": len(items), "seconds": seconds, "speedup": seconds["padded"] / seconds["shared"],
                     "max_rel_diff": rel, "same_choice": same}
    return out


def cached_answers(cache_glob: str, n: int) -> list[dict[str, Any]]:
    """Up to ``n`` of the model's own scored answers, spread evenly over the cached datasets, with
    their prompts and labels (the response as scored: the generated answer or the chosen option)."""
    from guarduq.calibration.datasets import load_dataset

    recs: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.expanduser(cache_glob))):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("dataset") in QA_FILES and r.get("label") is not None and r.get("response"):
                    recs.setdefault(r["id"], r)
    names = sorted({r["dataset"] for r in recs.values()})
    out: list[dict[str, Any]] = []
    for name in names:
        items = {it.id: it for it in load_dataset(name, DATA / QA_FILES[name]).items}
        mine = [r for r in recs.values() if r["dataset"] == name and r["id"] in items
                and items[r["id"]].prompt_hash == r["prompt_hash"]]  # the very prompt that was scored
        out += [{"prompt": items[r["id"]].prompt, "response": r["response"], "ended": bool(r.get("ended")),
                 "label": r["label"], "dataset": name} for r in mine[: max(1, n // len(names))]]
    return out[:n]


def dtype_child(model: str, dtype: str, items_file: Path) -> dict[str, Any]:
    """In a fresh process: teacher-force every answer in ``dtype``; scores, seconds, peak RSS."""
    import torch

    from guarduq import Guard

    torch.set_num_threads(1)
    items = json.loads(items_file.read_text())
    g = Guard(model, parameters="all", dtype=dtype)
    kernel = linear_kernel(getattr(torch, dtype), int(g.model.config.hidden_size))
    g.score("What is 2 + 2?", "4")  # warm-up (a short pair: a cached answer costs minutes in emulated bf16)
    base = _vm("VmRSS")
    t0 = time.perf_counter()
    scores = [g.score(it["prompt"], it["response"], ended=it["ended"]) for it in items]
    return {"dtype": dtype, "seconds": time.perf_counter() - t0, "peak": _vm("VmHWM"), "loaded": base, "kernel": kernel,
            "scores": [{k: getattr(s, k) for k in SCORE_KEYS} | {"valid": s.valid} for s in scores]}


def dtype_check(model: str, items: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    from guarduq.calibration.analysis import bootstrap_auroc, paired_bootstrap_diff
    from guarduq.calibration.features import ORIENTATION

    items_file = out_dir / f".dtype-items-{os.getpid()}.json"
    items_file.write_text(json.dumps(items))
    runs = {}
    try:
        for dtype in ("float32", "bfloat16"):
            cmd = [sys.executable, __file__, "--model", model, "--dtype-child", dtype, "--items", str(items_file)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            runs[dtype] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        items_file.unlink(missing_ok=True)
    wrong = np.array([1 - it["label"] for it in items])
    f32, bf16 = runs["float32"]["scores"], runs["bfloat16"]["scores"]
    res: dict[str, Any] = {"n": len(items), "n_wrong": int(wrong.sum()),
                           **{d: {k: runs[d][k] for k in ("seconds", "peak", "loaded", "kernel")} for d in runs},
                           "bf16_over_fp32": {
                               "seconds": runs["bfloat16"]["seconds"] / runs["float32"]["seconds"],
                               **{f"linear_{k}": runs["bfloat16"]["kernel"][k] / runs["float32"]["kernel"][k]
                                  for k in ("forward_s", "backward_s")}},
                           "signals": {}}
    # An AUROC (and its paired difference) needs both kinds of answer in numbers, else it is noise.
    ranked = min(int(wrong.sum()), int(len(wrong) - wrong.sum())) >= MIN_PER_CLASS
    for k in SCORE_KEYS:
        a = np.array([s[k] for s in f32], dtype=float)
        b = np.array([s[k] for s in bf16], dtype=float)
        sign = float(ORIENTATION.get(k, 1))  # higher = more likely wrong
        rel = np.abs(b - a) / np.maximum(np.abs(a), 1e-30)
        res["signals"][k] = {"median_rel_err": float(np.median(rel)), "max_rel_err": float(rel.max())}
        if ranked:
            res["signals"][k] |= {"auroc_fp32": bootstrap_auroc(wrong, sign * a),  # (AUROC, 2.5%, 97.5%)
                                  "auroc_bf16": bootstrap_auroc(wrong, sign * b),
                                  "bf16_minus_fp32": paired_bootstrap_diff(wrong, sign * b, sign * a)}
    return res


def linear_kernel(dtype: Any, width: int, rows: int = 128, repeats: int = 3) -> dict[str, float]:
    """One linear layer of the model's width (``width`` -> 4 ``width``), forward and backward in
    ``dtype``, fastest of ``repeats``: whether this torch build has a fast GEMM for the dtype on
    this CPU at all, which decides bf16 before any model-level number does."""
    import torch

    x0, w0 = torch.randn(rows, width, dtype=dtype), torch.randn(4 * width, width, dtype=dtype)
    fwd = bwd = float("inf")
    for _ in range(repeats):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        t0 = time.perf_counter()
        y = torch.nn.functional.linear(x, w)
        t1 = time.perf_counter()
        y.float().sum().backward()
        fwd, bwd = min(fwd, t1 - t0), min(bwd, time.perf_counter() - t1)
    return {"rows": rows, "width": width, "forward_s": fwd, "backward_s": bwd}


def write_json(path: Path, res: dict[str, Any]) -> None:
    """Atomically (the library's ``write_atomic``): an interrupted run leaves the last complete file."""
    from guarduq._storage import write_atomic

    write_atomic(path, (json.dumps(res, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--cache", help="glob of the model's scoring caches (for the dtype check)")
    ap.add_argument("--n", type=int, default=6, help="questions for the short-answer timing")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-n", type=int, default=8)
    ap.add_argument("--options-n", type=int, default=8, help="items of each multiple-choice set")
    ap.add_argument("--dtype-n", type=int, default=64, help="cached answers for the dtype check")
    ap.add_argument("--skip", nargs="*", default=(), choices=("short", "batch", "options", "dtype"))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "scale")
    ap.add_argument("--dtype-child", help=argparse.SUPPRESS)
    ap.add_argument("--items", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dtype_child:
        print(json.dumps(dtype_child(args.model, args.dtype_child, args.items)))
        return 0
    import torch

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cost_{args.model}.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    from guarduq.models import native_bf16  # bf16 pays only where the CPU has it (AVX512-BF16, AMX)

    res |= {"model": args.model, "threads": 1, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16()}
    if {"short", "batch", "options"} - set(args.skip):
        from guarduq import Guard

        guard = Guard(args.model, parameters="all")  # one model for both measurements
        if "short" not in args.skip:
            res["short"] = short_answers(guard, args.n, args.tokens, args.repeats)
            write_json(path, res)
        if "batch" not in args.skip:
            pairs = [(q, "I think the answer is probably this one.") for q in questions(args.batch_n)]
            res["batch"] = batch_vs_loop(guard, pairs)
            write_json(path, res)
        if "options" not in args.skip:
            res["options"] = option_paths(guard, args.options_n)
            write_json(path, res)
        del guard
    if "dtype" not in args.skip:
        if not args.cache:
            ap.error("the dtype check reads the model's cached answers: give --cache GLOB (or --skip dtype)")
        items = cached_answers(args.cache, args.dtype_n)
        res["dtype"] = dtype_check(args.model, items, args.out)
        write_json(path, res)
    print(json.dumps({k: v for k, v in res.items() if k != "dtype"} | {"dtype": {
        k: v for k, v in res.get("dtype", {}).items() if k != "signals"}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
