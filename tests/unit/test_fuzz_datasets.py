"""Fuzz every dataset loader: malformed rows, wrong encodings, BOMs, empty files, huge fields."""

from __future__ import annotations

import csv
import functools
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from guarduq.calibration.datasets import DATASETS, Dataset, load_dataset
from guarduq.calibration.labels import label_choice, label_response
from guarduq.errors import GuardUQError
from guarduq.layout import validate_prompt
from tests.unit.fuzz_support import clean, examples, json_values, junk, texts

pytestmark = pytest.mark.fuzz

HUGE = "h" * 200_000
words = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30).filter(
    str.strip)
field_text = st.one_of(*[words] * 12, texts, texts, st.just(HUGE))


def maybe(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    """``maybe(valid..., bad)``: mostly a valid value for the field, one time in five the bad one."""
    *valid, bad = strategies
    return st.one_of(st.one_of(*valid), st.one_of(*valid), st.one_of(*valid), st.one_of(*valid), bad)



ROWS = {
    "triviaqa": st.fixed_dictionaries(
        {"question": maybe(field_text, json_values), "answers": maybe(st.lists(field_text, max_size=3), json_values)},
        optional={"id": maybe(texts, json_values)},
    ),
    "arc": st.fixed_dictionaries(
        {
            "question": maybe(
                st.fixed_dictionaries({
                    "stem": maybe(field_text, json_values),
                    "choices": maybe(st.lists(st.fixed_dictionaries(
                        {"label": maybe(st.sampled_from("ABCD"), json_values), "text": maybe(field_text, json_values)}
                    ), min_size=2, max_size=4), json_values),
                }),
                json_values,
            ),
            "answerKey": maybe(st.sampled_from("ABCD"), st.integers(-1, 5), json_values),
        },
        optional={"id": maybe(texts, json_values)},
    ),
    "boolq": st.fixed_dictionaries(
        {"question": maybe(field_text, json_values), "passage": maybe(field_text, json_values),
         "answer": maybe(st.booleans(), st.sampled_from(["true", "False", " TRUE ", "yes"]), json_values)},
        optional={"id": maybe(texts, json_values)},
    ),
    "jsonl": st.fixed_dictionaries(
        {"prompt": maybe(field_text, json_values), "response": maybe(field_text, json_values),
         "label": maybe(st.sampled_from([0, 1, True, False]), json_values)},
        optional={"id": maybe(texts, json_values)},
    ),
}
ROWS["reviews"] = st.fixed_dictionaries(
    {"prompt": maybe(field_text, st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | field_text, "content": field_text}),
        max_size=3), json_values),
     "response": maybe(field_text, json_values),
     "label": maybe(st.sampled_from([0, 1, True, False]), json_values),
     "guarduq_sample": maybe(st.fixed_dictionaries(
         {"uniform": st.booleans(), "rate": st.floats(-0.5, 1.5), "extra_probability": st.floats(0, 1),
          "inclusion_probability": st.floats(-0.1, 1.1)}), json_values)},
    optional={"id": maybe(texts, json_values), "ended": maybe(st.booleans(), json_values)},
)
ROWS["commonsenseqa"] = ROWS["arc"]
ROWS["nq-open"] = st.fixed_dictionaries(
    {"question": maybe(field_text, json_values), "answer": maybe(st.lists(field_text, max_size=3), json_values)},
    optional={"id": maybe(texts, json_values)},
)
# SST-2 is a TSV (sentence<TAB>label); its rows become lines, a field with a tab or newline a bad row.
ROWS["sst2"] = st.fixed_dictionaries(
    {"sentence": maybe(field_text, st.just(""), texts), "label": maybe(st.sampled_from(["0", "1", " 1 "]), texts)},
)
TQA_COLUMNS = ["Type", "Category", "Question", "Best Answer", "Correct Answers", "Incorrect Answers", "Source"]


@functools.cache
def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="guarduq-fuzz-data-"))


@st.composite
def jsonl_file(draw: st.DrawFn, name: str) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 5) | st.integers(1, 5))):
        kind = draw(st.sampled_from(["row"] * 7 + ["json", "text", "deep"]))
        if kind == "row":
            lines.append(json.dumps(draw(ROWS[name]), ensure_ascii=draw(st.booleans())))
        elif kind == "json":
            lines.append(json.dumps(draw(json_values)))
        elif kind == "text":
            lines.append(draw(texts).replace("\n", " "))
        else:
            lines.append("[" * draw(st.integers(100, 5000)) + "]" * draw(st.integers(0, 10)))
    return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n", "\n\n"]))


