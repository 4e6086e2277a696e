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

# The module that registers each command (``register(subparsers)``, setting ``func``). A command
# line names its command first, so ``main`` imports that one module only: `guarduq review` then
# starts without torch or scikit-learn. A test checks this table against what each module registers.
COMMANDS = {
    "score": "guarduq.cli.core", "generate": "guarduq.cli.core", "demo": "guarduq.cli.core",
    "calibrate": "guarduq.cli.calibrate", "evaluate": "guarduq.cli.calibrate", "report": "guarduq.cli.calibrate",
    "policy": "guarduq.cli.policy",
    "sve": "guarduq.cli.sve",
    "serve": "guarduq.cli.serve", "drift": "guarduq.cli.serve",
    "review": "guarduq.cli.review_page",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (``command``) one that knows only the module registering it."""
    parser = argparse.ArgumentParser(
        prog="guarduq", description="Per-response uncertainty guardrails for local LLMs.",
        **with_example("guarduq demo --policy policies/default.yaml",
                       "guarduq score --prompt 'Capital of France?' --response Paris"),
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v, -vv)")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command a command line names: its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command(argv))
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
