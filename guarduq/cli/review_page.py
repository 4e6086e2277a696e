"""``guarduq review``: the reviewers' web page over a store, served by uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from guarduq.calibration.splits import THRESHOLD_FRACTION
from guarduq.cli._help import with_example
from guarduq.cli._keys import api_keys_from_env
from guarduq.cli.serve import check_bind, review_fraction
from guarduq.errors import GuardUQError, InputError

if TYPE_CHECKING:
    from guarduq.review import ReviewPageSettings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("review", help="web page to label sampled replies (queue, keys, progress, export)",
                       **with_example("guarduq review --store sqlite:///guarduq.db --policy policies/review.yaml",
                                      "guarduq review --store postgresql://reviews@db/guarduq --host 0.0.0.0 "
                                      "--api-key-env GUARDUQ_REVIEW_KEYS --alpha 0.2"))
    p.add_argument("--store", required=True, metavar="URL",
                   help="the store's database URL (sqlite:///path.db, postgresql+psycopg://...)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key-env", metavar="VAR",
                   help="environment variable holding the API key(s), comma-separated; reviewers sign "
                        "in with their name and a key")
    p.add_argument("--csrf-secret-env", metavar="VAR",
                   help="environment variable holding the secret that signs form tokens (16+ characters); "
                        "default: derived from the API keys (replicas sharing keys accept each other's "
                        "forms), or random per process without keys")
    p.add_argument("--allow-unauthenticated-remote", action="store_true",
                   help="bind a non-loopback host without an API key (not recommended)")
    p.add_argument("--policy", type=Path, help="YAML policy whose alpha the progress line counts towards")
    p.add_argument("--alpha", type=float, help="the target error rate to count towards (overrides --policy's)")
    p.add_argument("--delta", type=float, default=0.1, help="the certificate's confidence is 1 - delta")
    p.add_argument("--threshold-fraction", type=float,
                   help="share of the uniform labels guarduq calibrate certifies on (default: the "
                        f"--policy's review.threshold_fraction, which calibrate --policy uses too; else {THRESHOLD_FRACTION:g})")
    p.add_argument("--reviewer", default="reviewer", help="name stored with labels when a reviewer gives none")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_cmd_review)


def review_settings(args: argparse.Namespace, keys: tuple[str, ...]) -> ReviewPageSettings:
    """``ReviewPageSettings`` from the parsed flags (also used by ``guarduq serve --review``)."""
    from guarduq.review import ReviewPageSettings

    alpha, policy = args.alpha, None
    if getattr(args, "policy", None) is not None:
        from guarduq.policy import Policy

        policy = Policy.from_yaml(args.policy)
        alpha = policy.alpha if alpha is None else alpha
    fraction = getattr(args, "threshold_fraction", None)
    return ReviewPageSettings(api_keys=keys, alpha=alpha, delta=args.delta,
                          threshold_fraction=review_fraction(policy) if fraction is None else fraction,
                          reviewer_default=getattr(args, "reviewer", "reviewer"),
                          allow_unauthenticated_remote=args.allow_unauthenticated_remote,
                          csrf_secret=csrf_secret_from_env(getattr(args, "csrf_secret_env", None)))


def csrf_secret_from_env(var: str | None, flag: str = "--csrf-secret-env") -> bytes | None:
    """The CSRF secret held by environment variable ``var`` (None: no flag given)."""
    if var is None:
        return None
    bad = InputError(f"{flag} {var!r}: not a valid environment variable name")
    if not var or "=" in var or "\0" in var:
        raise bad
    try:
        raw = os.environ.get(var)
    except UnicodeError as exc:
        raise bad from exc
    if raw is None:
        raise InputError(f"{flag} {var}: the environment variable {var} is not set")
    secret = raw.strip().encode("utf-8", "surrogateescape")
    if len(secret) < 16:
        raise InputError(f"{flag} {var}: the secret must be at least 16 characters")
    return secret


def _cmd_review(args: argparse.Namespace) -> int:
    keys = api_keys_from_env(args.api_key_env)
    check_bind(args.host, has_key=bool(keys), allow_unauthenticated_remote=args.allow_unauthenticated_remote)
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be 1 to 65535, got {args.port}")
    try:
        import uvicorn

        from guarduq.review import create_review_app
        from guarduq.store import Store
    except ImportError as exc:
        raise GuardUQError(f"the review page needs the review extra: pip install 'guarduq[review]' ({exc})") from exc

    settings = review_settings(args, keys)
    store = Store(args.store)
    try:
        app = create_review_app(store, settings)
        print(f"guarduq: review page on http://{args.host}:{args.port}/  "
              f"auth={'on' if keys else 'off (loopback only)'}  alpha={settings.alpha}",
              file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        store.close()
    return 0
