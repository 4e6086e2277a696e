"""Throughput on SmolLM2: scoring only, then generation only and generation + scoring, in one run.

    .venv/bin/python benchmarks/throughput.py [--n 32] [--batch-sizes 1 4 8 16] [--profile 16]
        [--gen-n 16] [--gen-tokens 16] [--no-generation]

Items are real TriviaQA questions (``/work/shared/data`` or ``--data``) with their short
reference answers as responses. Measured, in this order, on the same sequences:

1. ``forwards``: plain no-grad batch-1 forwards (``mean_token_prob``), the floor a
   one-at-a-time scorer cannot beat;
2. ``sequential``: ``GradientScorer.score`` in a loop (the path before batching);
3. ``batched``: ``GradientScorer.score_batch`` at each batch size, with the largest relative
   difference to the sequential scores (epistemic, p̄, entropy);
4. peak memory: peak RSS (CPU; sampled from /proc) or ``torch.cuda.max_memory_allocated`` (GPU)
   added while scoring one batch, each batch size in a fresh subprocess;
5. a torch.profiler summary of one batched call (``--profile B``): where the time goes.

6. generation only and generation + scoring at the same batch sizes (``throughput_generate.py``,
   run in this process afterwards; ``--no-generation`` skips it).

One function per measurement. Absolute seconds
depend on the machine and on what else runs; the ratios within one run are the claim.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[2] / "shared/data/triviaqa/triviaqa_dev_extra_2k.jsonl"
Item = tuple[Any, int]


def load(device: str) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (fp32) and its tokenizer, on ``device``."""
    from guarduq import load_model

    loaded = load_model("smollm2-135m-instruct")
    return loaded.model.to(device), loaded.tokenizer


def items(tokenizer: Any, model: Any, n: int, data: Path, device: str) -> list[Item]:
    """(input_ids [1, L], response_start) for the first ``n`` questions with their answers."""
    from guarduq import layout

    out = []
    with data.open() as f:
        for line in f:
            row = json.loads(line)
            enc = layout.encode(tokenizer, model, row["question"], row["value"])
            out.append((enc.input_ids.to(device), enc.response_start))
            if len(out) == n:
                break
    return out