@st.composite
def sst2_file(draw: st.DrawFn) -> str:
    header = draw(st.sampled_from(["sentence\tlabel"] * 4 + ["text\tlabel", "", "sentence"]))
    lines = [header]
    for _ in range(draw(st.integers(0, 5) | st.integers(1, 5))):
        row = draw(ROWS["sst2"])
        fields = [row["sentence"], row["label"]][: draw(st.sampled_from([2, 2, 2, 1]))]
        lines.append("\t".join(fields) + draw(st.sampled_from(["", "\t", "\textra"])))
    return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n"]))


@st.composite
def truthfulqa_file(draw: st.DrawFn) -> str:
    columns = draw(st.one_of(st.just(TQA_COLUMNS), st.just(TQA_COLUMNS), st.just(TQA_COLUMNS),
                             st.lists(st.sampled_from(TQA_COLUMNS), max_size=7, unique=True), st.lists(texts, max_size=4)))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    for _ in range(draw(st.integers(0, 5) | st.integers(1, 5))):
        n = len(columns) if draw(st.integers(0, 3)) else draw(st.integers(0, len(columns) + 1))
        writer.writerow([draw(st.one_of(field_text, field_text, st.just("a; b;;"), st.just(""))) for _ in range(n)])
    text = out.getvalue()
    if draw(st.integers(0, 3)) == 0:  # raw damage: a stray quote or a cut
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(['"', "\x00", "", "\r"])) + text[at + draw(st.integers(0, 3)):]
    return text


@st.composite
def dataset_case(draw: st.DrawFn) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(DATASETS)))
    if name.startswith("truthfulqa"):
        text = draw(truthfulqa_file())
    else:
        text = draw(sst2_file()) if name == "sst2" else draw(jsonl_file(name))
    encoding = draw(st.sampled_from(["utf-8"] * 4 + ["utf-8-sig", "utf-16", "utf-16-le", "latin-1", "raw"]))
    if encoding == "raw":
        raw = draw(st.binary(max_size=200))
    elif encoding == "latin-1":
        raw = text.encode("latin-1", "replace")
    else:
        raw = text.encode(encoding, "surrogatepass")
    return name, raw


def _check_items(ds: Dataset, response: str) -> None:
    assert len(ds) >= 1 and ds.sha256
    for item in ds:
        assert isinstance(item.id, str)
        if isinstance(item.prompt, list):  # chat messages (labelled logs): as the Guard takes them
            assert item.kind == "labelled" and validate_prompt(item.prompt) is item.prompt
        else:
            assert isinstance(item.prompt, str) and item.prompt.strip()
            item.prompt.encode("utf-8")  # no lone surrogates leak into prompts
        assert item.split in {"fit", "threshold", "test"} and len(item.prompt_hash) == 16
        if item.kind == "qa":
            assert label_response(item, response) in (0, 1)
        elif item.kind == "mc":
            assert len(item.options) >= 2 and 0 <= item.answer_index < len(item.options)
            assert len(set(item.options)) == len(item.options)  # a twin option would tie with its twin
            assert label_choice(item, item.answer_index) == 1
        else:
            assert item.response and item.label in (0, 1)


# Found in CI: a row whose only incorrect answer repeats its best answer left one option.
@example(case=("truthfulqa-mc", b"Type,Category,Question,Best Answer,Correct Answers,Incorrect Answers,Source\r\n"
               b"0,a; b;;,0,0,0,0,0\r\n"), skip=True, style="instruct", limit=None, response="")
@examples(1500)
@given(case=dataset_case(), skip=st.booleans(),
       style=st.sampled_from(["instruct", "fewshot", "instruct", "fewshot", "chat", ""]),
       limit=st.one_of(st.none(), st.none(), st.integers(-1, 4)), response=texts)
def test_loaders(case: tuple[str, bytes], skip: bool, style: str, limit: int | None, response: str) -> None:
    name, raw = case
    path = workdir() / f"data-{name}"
    path.write_bytes(raw)
    ds = clean(f"dataset.{name}", load_dataset, name, path, prompt_style=style, skip_malformed=skip, limit=limit)
    if not isinstance(ds, GuardUQError):
        _check_items(ds, response.encode("utf-8", "replace").decode())


@examples(100)
@given(name=st.one_of(st.sampled_from(sorted(DATASETS)), texts), path=st.one_of(texts, junk))
def test_missing_or_odd_paths(name: Any, path: Any) -> None:
    if isinstance(path, str) and ("\x00" in path or not path.strip()):
        path = workdir() / "no-such-file"
    elif not isinstance(path, str):
        path = str(path)
    clean("dataset.path", load_dataset, name, workdir() / "missing" / path if isinstance(path, str) else path)
