"""structlog without touching global configuration.

A library must not configure logging for its host application. guarduq's loggers render
structured events to the stdlib logger ``guarduq``; the host (or ``guarduq.cli``) decides where
that goes. ``configure_cli_logging`` is the one place that attaches a handler.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_STDLIB = logging.getLogger("guarduq")


def _renderer() -> Any:
    if sys.stderr.isatty():
        return structlog.dev.ConsoleRenderer(colors=False)
    return structlog.processors.JSONRenderer(sort_keys=True)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A structlog logger bound to ``component=name`` that writes through stdlib logging."""
    return structlog.wrap_logger(
        _STDLIB,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _renderer(),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        component=name,
    )


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record is emitted, as stdlib's last-resort handler
    does: a stream captured at set-up may since have been redirected or closed (a host calling
    ``cli.main`` repeatedly, test capture), and writing to it prints a "Logging error" traceback."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it; always sys.stderr
        pass


def configure_cli_logging(level: int = logging.WARNING) -> None:
    """Send guarduq's events to stderr at ``level`` (used by the CLI only)."""
    if not any(getattr(h, "_guarduq", False) for h in _STDLIB.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._guarduq = True  # type: ignore[attr-defined]
        _STDLIB.addHandler(handler)
    _STDLIB.setLevel(level)
    _STDLIB.propagate = False
