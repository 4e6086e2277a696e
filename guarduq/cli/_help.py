"""``--help`` shows an example on every command: an argparse epilog, kept verbatim."""

from __future__ import annotations

import argparse
from typing import Any


def with_example(*commands: str) -> dict[str, Any]:
    """``add_parser`` keyword arguments that end the help text with example command lines."""
    lines = "\n".join(f"  {c}" for c in commands)
    return {
        "epilog": f"example{'s' if len(commands) > 1 else ''}:\n{lines}",
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }
