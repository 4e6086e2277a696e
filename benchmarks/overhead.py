"""Overhead of guarduq's scoring on the default model, as ratios measured in one run.

    .venv/bin/python benchmarks/overhead.py [--n 5] [--tokens 32]

1. time: scoring (one forward + one backward) / greedy generation of ~32-token answers;
2. memory: peak RSS added while scoring, lean (per-parameter hooks, gradients freed at once) vs
   naive (``torch.autograd.grad`` over all parameters), each in a fresh subprocess, as a
   fraction of the model's fp32 size;
3. load: cached safetensors load / cold GGUF dequantization, in a throw-away cache folder
   (library imports excluded: they cost the same on both paths).

Absolute seconds depend on the machine (and on anything else running); the ratios are the claim.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = (
    "Explain why the sky is blue.",
    "Describe how a bicycle works.",
    "What should I pack for a weekend hiking trip?",
    "Tell me about the history of Rome.",
    "How do vaccines train the immune system?",
    "Why do cats purr?",
)


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(mode: str) -> None:
    """Run in a subprocess: print the peak RSS increase of one scoring pass."""
    import torch

    from guarduq import Guard, layout

    guard = Guard("smollm2-135m-instruct")
    enc = layout.encode(guard.tokenizer, guard.model, PROMPTS[0], "word " * 31)
    with torch.no_grad():  # warm the allocator and kernels with a forward pass
        guard.model(input_ids=enc.input_ids)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    base = _vm("VmRSS")
    if mode == "lean":
        guard.scorer.score(enc.input_ids, enc.response_start)
    else:
        params = [p for _, p in guard.model.named_parameters()]
        logits = guard.model(input_ids=enc.input_ids).logits[0, enc.response_start - 1 : -1]
        probs = torch.softmax(logits.float(), -1).gather(-1, enc.input_ids[0, enc.response_start :, None])
        grads = torch.autograd.grad(probs.mean(), params)
        _ = sum(float((g.double() ** 2).sum()) for g in grads)
    peak = _vm("VmHWM")
    model_bytes = sum(p.numel() * 4 for p in guard.model.parameters())
    print(json.dumps({"mode": mode, "added": peak - base, "model_fp32": model_bytes}))


def timing(n: int, tokens: int) -> dict[str, float]:
    from guarduq import Guard

    guard = Guard("smollm2-135m-instruct")
    guard.generate(PROMPTS[0], max_new_tokens=4)  # warm-up
    gen, score, lengths = [], [], []
    for prompt in PROMPTS[:n]:
        r = guard.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens)
        gen.append(r.timings["generate_s"])
        score.append(r.timings["score_s"])
        lengths.append(r.scores.n_tokens)
    return {
        "n": n,
        "mean_tokens": statistics.mean(lengths),
        "generate_s": statistics.median(gen),
        "score_s": statistics.median(score),
        "ratio": statistics.median(s / g for s, g in zip(score, gen, strict=True)),
    }


def load_times() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "XDG_CACHE_HOME": tmp}
        code = (
            "import time; from guarduq import load_model; t=time.perf_counter(); "
            "load_model('smollm2-135m-instruct'); print(time.perf_counter()-t)"
        )
        cold, warm = (
            float(subprocess.check_output([sys.executable, "-c", code], env=env, text=True,
                                          stderr=subprocess.DEVNULL).split()[-1])
            for _ in range(2)
        )
    return {"cold_s": cold, "cached_s": warm, "ratio": warm / cold}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--memory-child", choices=["lean", "naive"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return

    t = timing(args.n, args.tokens)
    print(f"time   n={t['n']} answers of {t['mean_tokens']:.0f} tokens: generation {t['generate_s']:.2f}s, "
          f"scoring {t['score_s']:.2f}s (median)  ->  scoring/generation = {t['ratio']:.2f}  (goal <= 2)")
    mem = {}
    for mode in ("lean", "naive"):
        out = subprocess.check_output(
            [sys.executable, __file__, "--memory-child", mode], text=True, stderr=subprocess.DEVNULL
        )
        mem[mode] = json.loads(out.strip().splitlines()[-1])
    size = mem["lean"]["model_fp32"]
    lean, naive = mem["lean"]["added"] / size, mem["naive"]["added"] / size
    print(f"memory peak RSS added while scoring (model fp32 = {size / 2**20:.0f} MiB): "
          f"lean {mem['lean']['added'] / 2**20:.0f} MiB = {lean:.0%}, "
          f"naive {mem['naive']['added'] / 2**20:.0f} MiB = {naive:.0%}  (goal: lean < 25%)")
    ld = load_times()
    print(f"load   cold GGUF {ld['cold_s']:.1f}s, cached {ld['cached_s']:.1f}s  ->  cached/cold = "
          f"{ld['ratio']:.2f}  (goal <= 0.20)")


if __name__ == "__main__":
    main()
