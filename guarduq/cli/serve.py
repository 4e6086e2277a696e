"""``guarduq serve`` (the OpenAI-compatible server) and ``guarduq drift`` (the offline check)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from guarduq._http import is_loopback
from guarduq.aliases import DEFAULT_MODEL
from guarduq.cli._help import with_example
from guarduq.cli._keys import api_keys_from_env, door_keys
from guarduq.cli._run import (
    check_sve_file,
    model_of,
    open_guard,
    parameter_kwargs,
    parameter_set_arg,
    sve_arg,
    threads_arg,
)
from guarduq.errors import GuardUQError, InputError, UncertifiedPairError

__all__ = ["api_keys_from_env", "check_bind", "door_keys", "register", "review_fraction"]  # old paths kept


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible chat-completions server with a policy",
                       **with_example("guarduq serve --model smollm2-135m-instruct --policy policies/default.yaml "
                                      "--audit audit.jsonl --port 8000"))
    p.add_argument("--model", help="alias, folder, hub id or .gguf (default: the model the calibrator "
                                   f"was fitted for, else {DEFAULT_MODEL})")
    threads_arg(p)
    parameter_set_arg(p)
    p.add_argument("--policy", type=Path, help="YAML policy (decides what clients see)")
    p.add_argument("--calibrator", type=Path, help="calibrator JSON (default: the policy's)")
    sve_arg(p)
    p.add_argument("--audit", type=Path, help="append one JSON line per request to this file")
    p.add_argument("--store", metavar="URL",
                   help="keep every decided reply, and the policy's review sample, in this database "
                        "(sqlite:///guarduq.db, postgresql://...; replicas may share one PostgreSQL)")
    p.add_argument("--review", action="store_true",
                   help="serve the reviewers' page under /review (needs --store; its own keys: "
                        "--review-key-env)")
    p.add_argument("--review-key-env", metavar="VAR",
                   help="environment variable holding the reviewers' key(s) for /review, comma-separated "
                        "(API keys do not open /review, review keys open nothing else); needed with "
                        "--review when the API has keys")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-env", metavar="VAR",
                   help="environment variable holding the API key(s), comma-separated; an entry NAME:KEY "
                        "names its key (NAME: [A-Za-z0-9_.-], 1-64), and under a policy's groups.from_key "
                        "its requests belong to traffic group NAME")
    p.add_argument("--admin-key-env", metavar="VAR",
                   help="environment variable holding the admin key(s) for POST /admin/reload "
                        "(separate from the API keys; without it /admin/* answers 403)")
    p.add_argument("--watch", action="store_true",
                   help="reload the policy and calibrator when their files change (SIGHUP always does)")
    p.add_argument("--watch-interval", type=float, default=2.0, metavar="S",
                   help="seconds between --watch polls of the files' mtime and size")
    p.add_argument("--allow-uncertified", action="store_true",
                   help="start even when a threshold rule of the policy can never match under its "
                        "calibrator (no threshold certified at its alpha: every reply the rule would "
                        "let through is withheld; `guarduq policy check --strict` says why); without it "
                        "serve refuses such a pair, as its reloads do")
    p.add_argument("--allow-unauthenticated-remote", action="store_true",
                   help="bind a non-loopback host without an API key, and answer any Host header "
                        "(without a key every route answers only loopback names; not recommended)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    p.add_argument("--max-body-bytes", type=int, default=1_000_000)
    p.add_argument("--max-messages", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=32_000)
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=512, help="largest max_tokens a client may ask")
    p.add_argument("--default-max-tokens", type=int, help="when a request gives none (default 64)")
    p.add_argument("--batching", choices=("on", "off"), default="on",
                   help="micro-batch queued requests when the Guard has generate_batch")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--reference", type=Path,
                   help="drift reference: score JSONL (default: the calibrator's evaluation_data)")
    p.add_argument("--drift-window", type=int, default=500)
    p.add_argument("--model-name", action="append", default=[],
                   help="name clients use in 'model' (repeatable; default: the model's name)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_cmd_serve)

    d = sub.add_parser("drift", help="compare an audit log's scores with a calibrator's data (PSI, KS)",
                       **with_example("guarduq drift --audit audit.jsonl "
                                      "--calibrator policies/calibrators/smollm2-135m-instruct.json --out drift.png"))
    d.add_argument("--audit", type=Path, required=True, help="audit JSONL (guarduq serve --audit)")
    d.add_argument("--calibrator", type=Path, help="calibrator JSON whose evaluation_data is the reference")
    d.add_argument("--reference", type=Path, help="score JSONL to use as the reference instead")
    d.add_argument("--last", type=int, help="only the last N audit lines (the live window)")
    d.add_argument("--out", type=Path, help="write a PNG of reference vs live per feature")
    d.add_argument("--json", action="store_true")
    d.add_argument("--fail-on-alarm", action="store_true", help="exit 1 when any feature is in alarm")
    d.set_defaults(func=_cmd_drift)


def review_fraction(policy: Any) -> float:
    """The threshold fraction the progress line counts with: the policy's ``review`` section,
    which ``guarduq calibrate --dataset reviews --policy`` splits by too."""
    from guarduq.policy.schema import ReviewSettings

    review = policy.config.review if policy is not None else ReviewSettings()
    return float(review.threshold_fraction)


def check_bind(host: str, *, has_key: bool, allow_unauthenticated_remote: bool) -> None:
    """Refuse to expose an unauthenticated server beyond this machine unless told to."""
    if has_key or allow_unauthenticated_remote or is_loopback(host):
        return
    raise InputError(
        f"refusing to listen on {host!r} without an API key: use --api-key-env VAR, bind 127.0.0.1, "
        "or pass --allow-unauthenticated-remote"
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    doors = door_keys(args)
    keys, admin_keys, review_keys = doors.api, doors.admin, doors.review
    if not args.watch_interval > 0:
        raise InputError(f"--watch-interval must be > 0 seconds, got {args.watch_interval}")
    check_bind(args.host, has_key=bool(keys), allow_unauthenticated_remote=args.allow_unauthenticated_remote)
    if args.sve is not None:
        check_sve_file(args.sve)  # before the store is opened or the model loads
    try:
        import uvicorn

        from guarduq.serve import Settings, create_app
    except ImportError as exc:
        raise GuardUQError(f"the server needs the serve extra: pip install 'guarduq[serve]' ({exc})") from exc
    from guarduq.calibration.drift import load_reference

    if args.review and not args.store:
        raise InputError("--review serves the page over a store: give --store URL too")
    store = None
    if args.store:
        from guarduq.store import Store

        store = Store(args.store)  # a bad URL or an unreachable database fails before the model loads
    args.model = model_of(args.model, calibrator=args.calibrator, policy=args.policy)
    try:
        guard = open_guard(args.model, sve=args.sve, policy=args.policy, calibrator=args.calibrator,
                           audit=args.audit, store=store, allow_uncertified=args.allow_uncertified,
                           **parameter_kwargs(args.parameter_set))
    except UncertifiedPairError as exc:  # the check every reload makes: nothing uncertified goes live
        raise UncertifiedPairError(f"refusing to serve: {exc.problem} (`guarduq policy check --strict` says "
                                   "the same; --allow-uncertified starts it anyway)", exc.problem) from None
    features = guard.calibrator.features if guard.calibrator is not None else ()
    settings = Settings(
        model_ids=tuple(dict.fromkeys([*args.model_name, guard.info.name, str(args.model)])),
        api_keys=keys, api_key_names=doors.api_names, admin_keys=admin_keys, reload_on_sighup=True,
        allow_unauthenticated_remote=args.allow_unauthenticated_remote,
        watch_s=args.watch_interval if args.watch else None,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        max_messages=args.max_messages, max_prompt_chars=args.max_prompt_chars,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
        default_max_tokens=args.default_max_tokens, batching=args.batching == "on",
        max_batch=args.max_batch, drift_window=args.drift_window,
        drift_reference=load_reference(args.reference, features) if args.reference else None,
    )
    app = create_app(guard, settings=settings)
    if args.review:
        from guarduq.review import ReviewPageSettings, mount_review

        mount_review(app, store, ReviewPageSettings(api_keys=review_keys,
                                                    allow_unauthenticated_remote=args.allow_unauthenticated_remote),
                     alpha_of=lambda: guard.policy.alpha if guard.policy is not None else None,
                     fraction_of=lambda: review_fraction(guard.policy))
    from guarduq.decider import uncertified

    forced = args.allow_uncertified and uncertified(guard.decider) is not None  # Guard logged a warning
    print(f"guarduq: serving {guard.info.name} ({guard.info.fingerprint[:12]}) on http://{args.host}:"
          f"{args.port}/v1  policy={guard.policy.name if guard.policy else None}  "
          f"auth={'on' if keys else 'off'}  reload=SIGHUP{', --watch' if args.watch else ''}"
          f"{', POST /admin/reload' if admin_keys else ''}"
          f"{'' if keys or args.allow_unauthenticated_remote else '  host=loopback names only'}"
          f"{f'  store={store!r}' if store is not None else ''}{'  review=/review' if args.review else ''}"
          f"{'  UNCERTIFIED pair (--allow-uncertified; the warning above says which rule never matches)' if forced else ''}",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def _cmd_drift(args: argparse.Namespace) -> int:
    from guarduq.calibration.drift import compare, load_reference, read_score_records
    from guarduq.calibration.drift_groups import CaseClassifier

    if (args.calibrator is None) == (args.reference is None):
        raise InputError("give exactly one of --calibrator C.json or --reference scores.jsonl")
    if not args.audit.is_file():
        raise InputError(f"audit log not found: {args.audit}")
    ref = load_reference(args.reference or args.calibrator)
    records, skipped = read_score_records(args.audit)
    if args.last:
        records = records[-args.last:]
    if not records:
        raise InputError(f"{args.audit} holds no scored requests")
    rows = compare(ref, records)
    # The scaled statistic hardly depends on the window's size, so thresholds set on windows of at
    # most 1,000 serve a longer log too (and keep the bootstrap to about a second).
    case = (CaseClassifier(ref.grouped, window=min(len(records), 1000)).classify_records(records)
            if ref.grouped else None)
    if args.json:
        print(json.dumps({"reference": ref.source, "n_live": len(records), "skipped_lines": skipped,
                          "features": [r.to_dict() for r in rows],
                          "case": case.label if case else None,
                          "nearest_group": case.nearest if case else None,
                          "cases": case.to_dict() if case else None}))
    else:
        print(f"reference: {ref.source}\nlive: {args.audit} ({len(records)} scored, {skipped} skipped)")
        print(f"{'feature':<16} {'n':>6} {'PSI':>8} {'KS':>6}  level   (PSI: <0.1 ok, <0.25 watch, else alarm)")
        for r in rows:
            print(f"{r.feature:<16} {r.n:>6} {r.psi:>8.3f} {r.ks:>6.3f}  {r.level}")
        if case is not None:
            print(f"case: {case.label}  (mix distance {case.mix_distance:.2f}, threshold {case.mix_threshold:.2f}; "
                  f"nearest calibration group: {case.nearest})")
            print("  ok: like the calibration mix; slice:G: like one group G it was fitted on; "
                  "unseen: like none of them (its risk is untested here)")
    if args.out:
        _plot(ref, records, rows, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if args.fail_on_alarm and any(r.level == "alarm" for r in rows) else 0


def _plot(ref: Any, records: list[dict[str, Any]], rows: list[Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from guarduq.calibration.drift import feature_values

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        r, live = ref.values[row.feature], np.asarray(feature_values(records, row.feature))
        both = np.concatenate([r, live]) if live.size else r
        bins = np.linspace(both.min(), both.max(), 25) if both.max() > both.min() else 10
        ax.hist(r, bins=bins, density=True, alpha=0.5, label=f"reference (n={r.size})")
        if live.size:
            ax.hist(live, bins=bins, density=True, alpha=0.5, label=f"live (n={live.size})")
        ax.set_title(f"{row.feature}: PSI {row.psi:.3f}, KS {row.ks:.3f} ({row.level})")
        ax.set_xlabel(row.feature)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
