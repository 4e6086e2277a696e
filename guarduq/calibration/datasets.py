"""Labelled evaluation data: loaders that turn public QA / multiple-choice files into ``Item``s.

Each loader is a small subclass of :class:`Dataset` (one per file format), built by the factory
:func:`load_dataset` from a plain string (``"triviaqa"``, ``"nq-open"``, ``"truthfulqa-gen"``, ``"truthfulqa-mc"``,
``"arc"``, ``"boolq"``, ``"sst2"``, ``"jsonl"``), so CLI flags and YAML can name them.

Every item carries a stable id (the dataset's own id, else a hash of its content) because the
scoring cache and the calibration / test split are both keyed by it: the same question lands in
the same split on every run and on every machine.

How an item is labelled depends on its ``kind`` (the rules live in :mod:`guarduq.calibration.labels`):

* ``qa``: the model answers freely; ``grader="alias"`` (TriviaQA, NQ-open) marks the answer correct when its
  SQuAD-normalised text equals or contains a normalised alias; ``grader="rouge"`` (TruthfulQA
  generation) marks it correct when its best ROUGE-L against the correct references beats its
  best ROUGE-L against the incorrect ones (the TruthfulQA paper's automatic metric).
* ``mc``: the model "chooses" the option with the highest mean token probability; correct when the
  chosen index is ``answer_index``.
* ``labelled``: the response and its label come with the data.

Labels are ``1 = correct``, ``0 = wrong`` throughout. ``Item`` and the ``Dataset`` base live in
:mod:`guarduq.calibration.dataset_base` (re-exported here).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from guarduq._logging import get_logger
from guarduq.calibration.dataset_base import (  # noqa: F401  (re-exported: the public names stay here)
    FEWSHOT_QA,
    FEWSHOT_STOP,
    PROMPT_STYLES,
    QA_INSTRUCTION,
    Dataset,
    Item,
    Kind,
    PromptStyle,
    _content_id,
    _require,
    _RowError,
    default_data_dir,
)
from guarduq.calibration.splits import (  # noqa: F401  (re-exported: imports from datasets keep working)
    hash_unit,
    outside_limits,
)
from guarduq.errors import DatasetError, InputError, StoreInputError
from guarduq.sampling import Sample

log = get_logger("datasets")

TRUTHFULQA_NO_COMMENT = "I have no comment."


def _merge_repeats(options: Sequence[str], answer: int) -> tuple[list[str], int]:
    """The options with repeated texts merged (the first kept); the answer moves with its text.

    CommonsenseQA repeats a choice in 24 of its 1,221 dev rows ("indestructible" at A and at D).
    Equal options get equal probabilities, so which of them an argmax picks, and with it the
    label, would follow their order rather than the model.
    """
    first: dict[str, int] = {}
    for o in options:
        first.setdefault(o.strip(), len(first))
    return list(first), first[options[answer].strip()]


def _clean_csv_quotes(text: str) -> str:
    """TriviaQA keeps CSV-style quoting: '"Who wrote ""X""?"' -> 'Who wrote "X"?'."""
    text = text.strip()
    if len(text) > 1 and text[0] == text[-1] == '"' and '""' in text:
        text = text[1:-1].replace('""', '"')
    return text


class TriviaQA(Dataset):
    """JSONL with ``question`` and ``answers`` (aliases); optional ``id``."""

    name = "triviaqa"
    kind = "qa"

    def _item(self, row: dict[str, Any]) -> Item:
        question = _clean_csv_quotes(_require(row, "question"))
        answers = _require(row, "answers", list)
        aliases = tuple(a for a in answers if isinstance(a, str) and a.strip())
        if not aliases:
            raise _RowError("field 'answers' has no non-empty string alias")
        return self._new(str(row.get("id") or _content_id(question)), question, grader="alias", answers=aliases)


class NQOpen(Dataset):
    """NQ-open JSONL (``question``, ``answer``: a list of acceptable short answers), graded like
    TriviaQA: correct when the normalised answer equals or contains a normalised alias."""

    name = "nq-open"
    kind = "qa"

    def _item(self, row: dict[str, Any]) -> Item:
        question = _require(row, "question").strip()
        answers = _require(row, "answer", (list, str))
        if isinstance(answers, str):
            answers = [answers]
        aliases = tuple(a for a in answers if isinstance(a, str) and a.strip())
        if not aliases:
            raise _RowError("field 'answer' has no non-empty string answer")
        # NQ questions are lower case without a question mark; the model sees them as a question.
        shown = question[:1].upper() + question[1:]
        if not shown.endswith("?"):
            shown += "?"
        return self._new(str(row.get("id") or _content_id(question)), shown, grader="alias", answers=aliases)


class _TruthfulQA(Dataset):
    """The original TruthfulQA CSV (``Question``, ``Best Answer``, ``Correct Answers``, ...)."""

    columns: ClassVar[tuple[str, ...]] = ("Question", "Best Answer", "Correct Answers", "Incorrect Answers")

    def _rows(self) -> Iterator[tuple[int, Any]]:
        try:
            with open(self.path, encoding="utf-8-sig", newline="") as f:
                reader = csv.DictReader(f)
                missing = [c for c in self.columns if c not in (reader.fieldnames or [])]
                if missing:
                    raise DatasetError(
                        f"{self.path}: not a TruthfulQA CSV, missing column(s) {missing}; "
                        f"found {reader.fieldnames}"
                    )
                for row in reader:
                    yield reader.line_num, row
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{self.path}: not UTF-8 text ({exc.reason})") from exc
        except csv.Error as exc:
            raise DatasetError(f"{self.path}: malformed CSV: {exc}") from exc

    @staticmethod
    def _split_refs(text: str | None) -> tuple[str, ...]:
        return tuple(r.strip() for r in (text or "").split(";") if r.strip())

    def _parts(self, row: dict[str, Any]) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
        question = _require(row, "Question")
        best = _require(row, "Best Answer").strip()
        correct = self._split_refs(row.get("Correct Answers"))
        # Two of the 817 rows also list a correct answer as incorrect, one repeats an incorrect
        # answer: a repeat would be a duplicate option, a shared one a tie that grades right as wrong.
        incorrect = tuple(dict.fromkeys(o for o in self._split_refs(row.get("Incorrect Answers"))
                                        if o != best and o not in correct))
        if not incorrect:
            raise _RowError("no incorrect answer that is not also listed as correct")
        return question, best, correct, incorrect


class TruthfulQAGen(_TruthfulQA):
    name = "truthfulqa-gen"
    kind = "qa"

    def _item(self, row: dict[str, Any]) -> Item:
        question, best, correct, incorrect = self._parts(row)
        refs = tuple(dict.fromkeys((best, *correct, TRUTHFULQA_NO_COMMENT)))
        return self._new(
            _content_id(question),
            question,
            grader="rouge",
            correct_refs=refs,
            incorrect_refs=incorrect,
            group=f"truthfulqa:{_content_id(question)}",
            meta={"category": row.get("Category"), "type": row.get("Type")},
        )


class TruthfulQAMC(_TruthfulQA):
    """Options: the best answer (index 0) and every incorrect answer (TruthfulQA's MC1 set)."""

    name = "truthfulqa-mc"
    kind = "mc"

    def _item(self, row: dict[str, Any]) -> Item:
        question, best, _, incorrect = self._parts(row)
        return self._new(
            _content_id(question),
            question,
            grader="choice",
            options=self.mc_options((best, *incorrect)),
            answer_index=0,
            group=f"truthfulqa:{_content_id(question)}",
            meta={"category": row.get("Category"), "type": row.get("Type")},
        )


class ARC(Dataset):
    """ARC JSONL (``question.stem``, ``question.choices[{label, text}]``, ``answerKey``).

    CommonsenseQA uses the same shape. The options are scored as answers to the bare question
    (cloze style), so the model is not asked to emit a letter.
    """

    name = "arc"
    kind = "mc"

    def _item(self, row: dict[str, Any]) -> Item:
        q = _require(row, "question", dict)
        stem = _require(q, "stem")
        choices = _require(q, "choices", list)
        key = str(_require(row, "answerKey", (str, int))).strip()
        labels, texts = [], []
        for c in choices:
            if (not isinstance(c, dict) or not isinstance(c.get("label"), (str, int))
                    or not isinstance(c.get("text"), str) or not c["text"].strip()):
                raise _RowError("each choice needs a 'label' and a non-empty 'text'")
            labels.append(str(c["label"]).strip())
            texts.append(c["text"])
        if len(set(labels)) < len(labels):
            raise _RowError(f"repeated choice labels {labels}")
        if key not in labels:
            raise _RowError(f"answerKey {key!r} is not one of the choice labels {labels}")
        options, answer = _merge_repeats(texts, labels.index(key))
        if len(options) < 2:
            raise _RowError("fewer than two distinct choices")
        raw_id = str(row.get("id") or _content_id(stem, *texts))
        return self._new(raw_id, stem, grader="choice", options=self.mc_options(options), answer_index=answer)


class BoolQ(Dataset):
    """BoolQ JSONL (``question``, ``passage``, ``answer`` as a bool or "true"/"false")."""

    name = "boolq"
    kind = "mc"

    def _item(self, row: dict[str, Any]) -> Item:
        question = _require(row, "question")
        passage = _require(row, "passage")
        answer = _require(row, "answer", (bool, str))
        if isinstance(answer, str):
            if answer.strip().lower() not in {"true", "false"}:
                raise _RowError(f"answer {answer!r} is neither true nor false")
            answer = answer.strip().lower() == "true"
        q = question.strip().rstrip("?")
        q = q[:1].upper() + q[1:]
        if self.prompt_style == "fewshot":
            prompt = f"{passage.strip()}\n\nQuestion: {q}?\nAnswer (yes or no):"
        else:
            prompt = f"{passage.strip()}\n\nQuestion: {q}? Answer yes or no."
        return self._new(
            str(row.get("id") or _content_id(question, passage)),
            q + "?",
            prompt,
            grader="choice",
            options=self.mc_options(("Yes", "No")),
            answer_index=0 if answer else 1,
        )


class SST2(Dataset):
    """GLUE SST-2 TSV (header ``sentence<TAB>label``, 1 = positive, no quoting) as a two-option
    question, like BoolQ's Yes/No: the model "chooses" Positive or Negative for a movie-review
    sentence. A task outside the shipped calibrator's seven QA sets (the drift evidence's
    never-seen case)."""

    name = "sst2"
    kind = "mc"
    columns: ClassVar[tuple[str, ...]] = ("sentence", "label")

    def _rows(self) -> Iterator[tuple[int, Any]]:
        try:
            with open(self.path, encoding="utf-8-sig", newline="") as f:
                reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
                header = next(reader, None)
                if header is None or [h.strip() for h in header[:2]] != list(self.columns):
                    raise DatasetError(f"{self.path}: not an SST-2 TSV, expected the header "
                                       f"'sentence<TAB>label', found {header}")
                for row in reader:
                    if not row or not any(c.strip() for c in row):
                        continue
                    if len(row) != 2:
                        self._bad(reader.line_num, f"expected 2 tab-separated fields, got {len(row)}")
                        continue
                    yield reader.line_num, dict(zip(self.columns, row, strict=True))
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{self.path}: not UTF-8 text ({exc.reason})") from exc
        except csv.Error as exc:
            raise DatasetError(f"{self.path}: malformed TSV: {exc}") from exc

    def _item(self, row: dict[str, Any]) -> Item:
        sentence = " ".join(_require(row, "sentence").split())
        label = _require(row, "label").strip()
        if label not in {"0", "1"}:
            raise _RowError(f"label {label!r} is neither 0 nor 1")
        question = "Is the sentiment of this movie review positive or negative?"
        if self.prompt_style == "fewshot":
            prompt = f"Review: {sentence}\nSentiment (positive or negative):"
        else:
            prompt = f"Review: {sentence}\n\n{question} Answer positive or negative."
        return self._new(
            _content_id(sentence),
            f"{question} {sentence}",
            prompt,
            grader="choice",
            options=self.mc_options(("Positive", "Negative")),
            answer_index=0 if label == "1" else 1,
        )


class LabelledJSONL(Dataset):
    """Already-labelled logs: ``prompt`` (a string or chat messages), ``response``, ``label``
    (1/true = correct); optional ``id``, ``ended`` (default true: the model closed its turn),
    ``group`` (its kind of traffic) and ``guarduq_sample`` (how a reviewed reply was sampled); the
    last three are kept in ``Item.meta``."""

    name = "jsonl"
    kind = "labelled"

    def _item(self, row: dict[str, Any]) -> Item:
        prompt = _require(row, "prompt", (str, list))
        if isinstance(prompt, list):
            prompt = _messages(prompt)
        response = _require(row, "response")
        label = _require(row, "label", (bool, int))
        if int(label) not in (0, 1):
            raise _RowError(f"label must be 0 or 1 (1 = correct), got {label!r}")
        ended = row.get("ended", True)
        if not isinstance(ended, bool):
            raise _RowError(f"field 'ended' must be true or false, got {ended!r}")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, sort_keys=True)
        raw_id = str(row.get("id") or _content_id(text, response))
        meta: dict[str, Any] = {"ended": ended}
        group = row.get("group")
        if group is not None:
            if not isinstance(group, str) or not group:
                raise _RowError(f"field 'group' must be a non-empty string, got {group!r}")
            meta["group"] = group  # the traffic group (calibrate --dataset reviews certifies per group)
        if "guarduq_sample" in row:
            meta["sample"] = _sample(row["guarduq_sample"])
            if self.name == "jsonl" and not getattr(self, "_warned_sample", False):
                self._warned_sample = True
                log.warning("jsonl_rows_are_reviews", path=str(self.path),
                            hint="these rows come from a review sample: --dataset reviews --data FILE fits "
                                 "with their weights and certifies on the uniform sample only; --dataset "
                                 "jsonl treats them as a simple random sample")
        item = self._new(raw_id, text, prompt, grader="given", response=response, label=int(label))
        return replace(item, meta=meta)


