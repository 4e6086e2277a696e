"""NQ-open loader: its JSONL shape, alias labelling like TriviaQA, bad rows by line number."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from guarduq.calibration.datasets import DATASETS, load_dataset
from guarduq.calibration.labels import label_response
from guarduq.errors import DatasetError

ROWS = [
    {"question": "when was the last time anyone was on the moon", "answer": ["14 December 1972 UTC", "December 1972"]},
    {"question": "who wrote he ain't heavy he's my brother lyrics", "answer": ["Bobby Scott", "Bob Russell"]},
    {"question": "how many seasons of the bastard executioner are there", "answer": ["one", "one season"]},
]


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_nq_open_items_and_labels(tmp_path: Path) -> None:
    ds = load_dataset("nq-open", _write(tmp_path / "nq.jsonl", ROWS))
    assert "nq-open" in DATASETS and len(ds) == 3
    moon, song, seasons = ds.items
    assert moon.kind == "qa" and moon.grader == "alias" and moon.dataset == "nq-open"
    assert moon.id.startswith("nq-open:") and moon.answers == ("14 December 1972 UTC", "December 1972")
    assert moon.question == "When was the last time anyone was on the moon?"
    assert moon.prompt == "Answer briefly: When was the last time anyone was on the moon?"
    # Normalised match: case, punctuation and articles do not matter; containment counts.
    assert label_response(moon, "It was in December, 1972.") == 1
    assert label_response(moon, "July 1969") == 0
    assert label_response(song, "The lyrics were written by Bob Russell") == 1
    assert label_response(seasons, "One.") == 1 and label_response(seasons, "two seasons") == 0
    # Ids are stable across loads (the split and the cache are keyed by them).
    assert [it.id for it in load_dataset("nq-open", tmp_path / "nq.jsonl").items] == [it.id for it in ds.items]


def test_nq_open_fewshot_prompt(tmp_path: Path) -> None:
    ds = load_dataset("nq-open", _write(tmp_path / "nq.jsonl", ROWS[:1]), prompt_style="fewshot")
    assert ds.items[0].prompt.endswith("Q: When was the last time anyone was on the moon?\nA:")
    assert ds.items[0].stop_strings == ("\n",)


@pytest.mark.parametrize(
    ("row", "message"),
    [({"answer": ["x"]}, "missing field 'question'"), ({"question": "q", "answer": []}, "no non-empty"),
     ({"question": "q", "answer": 3}, "type int")],
)
def test_nq_open_bad_rows_name_their_line(tmp_path: Path, row: dict[str, object], message: str) -> None:
    path = _write(tmp_path / "nq.jsonl", [ROWS[0], row])
    with pytest.raises(DatasetError, match=f"line 2: .*{message}"):
        load_dataset("nq-open", path)
    assert len(load_dataset("nq-open", path, skip_malformed=True)) == 1


def test_the_shared_nq_open_file_loads() -> None:
    data = os.environ.get("GUARDUQ_DATA") or Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
    path = Path(data) / "nq_open" / "NQ-open.dev.jsonl"
    if not path.exists():
        pytest.skip("shared data not present")
    ds = load_dataset("nq-open", path, limit=50)
    assert len(ds) == 50 and all(it.answers for it in ds.items)
