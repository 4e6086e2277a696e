"""Guarding long prompts: what a guarded answer costs next to the unguarded one, as ratios from one run.

    .venv/bin/python benchmarks/long_context.py            # SmolLM2, one torch thread (tens of minutes)
    .venv/bin/python benchmarks/long_context.py --quick    # a tiny random model, seconds (make test)

Prompts of about 100, 1k, 4k and 8k tokens are built from real documents (BoolQ's Wikipedia
passages, ../shared/data/boolq/dev.jsonl) followed by a question; answers are forced to 20 and
100 new tokens (``min_new_tokens``), so every mode generates the same number of tokens. Modes:

* ``unguarded``: ``model.generate`` alone (prefill + decoding), no scoring;
* ``default``: ``Guard.generate`` with the default parameter set; where it scores the last N
  blocks only, the hidden states generation recorded are reused (``guarduq.scoring.reuse``);
* ``all``: ``Guard.generate`` over every parameter (the method's definition), activation
  checkpointing past ``CHECKPOINT_TOKENS``.

Also measured: the cost of teacher-forced scoring over each parameter set of the frontier
(scoring seconds / no-grad forward seconds, same tokens), peak memory added by a no-grad forward
and by all-parameter scoring with and without checkpointing (VmHWM reset before each), and a
profile of the default mode (prefill, decoding, scoring forward and backward; top torch ops).
Writes docs/results/long_context.{md,json}. Seconds depend on the machine; the ratios are the claim.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from overhead import _vm  # noqa: E402  (a /proc/self/status field in bytes)

DATA = Path(os.environ.get("GUARDUQ_DATA", ROOT.parent / "shared" / "data"))
LENGTHS = (100, 1000, 4000, 8000)
ANSWERS = (20, 100)
# The frontier's parameter sets, as Guard arguments (see benchmarks/frontier.py for their risk).
SETS: dict[str, dict[str, Any]] = {
    "all": {"parameters": "all"},
    "last 8 blocks": {"last_n_blocks": 8},
    "last 4 blocks": {"last_n_blocks": 4},
    "last 2 blocks": {"last_n_blocks": 2},
    "last 1 block": {"last_n_blocks": 1},
    "MLPs only": {"parameters": r"\.mlp\."},
}
COST_LENGTHS = (100, 1000, 4000)


NOT_RUN = "Not measured in this run (its `--parts` / `--memory-modes` left this out)."

def documents() -> list[str]:
    path = DATA / "boolq" / "dev.jsonl"
    with path.open() as f:
        return [json.loads(line)["passage"] for line in f]


def build_prompt(tokenizer: Any, docs: list[str], target: int) -> tuple[str, int]:
    """Passages until the chat-templated prompt reaches ``target`` tokens, then a question."""
    from guarduq import layout

    question = "\n\nQuestion: summarise what the passages above say, passage by passage."
    text, used = "", 0
    for doc in docs:
        trial = (text + "\n\n" if text else "Passages:\n\n") + doc
        if len(layout.prompt_ids(tokenizer, trial + question)) > target:
            break
        text, used = trial, used + 1
    if used == 0:  # the first passage alone is too long: cut it by words
        words = docs[0].split()
        while words and len(layout.prompt_ids(tokenizer, " ".join(words) + question)) > target:
            words = words[: int(len(words) * 0.9)]
        text = " ".join(words)
    prompt = text + question
    return prompt, len(layout.prompt_ids(tokenizer, prompt))


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def generation_cost(
    guards: dict[str, Any], prompt: str, n_new: int, with_all: bool = True, repeats: int = 1
) -> dict[str, Any]:
    """Wall time of unguarded, default and all-parameter guarded generation: the modes
    interleaved ``repeats`` times and the fastest of each kept (another process's burst then
    cannot land on one mode only)."""
    import torch

    from guarduq import layout

    base = guards["default"]
    gen = {"max_new_tokens": n_new, "min_new_tokens": n_new}
    ids = torch.tensor([layout.prompt_ids(base.tokenizer, prompt)])

    def unguarded() -> None:
        with torch.no_grad():
            base.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                pad_token_id=base._pad_id, **gen)

    row: dict[str, Any] = {}
    modes = ("default", "all") if with_all else ("default",)
    for _ in range(repeats):
        t, _r = timed(unguarded)
        row["unguarded_s"] = min(t, row.get("unguarded_s", t))
        for mode in modes:
            t, r = timed(lambda m=mode: guards[m].generate(prompt, **gen))
            if t <= row.get(f"{mode}_s", t):
                row[f"{mode}_s"] = t
                row[f"{mode}_timings"] = {**r.timings, **r.scores.timings}
                row[f"{mode}_valid"] = r.scores.valid
    return row


def scoring_cost(guards_by_set: dict[str, Any], prompt: str, n_new: int) -> dict[str, float]:
    """Teacher-forced scoring seconds / one no-grad forward of the same tokens, per parameter set."""
    import torch

    from guarduq import layout

    any_guard = next(iter(guards_by_set.values()))
    response = "word " * n_new
    enc = layout.encode(any_guard.tokenizer, any_guard.model, prompt, response, ended=False)
    with torch.no_grad():  # warmed, and without a KV cache (Gemma would build one), like scoring
        any_guard.model(input_ids=enc.input_ids[:, :16], use_cache=False)
        forward_s, _ = timed(lambda: any_guard.model(input_ids=enc.input_ids, logits_to_keep=1, use_cache=False))
    out = {"forward_s": forward_s}
    for name, g in guards_by_set.items():
        out[name], _ = timed(lambda g=g: g.scorer.score(enc.input_ids, enc.response_start))
    return out


MEMORY_MODES = ("forward", "unguarded", "default", "all_checkpointed", "all")
# glibc grows its mmap threshold after large frees, then keeps freed activations resident in the heap:
# a fixed threshold hands them back (an environment setting of the process, not of guarduq).
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MMAP_MODES = ("forward", "all_checkpointed")


def memory_child(mode: str, tokens: int, quick: bool, default_set: str | None,
                 model: str = "smollm2-135m-instruct") -> dict[str, Any]:
    """In a fresh process: peak resident memory of one ``mode`` at a ``tokens``-token prompt.

    ``forward``: one no-grad forward; ``unguarded`` / ``default``: generation of 20 tokens without
    / with guarding (default set); ``all_checkpointed`` / ``all``: one all-parameter scoring pass
    with / without activation checkpointing. Returns the process's peak (VmHWM) and its resident
    size with the model loaded and warmed, before the measured call.
    """
    import torch

    from guarduq import layout

    torch.set_num_threads(1)
    modes, _ = load_guards(quick, default_set, sets=False, model=model)
    g = modes["all"]
    prompt, real = build_prompt(g.tokenizer, documents(), tokens)
    enc = layout.encode(g.tokenizer, g.model, prompt, "word " * 20, ended=False)
    with torch.no_grad():  # warm the kernels on a short input
        g.model(input_ids=enc.input_ids[:, :16])
    base = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here
    t0 = time.perf_counter()
    if mode == "forward":
        with torch.no_grad():
            g.model(input_ids=enc.input_ids, logits_to_keep=1, use_cache=False)
    elif mode == "unguarded":
        ids = torch.tensor([layout.prompt_ids(g.tokenizer, prompt)])
        with torch.no_grad():
            g.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             pad_token_id=g._pad_id, max_new_tokens=20, min_new_tokens=20)
    elif mode == "default":
        modes["default"].generate(prompt, max_new_tokens=20, min_new_tokens=20)
    else:
        g.scorer.checkpoint_tokens = 0 if mode == "all_checkpointed" else None
        g.scorer.score(enc.input_ids, enc.response_start)
    return {"mode": mode, "tokens": real, "peak": _vm("VmHWM"), "base": base,
            "seconds": time.perf_counter() - t0}


def memory_table(lengths: list[int], quick: bool, default_set: str | None,
                 model: str = "smollm2-135m-instruct", modes: tuple[str, ...] = MEMORY_MODES) -> list[dict[str, Any]]:
    """``memory_child`` of every mode at every length, each in its own process (a process's
    allocator keeps what it freed, so peaks measured one after another would hide each other).
    Unchecked all-parameter scoring is skipped at the longest length (it needs gigabytes)."""
    import subprocess

    rows = []
    for n in lengths:
        row: dict[str, Any] = {"target": n}
        runs = [(m, {}) for m in (MMAP_MODES if quick else modes)]  # quick: the pipeline only
        runs += [(m, MMAP_ENV) for m in MMAP_MODES] if set(MMAP_MODES) <= set(modes) else []
        for mode, env in runs:
            if mode == "all" and n == max(lengths):
                continue
            cmd = [sys.executable, __file__, "--memory-child", mode, "--tokens", str(n)]
            cmd += ["--quick"] if quick else []
            cmd += ["--default-set", default_set] if default_set else []
            cmd += ["--model", model]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", **env})
            got = json.loads(out.stdout.strip().splitlines()[-1])
            row["tokens"] = got["tokens"]
            row[mode + ("+mmap" if env else "")] = {k: got[k] for k in ("peak", "base", "seconds")}
        rows.append(row)
    return rows


def profile_default(guard: Any, prompt: str, n_new: int) -> str:
    """Top torch ops of one default-mode guarded generation (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        guard.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def load_guards(
    quick: bool, default_set: str | None, sets: bool = True, model: str = "smollm2-135m-instruct"
) -> tuple[dict[str, Any], dict[str, Any]]:
    from guarduq import Guard, LoadedModel
    from guarduq.scoring.uncertainty import parse_parameter_set

    if quick:
        sys.path.insert(0, str(ROOT))
        from tests.conftest import make_tokenizer, tiny_llama

        model, tok = tiny_llama(layers=4), make_tokenizer()
        spec: Any = (model, tok)
    else:
        first = Guard(model, parameters="all")
        spec = LoadedModel(first.model, first.tokenizer, first.info)  # keeps the model's name
    chosen: dict[str, Any] = {}
    if default_set is not None:
        patterns, last_n = parse_parameter_set(default_set)
        chosen = {"parameters": patterns or "all", "last_n_blocks": last_n} if patterns or not last_n else {"last_n_blocks": last_n}
    modes = {"default": Guard(spec, **chosen), "all": Guard(spec, parameters="all")}
    by_set = {name: Guard(spec, **kw) for name, kw in SETS.items()
              if sets and (quick is False or kw.get("last_n_blocks", 0) <= 4)}
    return modes, by_set


def _mb(x: int | None) -> str:
    return "–" if x is None else f"{x / 2**20:,.0f} MB"


def render(res: dict[str, Any]) -> str:
    lines = [
        f"Model {res['model']}; guarded generation over `{res['default_set']}` and over all parameters; one torch thread; "
        f"{res['machine']}. Ratios come from one run (each row's modes back to back).",
        "",
        "## Guarded generation against unguarded generation",
        "",
        f"| prompt tokens | answer tokens | unguarded | guarded, `{res['default_set']}` | ratio | all parameters | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["generation"]:
        lines.append(
            f"| {r['prompt_tokens']:,} | {r['answer_tokens']} | {r['unguarded_s']:.2f} s | "
            f"{r['default_s']:.2f} s | **{r['default_s'] / r['unguarded_s']:.2f}×** | "
            + (f"{r['all_s']:.2f} s | {r['all_s'] / r['unguarded_s']:.2f}× |" if "all_s" in r else "– | – |")
        )
    lines += ["", "## Memory", "",
              "Peak resident memory of a fresh process (model loaded, kernels warmed) that runs one call: "
              "its whole peak, and in brackets what the call added above the loaded model. Generation "
              "makes 20 tokens; scoring covers the prompt and a 20-token answer.", "",
              f"| prompt tokens | no-grad forward | unguarded generation | guarded, `{res['default_set']}` | "
              "ratio to forward | all parameters, checkpointed | ratio to forward | all parameters, not checkpointed "
              "| ratio to forward |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r: dict[str, Any], mode: str) -> str:
        m = r.get(mode)
        return "–" if m is None else f"{_mb(m['peak'])} (+{_mb(m['peak'] - m['base'])})"

    def ratio(r: dict[str, Any], mode: str) -> str:
        m, f = r.get(mode), r.get("forward")
        return "–" if m is None or f is None else f"{m['peak'] / f['peak']:.2f}×"

    for r in res["memory"]:
        lines.append(f"| {r['tokens']:,} | {cell(r, 'forward')} | {cell(r, 'unguarded')} | {cell(r, 'default')} | "
                     f"{ratio(r, 'default')} | {cell(r, 'all_checkpointed')} | {ratio(r, 'all_checkpointed')} | {cell(r, 'all')} | "
                     f"{ratio(r, 'all')} |")
    rows = []
    for r in res["memory"]:
        f, c = r.get("forward+mmap"), r.get("all_checkpointed+mmap")
        if f is None or c is None:
            continue
        secs = f"{r['all_checkpointed']['seconds']:.1f} s → {c['seconds']:.1f} s" if "all_checkpointed" in r else "–"
        rows.append(f"| {r['tokens']:,} | {cell(r, 'forward+mmap')} | {cell(r, 'all_checkpointed+mmap')} | "
                    f"{c['peak'] / f['peak']:.2f}× | {secs} |")
    lines += ["", "The same two calls with glibc's `MALLOC_MMAP_THRESHOLD_=65536` in the environment (freed "
              "activations go back to the system instead of staying in the heap), and the seconds each took:", "",
              *(["| prompt tokens | no-grad forward | all parameters, checkpointed | ratio to forward | "
                 "seconds, default allocator → fixed threshold |", "|---:|---:|---:|---:|---:|", *rows]
                if rows else [NOT_RUN])]
    lines += ["", "## Scoring cost per parameter set (teacher forcing, scoring / no-grad forward)", ""]
    names = [k for k in (res["scoring"] or [{}])[0] if k not in ("forward_s", "tokens")]
    if res["scoring"]:
        lines += ["| tokens | forward | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    else:
        lines.append(NOT_RUN)
    for r in res["scoring"]:
        lines.append(f"| {r['tokens']:,} | {r['forward_s']:.2f} s | "
                     + " | ".join(f"{r[n] / r['forward_s']:.2f}×" for n in names) + " |")
    lines += ["", f"## Where the time goes (guarded, `{res['default_set']}`)", ""]
    for r in res["generation"]:
        t = r["default_timings"]
        lines.append(f"- {r['prompt_tokens']:,} + {r['answer_tokens']}: generation {t.get('generate_s', 0):.2f} s, "
                     f"scoring forward {t.get('forward_s', 0):.2f} s, backward {t.get('backward_s', 0):.2f} s, "
                     f"decide {t.get('decide_s', 0):.3f} s")
    lines += ["", f"Top ops of one guarded generation (`{res['default_set']}`) at the longest prompt "
              "(torch profiler, self CPU time):", "", "```", res["profile"].rstrip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, short prompts (make test)")
    ap.add_argument("--lengths", type=int, nargs="*", default=None)
    ap.add_argument("--answers", type=int, nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--default-set", default=None,
                    help="the 'default' mode's parameter set as a Guard name (e.g. last_n_blocks=2); "
                         "default: the Guard's own default")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per mode (interleaved; the fastest kept) up to 4k tokens; one beyond")
    ap.add_argument("--memory-child", choices=MEMORY_MODES, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias, folder or .gguf")
    ap.add_argument("--costs-only", action="store_true",
                    help="only the scoring cost per parameter set, into long_context_costs_<model>.json "
                         "(for benchmarks/frontier.py on another model)")
    ap.add_argument("--parts", default="generation,scoring,memory,profile",
                    help="comma-separated parts to run (a larger model on a small CPU: generation,memory)")
    ap.add_argument("--memory-modes", default=",".join(MEMORY_MODES),
                    help=f"memory children to run, from {','.join(MEMORY_MODES)}")
    ap.add_argument("--all-max-tokens", type=int, default=4000,
                    help="longest prompt for all-parameter guarded generation (memory is still measured)")
    args = ap.parse_args(argv)

    import platform

    import torch
    from tqdm.auto import tqdm

    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.tokens, args.quick, args.default_set, args.model)))
        return 0
    torch.set_num_threads(1)
    lengths = args.lengths or ((60, 120) if args.quick else LENGTHS)
    answers = args.answers or ((5,) if args.quick else ANSWERS)
    cost_lengths = [n for n in (lengths if args.quick else COST_LENGTHS) if n in lengths] or lengths[:1]
    modes, sets = load_guards(args.quick, args.default_set, model=args.model)
    tok = modes["default"].tokenizer
    docs = documents()
    res: dict[str, Any] = {
        "model": "tiny random Llama (--quick)" if args.quick else modes["default"].info.name,
        "default_set": modes["default"].scorer.parameter_set,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "generation": [], "scoring": [], "memory": [],
    }
    prompts = {n: build_prompt(tok, docs, n) for n in lengths}
    if args.costs_only:
        for n in tqdm(cost_lengths, desc="scoring cost"):
            res["scoring"].append({"tokens": prompts[n][1], **scoring_cost(sets, prompts[n][0], 20)})
        args.out.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in res["model"])
        (args.out / f"long_context_costs_{safe}.json").write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res["scoring"], indent=1))
        return 0
    parts = set(args.parts.split(","))
    modes["default"].generate(prompts[lengths[0]][0], max_new_tokens=2)  # warm-up
    jobs = [(n, a) for n in lengths for a in answers] if "generation" in parts else []
    for n, a in tqdm(jobs, desc="generation"):
        prompt, real = prompts[n]
        res["generation"].append({"prompt_tokens": real, "answer_tokens": a, **generation_cost(
            modes, prompt, a, with_all=n <= args.all_max_tokens, repeats=args.repeats if n <= 4000 else 1)})
    for n in tqdm(cost_lengths if "scoring" in parts else [], desc="scoring cost"):
        prompt, real = prompts[n]
        res["scoring"].append({"tokens": real, **scoring_cost(sets, prompt, 20)})
    if "memory" in parts:
        res["memory"] = memory_table([n for n in lengths if n >= 1000] or lengths[:1], args.quick, args.default_set,
                                     args.model, tuple(m for m in args.memory_modes.split(",") if m))
    res["profile"] = (profile_default(modes["default"], prompts[lengths[-1]][0], answers[0])
                      if "profile" in parts else "(not run: --parts)")
    page = render(res)
    if args.quick:
        print(page)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_context.json").write_text(json.dumps(res, indent=1) + "\n")
    from _pages import write_page

    write_page(args.out / "long_context.md", page, "Guarding long prompts")
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
