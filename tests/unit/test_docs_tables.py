"""Every markdown table in the README and the committed result pages is well formed: a header, its
separator, then at least one row, every row as wide as the header, nothing in between (a page
generator that splits or empties a table fails here, not in a reader's browser)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_frontier_bench import tables

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_is_well_formed(page: Path) -> None:
    for t in tables(page.read_text()):
        width = t[0].count("|")
        assert len(t) > 2, f"a table with no rows: {t[0][:80]}"
        bad = [row[:80] for row in t if row.count("|") != width]
        assert not bad, f"rows of another width than {t[0][:60]!r}: {bad[:3]}"
