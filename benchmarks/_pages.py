"""Shared by the benchmark scripts: regenerate a results page without losing its prose, write a
report's JSON, and state the command that reproduces a run."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def write_json(out: Path, report: dict[str, Any]) -> None:
    """The run's report as indented JSON, its folder made where missing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


def rerun_command(script: str, argv: Sequence[str] | None, omp_threads: str | None) -> str:
    """The command a results page states: ``benchmarks/<script>`` with this run's arguments
    (``argv``, else the command line's) and its OMP_NUM_THREADS where one was set."""
    omp = f"OMP_NUM_THREADS={omp_threads} " if omp_threads else ""
    args = sys.argv[1:] if argv is None else argv
    return f"{omp}.venv/bin/python benchmarks/{script} {' '.join(args)}".strip()


def write_whole_page(path: Path, text: str) -> None:
    """A page the script writes whole (no hand-written prose kept), said on stderr."""
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
