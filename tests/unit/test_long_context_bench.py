"""benchmarks/long_context.py --quick: the benchmark's own pipeline on a tiny model (seconds)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOLQ = Path(os.environ.get("GUARDUQ_DATA", ROOT.parent / "shared" / "data")) / "boolq" / "dev.jsonl"


# The whole benchmark in quick mode, 40-100 s on 2 cores: `make test-bench`, not `make test`.
pytestmark = pytest.mark.bench

@pytest.mark.slow
@pytest.mark.skipif(not BOOLQ.is_file(), reason=f"its prompts are BoolQ passages: {BOOLQ} not found (set GUARDUQ_DATA)")
def test_long_context_quick_runs_every_table(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("long_context", None)
    import long_context

    assert long_context.main(["--quick", "--default-set", "last_n_blocks=2"]) == 0
    page = capsys.readouterr().out
    assert "guarded generation over `last_n_blocks=2`" in page
    for heading in ("Guarded generation against unguarded", "## Memory",
                    "Scoring cost per parameter set", "Where the time goes"):
        assert heading in page
    # every generation row has a positive ratio for both guarded modes
    rows = [line for line in page.splitlines() if line.startswith("| ") and "×** |" in line]
    assert len(rows) == 2