def _clock() -> float:
    """CPU: this process's CPU seconds, which other load on a shared machine barely moves (with
    one torch thread it equals wall time on an idle machine); GPU: synchronised wall time."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def timed(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, Any]:
    """Best time of ``repeat`` calls and the last result (``main`` warms every path up once)."""
    result = None
    best = float("inf")
    for _ in range(repeat):
        t0 = _clock()
        result = fn()
        best = min(best, _clock() - t0)
    return best, result


def measure_forwards(model: Any, data: list[Item], repeat: int) -> float:
    from guarduq.scoring.uncertainty import mean_token_prob

    seconds, _ = timed(lambda: [mean_token_prob(model, ids, start) for ids, start in data], repeat)
    return seconds


def measure_backward_floor(model: Any, data: list[Item], batch_size: int, repeat: int) -> float:
    """One padded forward + backward per batch through the transformer body only (no LM head),
    computing activation gradients alone (weights frozen, gradient taken at the input embeddings,
    no norms): a lower bound on any exact scorer, since every layer's output gradient needs the
    backward through the layers above it, and that costs about one more forward."""
    import torch

    def run() -> None:
        emb = model.get_input_embeddings()
        for i in range(0, len(data), batch_size):
            chunk = data[i : i + batch_size]
            width = max(int(ids.shape[1]) for ids, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long, device=chunk[0][0].device)
            mask = torch.zeros_like(ids)
            for row, (seq, _) in enumerate(chunk):
                ids[row, : seq.shape[1]] = seq[0]
                mask[row, : seq.shape[1]] = 1
            x = emb(ids).detach().requires_grad_(True)
            hidden = model.base_model(inputs_embeds=x, attention_mask=mask).last_hidden_state
            (hidden * mask[..., None]).sum().backward()

    frozen = [q for q in model.parameters() if q.requires_grad]
    for q in frozen:
        q.requires_grad_(False)
    try:
        seconds, _ = timed(run, repeat)
    finally:
        for q in frozen:
            q.requires_grad_(True)
    return seconds


def measure_sequential(scorer: Any, data: list[Item], repeat: int) -> tuple[float, list[Any]]:
    return timed(lambda: [scorer.score(ids, start) for ids, start in data], repeat)


def measure_batched(scorer: Any, data: list[Item], batch_size: int, repeat: int) -> tuple[float, list[Any]]:
    return timed(lambda: scorer.score_batch(data, batch_size=batch_size), repeat)


def max_rel_diff(a: list[Any], b: list[Any]) -> dict[str, float]:
    def rel(x: float, y: float) -> float:
        return abs(x - y) / max(abs(x), 1e-300)

    return {
        f: max(rel(getattr(x, f), getattr(y, f)) for x, y in zip(a, b, strict=True))
        for f in ("epistemic", "mean_token_prob", "mean_entropy")
    }


def measure_fp32_floor(model: Any, data: list[Item], batched: list[Any], seq: list[Any]) -> dict[str, float]:
    """Largest relative error of the fp32 sequential and batched epistemic against a float64
    copy of the model (sequential): the rounding floor both paths sit on."""
    import copy

    import torch

    from guarduq.scoring.uncertainty import GradientScorer

    ref = GradientScorer(copy.deepcopy(model).to(torch.float64))
    truth = [ref.score(ids, start).epistemic for ids, start in data]
    return {
        name: max(abs(s.epistemic - t) / t for s, t in zip(got, truth, strict=True))
        for name, got in (("sequential", seq[: len(data)]), ("batched", batched[: len(data)]))
    }


def measure_memory(batch_size: int, n: int, data: Path, device: str) -> float:
    """MiB added at peak while scoring one batch of ``batch_size`` (``batch_size`` 0: the
    sequential scorer on the same items), in a fresh subprocess."""
    cmd = [sys.executable, __file__, "--memory-child", str(batch_size), "--n", str(n),
           "--data", str(data), "--device", device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def memory_child(batch_size: int, n: int, data: Path, device: str) -> None:
    import torch

    from guarduq.scoring.uncertainty import GradientScorer, mean_token_prob

    model, tok = load(device)
    batch = items(tok, model, max(batch_size, 1), data, device)
    mean_token_prob(model, *batch[0])  # warm the allocator and kernels
    scorer = GradientScorer(model)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        scorer.score(*batch[0]) if batch_size == 0 else scorer.score_batch(batch)
        print((torch.cuda.max_memory_allocated() - base) / 2**20)
        return
    rss = Path("/proc/self/statm")
    page = 4096
    base = int(rss.read_text().split()[1]) * page
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], int(rss.read_text().split()[1]) * page)
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    scorer.score(*batch[0]) if batch_size == 0 else scorer.score_batch(batch)
    done.set()
    t.join()
    print((peak[0] - base) / 2**20)


def profile_batch(scorer: Any, data: list[Item], rows: int = 15) -> str:
    """torch.profiler table (self CPU/CUDA time by operator) of one batched call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        scorer.score_batch(data, batch_size=len(data))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="items (a multiple of the largest batch size)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--repeat", type=int, default=1, help="timed repeats after a warm-up (best kept)")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", type=int, default=16, help="batch size to profile (0: none)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--fp64-check", type=int, default=4, help="items checked against an fp64 copy")
    ap.add_argument("--gen-n", type=int, default=16, help="prompts for the generation tables")
    ap.add_argument("--gen-tokens", type=int, default=16, help="max_new_tokens for the generation tables")
    ap.add_argument("--no-generation", action="store_true", help="scoring only")
    ap.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child is not None:
        memory_child(args.memory_child, args.n, args.data, args.device)
        return

    import torch

    from guarduq.scoring.uncertainty import GradientScorer

    model, tok = load(args.device)
    data = items(tok, model, args.n, args.data, args.device)
    lengths = [int(ids.shape[1]) for ids, _ in data]
    print(f"SmolLM2-135M-Instruct fp32 on {args.device}, torch threads {torch.get_num_threads()}, "
          f"n={len(data)} TriviaQA items, {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.1f}), best of {args.repeat}, "
          f"{'process CPU' if args.device == 'cpu' else 'wall'} seconds")
    scorer = GradientScorer(model)
    measure_forwards(model, data[:2], 1)  # warm-up: allocator, kernels, lazy imports
    measure_sequential(scorer, data[:2], 1)
    measure_batched(scorer, data[:2], 2, 1)
    t_fwd = measure_forwards(model, data, args.repeat)
    t_seq, seq = measure_sequential(scorer, data, args.repeat)
    n = len(data)
    print(f"\n{'path':<16}{'items/s':>9}{'x loop':>8}{'x fwds':>8}  max rel diff vs sequential")
    print(f"{'forwards (b=1)':<16}{n / t_fwd:>9.2f}{t_seq / t_fwd:>8.2f}{1.0:>8.2f}")
    print(f"{'sequential':<16}{n / t_seq:>9.2f}{1.0:>8.2f}{t_seq / t_fwd:>8.2f}")
    for bs in args.batch_sizes:
        t_b, got = measure_batched(scorer, data, bs, args.repeat)
        diff = max_rel_diff(seq, got)
        diffs = "  ".join(f"{k} {v:.1e}" for k, v in diff.items())
        print(f"{f'batched b={bs}':<16}{n / t_b:>9.2f}{t_seq / t_b:>8.2f}{t_b / t_fwd:>8.2f}  {diffs}")
    for bs in args.batch_sizes:
        t_f = measure_backward_floor(model, data, bs, args.repeat)
        print(f"{f'fwd+bwd b={bs}':<16}{n / t_f:>9.2f}{t_seq / t_f:>8.2f}{t_f / t_fwd:>8.2f}"
              "  (body fwd+bwd, activation gradients only: a floor)")
    print("  x loop: speed-up over the sequential loop; x fwds: cost relative to the batch-1 forwards")
    if args.fp64_check:
        floor = measure_fp32_floor(model, data[: args.fp64_check], got, seq)
        print(f"fp32 floor, max rel error of epistemic vs an fp64 model on {args.fp64_check} items: "
              + ", ".join(f"{k} {v:.1e}" for k, v in floor.items()) + f" (batched at b={bs})")
    if not args.no_memory:
        print("\npeak memory added while scoring (MiB): "
              + ", ".join(f"{'sequential' if bs == 0 else f'b={bs}'} "
                          f"{measure_memory(bs, args.n, args.data, args.device):.0f}"
                          for bs in [0, *args.batch_sizes]))
    if args.profile:
        print(f"\ntorch.profiler, one batched call of {args.profile}:")
        print(profile_batch(scorer, data[: args.profile]))
    if not args.no_generation:
        import throughput_generate

        print("\ngeneration only and generation + scoring (throughput_generate.py):")
        throughput_generate.main(["--n", str(args.gen_n), "--tokens", str(args.gen_tokens),
                                  "--device", args.device, "--threads", str(torch.get_num_threads()),
                                  "--batch-sizes", *map(str, args.batch_sizes)])


if __name__ == "__main__":
    main()
