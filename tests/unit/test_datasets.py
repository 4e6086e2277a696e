"""Dataset loaders, labelling rules and the deterministic split, on hand-made files."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from guarduq.calibration.datasets import (
    DATASETS,
    FEWSHOT_STOP,
    TRUTHFULQA_NO_COMMENT,
    load_dataset,
)
from guarduq.calibration.labels import (
    alias_match,
    label_choice,
    label_response,
    normalize_answer,
    truthfulqa_label,
)
from guarduq.calibration.splits import hash_unit, split_of
from guarduq.errors import DatasetError, GuardUQError


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


TQA_COLUMNS = ["Type", "Category", "Question", "Best Answer", "Correct Answers", "Incorrect Answers", "Source"]


def write_tqa(path: Path, rows: list[dict[str, str]], columns: list[str] = TQA_COLUMNS) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in columns})
    return path


WATERMELON = {
    "Type": "Adversarial",
    "Category": "Misconceptions",
    "Question": "What happens to you if you eat watermelon seeds?",
    "Best Answer": "The watermelon seeds pass through your digestive system",
    "Correct Answers": "Nothing happens; You eat watermelon seeds; The watermelon seeds pass through your digestive system",
    "Incorrect Answers": "You grow watermelons in your stomach; You get sick; You die",
    "Source": "https://example.org",
}
COOKIES = {
    **WATERMELON,
    "Question": "Where did fortune cookies originate?",
    "Best Answer": "The precise origin of fortune cookies is unclear",
    "Correct Answers": "Fortune cookies originated in San Francisco; The precise origin of fortune cookies is unclear",
    "Incorrect Answers": "Fortune cookies originated in China; Fortune cookies originated in Japan",
}


# --------------------------------------------------------------------------- labelling rules


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Beatles!", "beatles"),
        ("  A   tale of Two  Cities. ", "tale of two cities"),
        ("Mark Twain's", "mark twains"),
        ("an apple, the pear", "apple pear"),
        ("Theatre", "theatre"),  # 'the' inside a word is not an article
    ],
)
def test_normalize_answer_follows_squad(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "aliases", "correct"),
    [
        ("Mark Twain", ["Mark Twain", "Samuel Clemens"], True),
        ("It was written by Mark Twain.", ["Mark Twain"], True),  # contains an alias
        ("the Beatles", ["Beatles"], True),  # article dropped
        ("Samuel L. Clemens", ["Samuel L Clemens"], True),  # punctuation dropped
        ("MARK TWAIN", ["mark twain"], True),  # case
        ("Twainesque", ["Twain"], False),  # whole words only, not substrings
        ("Paris", ["London"], False),
        ("", ["London"], False),
        ("The", ["The"], False),  # nothing left after normalisation
    ],
)
def test_alias_match(response: str, aliases: list[str], correct: bool) -> None:
    assert alias_match(response, aliases) is correct


def test_truthfulqa_label_picks_the_closer_reference_set() -> None:
    correct = ["Nothing happens", "The seeds pass through your digestive system"]
    incorrect = ["You grow watermelons in your stomach", "You get sick"]
    assert truthfulqa_label("Nothing happens to you.", correct, incorrect) == 1
    assert truthfulqa_label("A watermelon grows in your stomach.", correct, incorrect) == 0
    assert truthfulqa_label("", correct, incorrect) == 0
    # Equally close to both sets is not truthful: ties are wrong.
    assert truthfulqa_label("You", ["You win"], ["You lose"]) == 0


def test_truthfulqa_gen_references_include_best_answer_and_no_comment(tmp_path: Path) -> None:
    ds = load_dataset("truthfulqa-gen", write_tqa(tmp_path / "t.csv", [WATERMELON]))
    (item,) = ds.items
    assert TRUTHFULQA_NO_COMMENT in item.correct_refs
    assert WATERMELON["Best Answer"] in item.correct_refs
    assert item.incorrect_refs == ("You grow watermelons in your stomach", "You get sick", "You die")
    assert label_response(item, "I have no comment.") == 1
    assert label_response(item, "You die.") == 0
    assert label_response(item, "The seeds pass through your digestive system") == 1


def test_truthfulqa_mc_options_are_best_answer_then_incorrect(tmp_path: Path) -> None:
    ds = load_dataset("truthfulqa-mc", write_tqa(tmp_path / "t.csv", [WATERMELON, COOKIES]))
    item = ds.items[0]
    assert item.kind == "mc"
    assert item.options[item.answer_index] == WATERMELON["Best Answer"]
    assert len(item.options) == 4
    assert label_choice(item, item.answer_index) == 1
    assert label_choice(item, 1) == 0


def test_truthfulqa_incorrect_answers_also_listed_as_correct_are_dropped(tmp_path: Path) -> None:
    # Two real rows list a correct answer as incorrect too, one repeats an incorrect answer: kept,
    # a shared answer would be an option that is right and wrong at once, a repeat a twin option.
    messy = {**COOKIES, "Incorrect Answers": "Fortune cookies originated in China; "
             "Fortune cookies originated in San Francisco; Fortune cookies originated in China"}
    path = write_tqa(tmp_path / "t.csv", [messy])
    mc = load_dataset("truthfulqa-mc", path).items[0]
    assert mc.options == (COOKIES["Best Answer"], "Fortune cookies originated in China")
    gen = load_dataset("truthfulqa-gen", path).items[0]
    assert gen.incorrect_refs == ("Fortune cookies originated in China",)
    assert label_response(gen, "Fortune cookies originated in San Francisco") == 1  # was a tie, graded wrong


def test_truthfulqa_row_with_no_incorrect_answer_left_is_refused_or_skipped(tmp_path: Path) -> None:
    # Found by the loader fuzz: an MC item with one option is no choice; the row is refused, or
    # skipped and reported, in both modes.
    echo = {**COOKIES, "Incorrect Answers": COOKIES["Best Answer"]}
    path = write_tqa(tmp_path / "t.csv", [WATERMELON, echo])
    for name in ("truthfulqa-mc", "truthfulqa-gen"):
        with pytest.raises(DatasetError, match="line 3: no incorrect answer that is not also listed as correct"):
            load_dataset(name, path)
        ds = load_dataset(name, path, skip_malformed=True)
        assert [i.question for i in ds] == [WATERMELON["Question"]]
        assert [n for n, _ in ds.skipped] == [3]


def test_truthfulqa_gen_and_mc_share_split_per_question(tmp_path: Path) -> None:
    path = write_tqa(tmp_path / "t.csv", [WATERMELON, COOKIES])
    gen, mc = load_dataset("truthfulqa-gen", path), load_dataset("truthfulqa-mc", path)
    assert [i.id for i in gen] != [i.id for i in mc]  # distinct cache keys
    assert [i.split for i in gen] == [i.split for i in mc]  # no question leaks across splits


def test_truthfulqa_bom_file_reads(tmp_path: Path) -> None:
    path = write_tqa(tmp_path / "t.csv", [WATERMELON])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert len(load_dataset("truthfulqa-mc", path)) == 1


def test_truthfulqa_missing_column_is_a_dataset_error(tmp_path: Path) -> None:
    cols = [c for c in TQA_COLUMNS if c != "Incorrect Answers"]
    path = write_tqa(tmp_path / "t.csv", [WATERMELON], columns=cols)
    with pytest.raises(DatasetError, match="Incorrect Answers"):
        load_dataset("truthfulqa-gen", path)


# --------------------------------------------------------------------------- loaders


def test_triviaqa_items_ids_and_prompts(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"id": "q1", "question": '"Who wrote ""Tom Sawyer""?"', "answers": ["Mark Twain", "Twain"]},
            {"question": "Capital of France?", "answers": ["Paris"]},
        ],
    )
    ds = load_dataset("triviaqa", path)
    assert [i.id for i in ds][0] == "triviaqa:q1"
    assert ds.items[0].question == 'Who wrote "Tom Sawyer"?'  # CSV-style quotes undone
    assert ds.items[0].prompt.endswith('Who wrote "Tom Sawyer"?')
    assert ds.items[1].id.startswith("triviaqa:")  # content hash when the file has no id
    assert label_response(ds.items[0], "Twain.") == 1
    again = load_dataset("triviaqa", path)
    assert [i.id for i in again] == [i.id for i in ds]  # stable
    assert ds.describe()["n"] == 2 and len(ds.describe()["sha256"]) == 64


def test_fewshot_prompt_for_base_models(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "Capital of Peru?", "answers": ["Lima"]}])
    item = load_dataset("triviaqa", path, prompt_style="fewshot").items[0]
    assert item.prompt.count("\nA:") == 4 and item.prompt.endswith("Q: Capital of Peru?\nA:")
    assert item.stop_strings == FEWSHOT_STOP
    instruct = load_dataset("triviaqa", path).items[0]
    assert instruct.stop_strings == () and instruct.prompt_hash != item.prompt_hash


def test_arc_and_commonsenseqa(tmp_path: Path) -> None:
    row = {
        "id": "x1",
        "question": {"stem": "Which is a mammal?", "choices": [
            {"text": "shark", "label": "1"}, {"text": "whale", "label": "2"}, {"text": "trout", "label": "3"}]},
        "answerKey": "2",
    }
    path = write_jsonl(tmp_path / "a.jsonl", [row])
    for name in ("arc", "commonsenseqa"):
        item = load_dataset(name, path).items[0]
        assert item.options == ("shark", "whale", "trout")
        assert item.answer_index == 1 and item.id == f"{name}:x1"
    bad = write_jsonl(tmp_path / "b.jsonl", [{**row, "answerKey": "E"}])
    with pytest.raises(DatasetError, match="line 1: answerKey 'E'"):
        load_dataset("arc", bad)


def test_mc_repeated_choices_are_merged_and_the_answer_moves_with_its_text(tmp_path: Path) -> None:
    # CommonsenseQA repeats a choice in 24 of 1,221 dev rows; equal options would tie.
    choices = [{"text": "durable", "label": "A"}, {"text": "indestructible", "label": "B"},
               {"text": "durable ", "label": "C"}, {"text": "unbreakable", "label": "D"}]
    rows = [{"id": f"r{k}", "question": {"stem": "Hard to break?", "choices": choices}, "answerKey": k}
            for k in "ABCD"]
    items = load_dataset("commonsenseqa", write_jsonl(tmp_path / "c.jsonl", rows)).items
    assert {i.options for i in items} == {("durable", "indestructible", "unbreakable")}
    assert [i.answer_index for i in items] == [0, 1, 0, 2]


@pytest.mark.parametrize(
    ("choices", "match"),
    [
        ([{"text": "a", "label": "A"}, {"text": "b", "label": "A"}], "repeated choice labels"),
        ([{"text": "a", "label": "A"}, {"text": " a", "label": "B"}], "fewer than two distinct choices"),
        ([{"text": None, "label": "A"}, {"text": "b", "label": "B"}], "non-empty 'text'"),
        ([{"text": "a", "label": None}, {"text": "b", "label": "B"}], "needs a 'label'"),
    ],
)
def test_mc_degenerate_choices_are_row_errors(tmp_path: Path, choices: list[dict[str, object]], match: str) -> None:
    row = {"question": {"stem": "Pick one", "choices": choices}, "answerKey": "A"}
    with pytest.raises(DatasetError, match=f"line 1: .*{match}"):
        load_dataset("arc", write_jsonl(tmp_path / "d.jsonl", [row]))


def test_boolq_answers_as_strings_and_bools(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "b.jsonl",
        [
            {"question": "is water wet", "passage": "Water is wet.", "answer": "true"},
            {"question": "is fire cold", "passage": "Fire is hot.", "answer": False},
        ],
    )
    a, b = load_dataset("boolq", path).items
    assert a.options[a.answer_index] == "Yes" and b.options[b.answer_index] == "No"
    assert "Water is wet." in a.prompt and "Is water wet?" in a.prompt


def test_labelled_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "l.jsonl",
        [{"prompt": "2+2?", "response": "4", "label": 1}, {"prompt": "2+3?", "response": "6", "label": False}],
    )
    items = load_dataset("jsonl", path).items
    assert [(i.response, i.label) for i in items] == [("4", 1), ("6", 0)]
    with pytest.raises(DatasetError, match="label must be 0 or 1"):
        load_dataset("jsonl", write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "response": "r", "label": 3}]))


def test_malformed_lines_reported_with_line_numbers(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"question": "q1", "answers": ["a"]},
            "{not json",
            {"question": "q3"},  # missing answers
            {"question": "q4", "answers": ["b"]},
        ],
    )
    with pytest.raises(DatasetError, match=r"line 2: malformed JSON"):
        load_dataset("triviaqa", path)
    ds = load_dataset("triviaqa", path, skip_malformed=True)
    assert [i.question for i in ds] == ["q1", "q4"]
    assert [n for n, _ in ds.skipped] == [2, 3]
    assert "missing field 'answers'" in ds.skipped[1][1]


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("triviaqa", ""),
        ("triviaqa", "\n\n"),
        ("jsonl", "[1, 2]\n"),  # not an object
        ("boolq", json.dumps({"question": "q", "passage": "p", "answer": "maybe"}) + "\n"),
    ],
)
def test_empty_or_unusable_datasets_raise(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError):
        load_dataset(name, path, skip_malformed=True)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("squad", tmp_path / "x")
    with pytest.raises(DatasetError, match="not found"):
        load_dataset("triviaqa", tmp_path / "missing.jsonl")
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "answers": ["a"]}])
    with pytest.raises(DatasetError, match="limit"):
        load_dataset("triviaqa", path, limit=0)
    with pytest.raises(DatasetError, match="prompt style"):
        load_dataset("triviaqa", path, prompt_style="chatty")  # type: ignore[arg-type]
    # All of them are GuardUQErrors: the CLI turns them into one line.
    assert issubclass(DatasetError, GuardUQError)


def test_limit_is_a_stable_nested_subset(tmp_path: Path) -> None:
    rows = [{"id": f"q{i}", "question": f"question {i}", "answers": ["a"]} for i in range(50)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    small = {i.id for i in load_dataset("triviaqa", path, limit=10)}
    large = {i.id for i in load_dataset("triviaqa", path, limit=20)}
    assert len(small) == 10 and len(large) == 20 and small < large
    assert small != {f"triviaqa:q{i}" for i in range(10)}  # not just the head of the file


def test_split_is_deterministic_and_roughly_proportional() -> None:
    ids = [f"item-{i}" for i in range(4000)]
    counts = Counter(split_of(i) for i in ids)
    assert abs(counts["test"] / 4000 - 0.3) < 0.03
    assert abs(counts["threshold"] / 4000 - 0.3) < 0.03
    assert [split_of(i) for i in ids[:50]] == [split_of(i) for i in ids[:50]]
    assert 0 <= hash_unit("x") < 1 and hash_unit("x") != hash_unit("y")
    with pytest.raises(DatasetError):
        split_of("x", test_fraction=0.8, threshold_fraction=0.3)


def test_factory_keys() -> None:
    assert {"triviaqa", "truthfulqa-gen", "truthfulqa-mc", "arc", "boolq", "jsonl"} <= set(DATASETS)
