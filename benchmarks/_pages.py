"""Shared by the benchmark scripts: regenerate a results page without losing its prose."""

from __future__ import annotations

import os
from pathlib import Path

BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"


def write_page(path: Path, body: str, title: str) -> None:
    """Replace the GENERATED block, keep the hand-written text around it (atomic write)."""
    block = f"{BEGIN}\n{body}\n{END}"
    if path.exists() and BEGIN in (old := path.read_text()) and END in old:
        head, rest = old.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = f"# {title}\n\n{block}\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