def _messages(prompt: list[Any]) -> list[dict[str, str]]:
    """Chat messages as the Guard takes them (``layout.validate_prompt``), else a row error."""
    from guarduq.layout import validate_prompt  # lazily: layout brings torch

    try:
        validate_prompt(prompt)
    except InputError as exc:
        raise _RowError(f"field 'prompt': {exc}") from None
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _sample(value: Any) -> Sample:
    """A reviewed reply's sampling record (``Sample.from_json``), else a row error."""
    try:
        return Sample.from_json(value)
    except StoreInputError as exc:
        raise _RowError(f"field 'guarduq_sample': {exc}") from None


class Reviews(LabelledJSONL):
    """Replies labelled by reviewers, exported from a store (``guarduq calibrate --dataset
    reviews --store URL``): every row carries its ``guarduq_sample``, so calibration can fit with
    inverse-probability weights and certify thresholds on the uniform sample alone."""

    name = "reviews"

    def _item(self, row: dict[str, Any]) -> Item:
        if "guarduq_sample" not in row:
            raise _RowError("a reviewed reply needs its 'guarduq_sample' (export it from a store)")
        return super()._item(row)


class CommonsenseQA(ARC):
    """CommonsenseQA JSONL: the ARC shape with five options."""

    name = "commonsenseqa"


DATASETS: dict[str, type[Dataset]] = {
    "triviaqa": TriviaQA,
    "nq-open": NQOpen,
    "truthfulqa-gen": TruthfulQAGen,
    "truthfulqa-mc": TruthfulQAMC,
    "arc": ARC,
    "commonsenseqa": CommonsenseQA,
    "boolq": BoolQ,
    "sst2": SST2,
    "jsonl": LabelledJSONL,
    "reviews": Reviews,
}


def load_dataset(
    name: str,
    path: str | os.PathLike[str],
    *,
    prompt_style: PromptStyle = "instruct",
    skip_malformed: bool = False,
    limit: int | None = None,
) -> Dataset:
    """Build the loader registered under ``name`` (see ``DATASETS``) for the file at ``path``."""
    try:
        cls = DATASETS[name]
    except KeyError:
        raise DatasetError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}") from None
    return cls(path, prompt_style=prompt_style, skip_malformed=skip_malformed, limit=limit)
