"""``guarduq policy check FILE`` and ``guarduq policy explain FILE --prompt ... [--response ...]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from guarduq.cli._help import with_example
from guarduq.policy import Policy, validate_policy_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="validate a policy file or explain its decision on a prompt",
                       **with_example("guarduq policy check policies/default.yaml"))
    psub = p.add_subparsers(dest="policy_command", required=True)

    c = psub.add_parser("check", help="validate policy files (exit 2 on the first invalid one)",
                        **with_example("guarduq policy check policies/*.yaml"))
    c.add_argument("files", nargs="+", type=Path, metavar="FILE")
    c.set_defaults(func=_cmd_check)

    e = psub.add_parser(
        "explain", help="run a prompt through the guard and show the decision",
        **with_example("guarduq policy explain policies/default.yaml --prompt 'Capital of Peru?' "
                       "--response Cusco"),
    )
    e.add_argument("file", type=Path, metavar="FILE")
    e.add_argument("--prompt", required=True)
    e.add_argument("--response", help="score this response instead of generating one")
    e.add_argument("--model", help="alias, folder, hub id or .gguf (default: the default model)")
    e.add_argument("--calibrator", type=Path, help="override the policy's calibrator path")
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=_cmd_explain)


def _cmd_check(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:  # also undecodable text, a NUL in the path
            print(f"{path}: cannot read: {exc}", file=sys.stderr)
            status = 2
            continue
        config, issues = validate_policy_text(text, str(path))
        for issue in issues:
            print(str(issue), file=sys.stderr)
        if config is None:
            status = 2
            continue
        policy = Policy.from_yaml(path)
        print(f"ok: {path}: {_summary(policy)}")
    return status


def _summary(policy: Policy) -> str:
    cfg = policy.config
    rules = ", ".join(
        f"{r.name}->{r.action}" + (f"[{', '.join(i.name for i in r.rules)}]" if r.action == "second_opinion" else "")
        for r in cfg.rules
    )
    parts = [
        f"policy {cfg.name!r} v{cfg.version}",
        f"mode {cfg.mode}",
        f"on_error {cfg.on_error.action}",
        f"alpha {cfg.alpha}" if cfg.alpha is not None else "no alpha",
        _calibrator_note(policy),
        f"{len(cfg.rules)} rule(s): {rules}",
    ]
    if cfg.sinks:
        parts.append("sinks: " + ", ".join(f"{n} ({s.type})" for n, s in cfg.sinks.items()))
    if policy.uses_second_opinion:
        parts.append("needs a second-opinion provider")
    return "; ".join(parts)


def _calibrator_note(policy: Policy) -> str:
    path = policy.calibrator_path
    if path is None:
        return "no calibrator"
    return f"calibrator {path}" + ("" if path.is_file() else " (not found yet)")


def _cmd_explain(args: argparse.Namespace) -> int:
    from guarduq.guard import Guard  # torch is imported only when a model is needed
    from guarduq.models import DEFAULT_MODEL

    guard = Guard(
        args.model or DEFAULT_MODEL,
        policy=args.file,
        calibrator=args.calibrator,
        max_new_tokens=args.max_new_tokens,
    )
    if args.response is None:
        result = guard.generate(args.prompt)
    else:
        result = guard.guarded(args.prompt, args.response)
    decision = result.decision
    assert decision is not None  # a policy was given
    if args.json:
        row: dict[str, Any] = {
            "prompt": args.prompt,
            "response": result.text,
            "scores": result.scores.to_dict(with_token_probs=False),
            "decision": decision.to_dict(),
        }
        print(json.dumps(row, ensure_ascii=False, default=str))
        return 0
    print(f"response : {result.text}")
    print(f"scores   : mean_token_prob={result.scores.mean_token_prob:.3f} "
          f"epistemic={result.scores.epistemic:.4g} aleatoric={result.scores.aleatoric:.3f} "
          f"n_tokens={result.scores.n_tokens}")
    risk = "n/a" if decision.risk is None else f"{decision.risk:.3f}"
    threshold = "n/a" if decision.threshold is None else f"{decision.threshold:.3f}"
    print(f"risk     : {risk} (threshold {threshold})")
    print(f"action   : {decision.action}{' (shadow mode: answer shown)' if decision.shadow else ''}")
    print(f"shown    : {decision.text}")
    print("why      :")
    for line in decision.explanation.splitlines():
        print(f"  {line}")
    return 0
