"""``guarduq policy check [--strict] FILE``, ``guarduq policy explain FILE --prompt ... [--response ...]``
and ``guarduq policy init --calibrator CAL --out FILE``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guarduq.cli._help import with_example
from guarduq.cli._run import model_of, open_guard, sve_arg, threads_arg
from guarduq.policy import Policy, validate_policy_text
from guarduq.policy.certified import ThresholdReport, check_policy_thresholds


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="validate a policy file or explain its decision on a prompt",
                       **with_example("guarduq policy check policies/default.yaml"))
    psub = p.add_subparsers(dest="policy_command", required=True)

    c = psub.add_parser(
        "check",
        help="validate policy files and show the certified threshold each threshold rule uses "
             "(exit 2 when a file is invalid)",
        **with_example("guarduq policy check --strict policies/*.yaml"),
    )
    c.add_argument("files", nargs="+", type=Path, metavar="FILE")
    c.add_argument("--strict", action="store_true",
                   help="exit 1 when a rule compares risk with a threshold its calibrator does not "
                        "certify at the policy's alpha (such a rule can never match)")
    c.set_defaults(func=_cmd_check)

    e = psub.add_parser(
        "explain", help="run a prompt through the guard and show the decision",
        **with_example("guarduq policy explain policies/default.yaml --prompt 'Capital of Peru?' "
                       "--response Cusco"),
    )
    e.add_argument("file", type=Path, metavar="FILE")
    e.add_argument("--prompt", required=True)
    e.add_argument("--response", help="score this response instead of generating one")
    e.add_argument("--model", help="alias, folder, hub id or .gguf (default: the model the calibrator was "
                                   "fitted for, else the default model)")
    e.add_argument("--calibrator", type=Path, help="override the policy's calibrator path")
    threads_arg(e)
    sve_arg(e)
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=_cmd_explain)

    i = psub.add_parser(
        "init", help="write a first policy for a calibrator: allow within the threshold certified at "
                     "the strictest alpha it certifies (or --alpha), abstain otherwise",
        **with_example("guarduq policy init --calibrator mine.json --out my.yaml"),
    )
    i.add_argument("--calibrator", type=Path, required=True, help="the calibrator JSON the policy uses")
    i.add_argument("--out", type=Path, required=True, help="the policy YAML to write")
    i.add_argument("--alpha", type=float, help="an alpha the calibrator certifies (default: its strictest)")
    i.add_argument("--name", help="the policy's name (default: the file's stem)")
    i.add_argument("--force", action="store_true", help="replace an existing --out")
    i.set_defaults(func=_cmd_init)


def _cmd_check(args: argparse.Namespace) -> int:
    """Validate each file; report the threshold each threshold rule will use. Exit 2 on an
    invalid file, 1 under ``--strict`` when a threshold rule has no certified threshold."""
    status = 0
    loader = _calibrator_loader()
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
        report = check_policy_thresholds(policy, loader)
        for line in _threshold_lines(report):
            print(f"  {line}")
        if report.warning is not None:
            print(f"WARNING: {path}: {report.warning}", file=sys.stderr)
            if args.strict:
                status = max(status, 1)
        if policy.second_calibrator_path is not None:
            line, warning = _second_stage_line(policy, loader)
            print(f"  {line}")
            if warning is not None:
                print(f"WARNING: {path}: {warning}", file=sys.stderr)
                if args.strict:
                    status = max(status, 1)
    return status


def _cmd_init(args: argparse.Namespace) -> int:
    """Write the starter policy, then check it as ``policy check --strict`` would. Exit 2, writing
    nothing, when the calibrator certifies no alpha (or not ``--alpha``) or ``--out`` exists."""
    from guarduq._storage import write_atomic
    from guarduq.policy.starter import choose_alpha, starter_policy

    if args.out.exists() and not args.force:
        print(f"guarduq: error: {args.out} exists; pass --force to replace it", file=sys.stderr)
        return 2
    load = _calibrator_loader()  # one read of the calibrator for the writing and the check
    calibrator = load(args.calibrator)
    alpha = choose_alpha(calibrator, args.alpha)  # PolicyError: exit 2 with the reason
    text = starter_policy(calibrator, args.calibrator, args.out, alpha, name=args.name)
    config, issues = validate_policy_text(text, str(args.out))
    assert config is not None and not issues, issues  # the template is valid by construction
    write_atomic(args.out, text.encode())
    report = check_policy_thresholds(Policy.from_yaml(args.out), load)
    assert report.warning is None, report.warning
    print(f"wrote {args.out}: alpha {alpha:g}, risk <= {report.threshold:g} allowed ({_provenance(report)})")
    return 0


def _second_stage_line(policy: Policy, loader: Callable[[Path], Any]) -> tuple[str, str | None]:
    """A cascade: the band and the second stage's certified threshold, as ``Policy.bind`` will
    use them (the same checks: the first stage, alpha and band it was fitted for)."""
    from guarduq.errors import GuardUQError

    first_path, second_path = policy.calibrator_path, policy.second_calibrator_path
    assert second_path is not None
    try:
        first = loader(first_path) if first_path is not None else None
        threshold = first.threshold_for(policy.alpha) if first is not None and policy.alpha is not None else None
        t2, band = policy.second_stage(loader(second_path), first, threshold)
    except GuardUQError as exc:
        return f"second stage {policy.config.second_calibrator}: not usable", str(exc)
    stage = f"band: threshold < risk <= band = {band:g}" if band is not None else "no band (no first stage)"
    if t2 is None:
        return (f"second stage {policy.config.second_calibrator}: {stage}; no certified so.threshold",
                f"the second stage certifies no threshold at alpha {policy.alpha:g}: so.risk <= so.threshold never holds")
    return (f"second stage {policy.config.second_calibrator}: {stage}; so.threshold = "
            f"{t2:g} (certified at alpha {policy.alpha:g} on the band's answers)", None)


def _calibrator_loader() -> Callable[[Path], Any]:
    """``Calibrator.load``, imported only when a policy has threshold rules (it pulls in numpy
    and scikit-learn) and read once per file for every policy naming it."""
    loaded: dict[Path, Any] = {}

    def load(path: Path) -> Any:
        from guarduq.calibration import Calibrator

        key = path.absolute()
        if key not in loaded:
            loaded[key] = Calibrator.load(path)
        return loaded[key]

    return load


def _threshold_lines(report: ThresholdReport) -> list[str]:
    """One line per threshold rule: its comparison with the certified value, and where it comes from."""
    lines = []
    for use in report.uses:
        text = " and ".join(use.comparisons)
        if not report.readable:
            lines.append(f"rule {use.rule}: {text}: threshold unknown (calibrator not readable)")
            continue
        if report.threshold is None:
            lines.append(f"rule {use.rule}: {text}: no certified threshold at alpha {report.alpha:g}")
            continue
        text = text.replace("threshold", f"threshold = {report.threshold:g}", 1)
        lines.append(f"rule {use.rule}: {text} ({_provenance(report)})")
    return lines


def _provenance(report: ThresholdReport) -> str:
    assert report.alpha is not None
    out = f"alpha {report.alpha:g} certified on {report.calibrator}"
    rec = report.record
    if rec is None:
        return out
    facts = [f"delta {rec.delta:g}" if rec.delta is not None else None,
             f"n={rec.n}" if rec.n is not None else None]
    if rec.n_accepted is not None and rec.coverage is not None:
        facts.append(f"accepts {rec.n_accepted} ({rec.coverage:.0%})")
    if rec.error_rate is not None:
        facts.append(f"error rate {rec.error_rate:.3f}")
    if rec.upper_bound is not None:
        facts.append(f"upper bound {rec.upper_bound:.3f}")
    shown = [f for f in facts if f]
    return out + (": " + ", ".join(shown) if shown else "")


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
    guard = open_guard(  # torch is imported only when a model is needed
        model_of(args.model, calibrator=args.calibrator, policy=args.file),
        sve=args.sve,
        policy=args.file,
        calibrator=args.calibrator,
        max_new_tokens=args.max_new_tokens,
        allow_uncertified=True,  # explaining a decision puts nothing live; Guard warns of such a pair
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
