"""benchmarks/frontier.py on a synthetic cache: every parameter set gets a row, and every table on
the page is well formed (header, separator, then rows of the same width, nothing in between)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import load_benchmark
from tests.unit.test_scale_bench import _cache


def tables(page: str) -> list[list[str]]:
    """The page's markdown tables, each as its lines."""
    out: list[list[str]] = []
    lines = page.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---") and i > 0 and lines[i - 1].startswith("|"):
            j = i + 1
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(lines[i - 1:j])
    return out


def test_the_frontier_page_has_a_row_per_parameter_set_in_well_formed_tables(tmp_path: Path) -> None:
    _cache(tmp_path / "m.jsonl", informative=True, n_params=1_000_000, seed=5)
    mod = load_benchmark("frontier")
    assert mod.main(["--cache", f"m={tmp_path}/m.jsonl", "--out", str(tmp_path / "out"), "--n-boot", "20",
                     "--costs", f"m={tmp_path / 'none.json'}"]) == 0
    page = (tmp_path / "out" / "frontier.md").read_text()
    found = tables(page)
    assert len(found) >= 3
    for t in found:
        width = t[0].count("|")
        assert all(row.count("|") == width for row in t), t[:3]
        assert len(t) > 2, t  # rows follow the separator at once
    first = found[0]
    assert first[0].startswith("| parameters | log_epistemic AUROC")
    assert {row.split("|")[1].strip() for row in first[2:]} >= {"all", "last 1 block", "MLPs only"}
