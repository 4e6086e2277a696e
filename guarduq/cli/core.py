"""Core sub-commands: ``score``, ``generate`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from tqdm.auto import tqdm

from guarduq.aliases import DEFAULT_MODEL
from guarduq.cli._help import with_example
from guarduq.cli._run import (
    model_of,
    open_guard,
    open_scorer,
    parameter_kwargs,
    parameter_set_arg,
    run_args,
    sve_arg,
    threads_arg,
)
from guarduq.errors import DatasetError, InputError

# Easy facts, common misconceptions and unanswerable questions: the three kinds of prompt a
# guardrail must tell apart.
DEMO_PROMPTS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level in Celsius?",
    "What happens if you swallow chewing gum?",
    "Do we only use 10% of our brains?",
    "What did I eat for breakfast yesterday?",
    "What will the winning lottery numbers be next week?",
    "Who was the first person to walk on Mars?",
)


class ScoreRequest(BaseModel):
    """One line of ``guarduq score --input``: validated at the boundary."""

    model_config = ConfigDict(extra="ignore")
    id: str | int | None = None
    prompt: str
    response: str
    ended: bool = True

    @field_validator("prompt", "response")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score", help="score a response produced elsewhere (teacher forcing)",
        **with_example("guarduq score --prompt 'Capital of France?' --response Paris",
                       "guarduq score --input pairs.jsonl > scores.jsonl",
                       "cat pairs.jsonl | guarduq score --input -"),
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, folder, hub id or .gguf")
    p.add_argument("--prompt")
    p.add_argument("--response")
    p.add_argument("--not-ended", action="store_true", help="the reply was cut, not ended")
    p.add_argument("--input", type=Path, help="JSONL with prompt, response[, id, ended]; - reads stdin")
    p.add_argument("--json", action="store_true", help="print JSON (always JSON with --input)")
    run_args(p)
    p.set_defaults(func=_cmd_score)

    g = sub.add_parser("generate", help="generate a reply and score it",
                       **with_example("guarduq generate --prompt 'Capital of France?' --json"))
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--json", action="store_true")
    g.add_argument("--device", help="cpu (default), cuda or cuda:N")
    g.add_argument("--dtype", help="model weights: float32 (default), bf16 or fp16")
    threads_arg(g)
    parameter_set_arg(g)
    g.set_defaults(func=_cmd_generate)

    d = sub.add_parser("demo", help="answer a few prompts with the default model and show scores",
                       **with_example("guarduq demo --policy policies/default.yaml"))
    d.add_argument("--model", help=f"default: the model the policy's calibrator was fitted for, else {DEFAULT_MODEL}")
    d.add_argument("--max-new-tokens", type=int, default=40)
    d.add_argument("--policy", type=Path, help="apply a YAML policy (e.g. policies/default.yaml)")
    threads_arg(d)
    sve_arg(d)
    d.set_defaults(func=_cmd_demo)


def _row(guard: Any, scores: Any, **extra: Any) -> dict[str, Any]:
    return {**extra, **scores.to_dict(with_token_probs=False), "model_fingerprint": guard.info.fingerprint}


def _cmd_score(args: argparse.Namespace) -> int:
    if args.input is None and (args.prompt is None or args.response is None):
        raise InputError("give --prompt and --response, or --input FILE.jsonl")
    requests = _read_requests(args.input) if args.input else [
        # Flags are validated where all input is: guarduq.layout raises InputError.
        ScoreRequest.model_construct(
            id=None, prompt=args.prompt, response=args.response, ended=not args.not_ended
        )
    ]
    guard, _ = open_scorer(args, args.model)
    try:
        for req, scores in zip(requests, _score_requests(guard, requests, args), strict=True):
            row = _row(guard, scores, **({"id": req.id} if req.id is not None else {}))
            if args.json or args.input:
                print(json.dumps(row), flush=True)
            else:
                _print_human(row)
    finally:
        if hasattr(guard, "close"):  # Ray actors
            guard.close()
    return 0


def _score_requests(guard: Any, requests: list[ScoreRequest], args: argparse.Namespace) -> Iterator[Any]:
    """Scores in request order, ``--batch-size`` at a time (on Ray actors with ``--ray``)."""
    from guarduq.batching import chunked

    pairs = [(r.prompt, r.response) for r in requests]
    ended = [r.ended for r in requests]
    if hasattr(guard, "score_pairs"):  # RayScorer
        yield from guard.score_pairs(pairs, ended, batch_size=args.batch_size)
        return
    bar = tqdm(total=len(requests), desc="scoring", unit="resp", disable=args.input is None, file=sys.stderr)
    for idx in chunked(range(len(requests)), args.batch_size):
        yield from guard.score_batch([pairs[i] for i in idx], ended=[ended[i] for i in idx])
        bar.update(len(idx))
    bar.close()


def _read_requests(path: Path) -> list[ScoreRequest]:
    """Every request of a JSONL file, or of standard input when ``path`` is ``-``."""
    if str(path) == "-":
        return _parse_requests(sys.stdin, "<stdin>")
    if not path.is_file():
        raise DatasetError(f"input file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return _parse_requests(f, str(path))
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _parse_requests(lines: Iterable[str], where_from: str) -> list[ScoreRequest]:
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(ScoreRequest.model_validate_json(line))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "line"
            raise DatasetError(f"{where_from}:{lineno}: {where}: {first['msg']}") from None
    if not out:
        raise DatasetError(f"input {where_from} has no requests")
    return out


def _cmd_generate(args: argparse.Namespace) -> int:
    guard = open_guard(args.model, device=args.device, dtype=args.dtype, **parameter_kwargs(args.parameter_set))
    r = guard.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    row = _row(guard, r.scores, text=r.text, ended=r.ended)
    if args.json:
        print(json.dumps(row))
    else:
        _print_human(row)
    return 0


def _print_human(row: dict[str, Any]) -> None:
    if "text" in row:
        print(row["text"])
    keys = ("mean_token_prob", "epistemic", "aleatoric", "n_tokens", "valid")
    print("  ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keys))


def _cmd_demo(args: argparse.Namespace) -> int:
    # a look at what the pair decides, never served: an uncertified one is shown (with a warning)
    guard = open_guard(model_of(args.model, policy=args.policy), sve=args.sve, policy=args.policy,
                       allow_uncertified=True)
    if guard.policy is not None:
        print(f"policy {guard.policy.name} v{guard.policy.version} ({args.policy})")
    print(f"model {guard.info.name}  fingerprint {guard.info.fingerprint}  "
          f"params {guard.info.n_params:,}\n")
    rows = []
    for prompt in tqdm(DEMO_PROMPTS, desc="answering", unit="prompt", file=sys.stderr):
        r = guard.generate(prompt, max_new_tokens=args.max_new_tokens)
        rows.append((prompt, r))
    print(demo_table(rows))
    print("\np̄ = mean token probability (higher = more confident); epistemic = ‖∇θ p̄‖²;"
          " aleatoric = p̄(1−p̄).\nRaw scores are model-specific: calibrate per model"
          " (guarduq calibrate) before setting thresholds.")
    return 0


def demo_table(rows: list[tuple[str, Any]], width: int = 58) -> str:
    """Question, answer and scores; with a policy also the risk, the action and what is shown."""
    decided = any(r.decision is not None for _, r in rows)
    head = f"{'prompt / answer':<{width}} {'p̄':>6} {'epistemic':>10} {'aleatoric':>9}"
    if decided:
        head += f" {'risk':>6}  decision"
    lines = [head, "-" * len(head)]
    for prompt, r in rows:
        s = r.scores
        answer = " ".join(r.text.split()) + ("" if r.ended else " …")
        lines.append(f"Q: {prompt[: width - 3]}")
        row = (
            f"A: {answer[: width - 3]:<{width - 3}} {s.mean_token_prob:>6.3f} "
            f"{s.epistemic:>10.4g} {s.aleatoric:>9.3f}"
        )
        if decided and r.decision is not None:
            risk = f"{r.risk:>6.2f}" if r.risk is not None else f"{'-':>6}"
            row += f" {risk}  {r.decision.action} ({r.decision.rule})"
        lines.append(row)
        if decided and r.decision is not None and not r.decision.shown:
            lines.append(f"   shown to the user: {' '.join(r.decision.text.split())}")
    return "\n".join(lines)
