"""The ``guarduq`` command line. Each sub-module registers its own sub-commands.

Every ``GuardUQError`` becomes one line on stderr and exit status 2; nothing deep in torch
reaches the user as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from guarduq._logging import configure_cli_logging
from guarduq.cli._help import with_example
from guarduq.cli._run import apply_threads
from guarduq.errors import GuardUQError

# Modules that define ``register(subparsers)``; each sets ``func`` on its parsers.
_COMMAND_MODULES = (
    "guarduq.cli.core",
    "guarduq.cli.calibrate",
    "guarduq.cli.policy",
    "guarduq.cli.sve",
    "guarduq.cli.serve",
    "guarduq.cli.review_page",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guarduq", description="Per-response uncertainty guardrails for local LLMs.",
        **with_example("guarduq demo --policy policies/default.yaml",
                       "guarduq score --prompt 'Capital of France?' --response Paris"),
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v, -vv)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_cli_logging(level=[30, 20, 10][min(args.verbose, 2)])
    if not args.verbose:
        # Library loading bars and advisories are noise on a CLI; guarduq shows its own progress.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        apply_threads(getattr(args, "threads", None))
        return int(args.func(args) or 0)
    except GuardUQError as exc:
        print(f"guarduq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("guarduq: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
