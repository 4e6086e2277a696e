"""Throughput of batched generation (and generation + scoring) on the default model, in one run.

    .venv/bin/python benchmarks/throughput_generate.py [--n 16] [--tokens 32] [--batch-sizes 1 4 8 16]
        [--device cpu|cuda] [--dtype float32|bf16] [--threads 2]

For each batch size B, the same N prompts (of different lengths) go through

1. generation only: ``Guard``'s own left-padded ``model.generate``, B prompts per call;
2. generation + scoring: ``Guard.generate_batch(prompts, batch_size=B)`` (generate, then score
   the B replies with ``score_batch``, then decide), with the generate / score split;

and the table prints items/s, the ratio to B = 1 (the one-at-a-time path, measured in this same
run), whether every text and ``ended`` flag equals B = 1's, and the peak memory above the level
before the run (RSS on CPU, ``max_memory_allocated`` on CUDA). Absolute seconds depend on the
machine and its load; the ratios are the claim. ``benchmarks/throughput.py`` runs this after its
scoring tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guarduq import Guard  # noqa: E402
from guarduq.batching import chunked  # noqa: E402

PROMPTS = (
    "Hi",
    "What is the capital of France?",
    "Explain in one sentence why the sky is blue, and mention Rayleigh scattering please.",
    "Name a prime number.",
    "Who wrote Hamlet?",
    "Describe how a bicycle works to a ten-year-old who has never seen one before.",
    "What should I pack for a weekend hiking trip?",
    "Why do cats purr?",
    "Give me a number between 1 and 10.",
    "How do vaccines train the immune system? Keep it short.",
    "Tell me about the history of Rome.",
    "What is 12 times 12?",
    "Translate 'good morning' into French.",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "What is the boiling point of water at sea level in Celsius?",
    "List three uses of copper.",
)


class PeakMemory:
    """Peak memory above the starting level while the block runs (RSS sampled every 20 ms on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    @staticmethod
    def _rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        self.base = self._rss()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, self._rss() - self.base)
                time.sleep(0.02)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return
        self._stop.set()
        self._thread.join()


def generation_only(guard: Guard, prompts: list[str], size: int, tokens: int) -> list[tuple[str, bool]]:
    gen = guard._generation_settings({"max_new_tokens": tokens})
    out = []
    for chunk in chunked(prompts, size):
        out += [guard._decode_reply(new, gen["eos_token_id"]) for new in guard._generate_rows(chunk, gen)[0]]
    return out


def run(guard: Guard, prompts: list[str], sizes: list[int], tokens: int, warm: bool = True) -> list[dict[str, Any]]:
    dev = guard._device
    rows: list[dict[str, Any]] = []
    if warm:
        generation_only(guard, prompts[:2], 2, 4)  # warm-up: first-call overheads out of the timings
    for size in sizes:
        with PeakMemory(dev) as mem_g:
            t0 = time.perf_counter()
            texts_g = generation_only(guard, prompts, size, tokens)
            gen_s = time.perf_counter() - t0
        with PeakMemory(dev) as mem_s:
            t0 = time.perf_counter()
            responses = guard.generate_batch(prompts, batch_size=size, max_new_tokens=tokens)
            both_s = time.perf_counter() - t0
        rows.append({
            "B": size, "gen_s": gen_s, "both_s": both_s,
            "gen_part_s": sum(r.timings["generate_s"] for r in responses),
            "score_part_s": sum(r.timings["score_s"] for r in responses),
            "texts": texts_g, "replies": [(r.text, r.ended) for r in responses],
            "epistemic": [r.scores.epistemic for r in responses],
            "mem_gen": mem_g.peak, "mem_both": mem_s.peak,
        })
        print(f"  B={size}: generation {gen_s:.1f}s, generation+scoring {both_s:.1f}s", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict[str, Any]], n: int, tokens: int, guard: Guard) -> str:
    base = rows[0]
    lines = [
        f"model {guard.info.name} on {guard._device} ({next(guard.model.parameters()).dtype}), N={n} prompts, "
        f"max_new_tokens={tokens}, torch threads={torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}",
        "",
        f"{'B':>3} {'gen it/s':>9} {'x B=1':>6} {'gen+score it/s':>15} {'x B=1':>6} "
        f"{'(gen s':>7} {'score s)':>9} {'same text':>10} {'rel d(epi)':>11} {'peak MiB g/g+s':>15}",
    ]
    for r in rows:
        same = r["texts"] == base["texts"] and r["replies"] == base["replies"] and r["texts"] == r["replies"]
        d_epi = max((abs(a - b) / abs(a) for a, b in zip(base["epistemic"], r["epistemic"], strict=True)
                     if a == a and a != 0), default=0.0)
        lines.append(
            f"{r['B']:>3} {n / r['gen_s']:>9.2f} {base['gen_s'] / r['gen_s']:>6.2f} {n / r['both_s']:>15.2f} "
            f"{base['both_s'] / r['both_s']:>6.2f} {r['gen_part_s']:>7.1f} {r['score_part_s']:>9.1f} "
            f"{'yes' if same else 'NO':>10} {d_epi:>11.1e} "
            f"{r['mem_gen'] / 2**20:>7.0f}/{r['mem_both'] / 2**20:<7.0f}"
        )
    lines.append("")
    lines.append("x B=1: items/s relative to B=1 (one at a time) in this run; same text: every text and ended "
                 "flag equals B=1's (generation-only and generate_batch alike); (gen s, score s): where "
                 "generate_batch's time went.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=16, help="prompts (cycled from a fixed list)")
    ap.add_argument("--tokens", type=int, default=32, help="max_new_tokens")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared machine more threads spin and slow everything)")
    args = ap.parse_args(argv)
    if args.batch_sizes[0] != 1:
        args.batch_sizes = [1, *args.batch_sizes]
    torch.set_num_threads(args.threads)
    guard = Guard(args.model, device=args.device, dtype=args.dtype)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.n)]
    rows = []
    for size in args.batch_sizes:  # the table so far after each batch size, in case the run is cut
        rows += run(guard, prompts, [size], args.tokens, warm=not rows)
        print(report(rows, args.n, args.tokens, guard), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
