"""The record and the base loader every dataset shares: ``Item`` (one labelled question) and
``Dataset`` (read a file, report bad rows by line, build items), with the prompt formats they use.

The loaders themselves, one subclass per file format, and the ``load_dataset`` factory live in
:mod:`guarduq.calibration.datasets`, which re-exports everything here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from guarduq._logging import get_logger
from guarduq.calibration.splits import Split, limit_subset, split_of
from guarduq.errors import DatasetError

log = get_logger("datasets")

Kind = Literal["qa", "mc", "labelled"]
PromptStyle = Literal["instruct", "fewshot"]
PROMPT_STYLES: tuple[str, ...] = ("instruct", "fewshot")

# Short-answer instruction for chat models; the few-shot block is for base models without a
# chat template, whose free generation would otherwise ramble on past the answer.
QA_INSTRUCTION = "Answer briefly: {question}"
FEWSHOT_QA = (
    "Answer each question briefly.\n\n"
    "Q: What is the capital of France?\nA: Paris\n\n"
    "Q: Who wrote the play Romeo and Juliet?\nA: William Shakespeare\n\n"
    "Q: How many legs does a spider have?\nA: Eight\n\n"
    "Q: {question}\nA:"
)
# A base model's answer ends at the first newline (the next "Q:" would follow).
FEWSHOT_STOP: tuple[str, ...] = ("\n",)


def default_data_dir() -> Path:
    """``$GUARDUQ_DATA`` or ``../shared/data`` relative to the working directory."""
    return Path(os.environ.get("GUARDUQ_DATA") or Path("..") / "shared" / "data")


@dataclass(frozen=True)
class Item:
    """One labelled question. ``prompt`` is exactly what the model is shown (before chat templating)."""

    id: str
    dataset: str
    kind: Kind
    prompt: str | list[dict[str, str]]  # chat messages only in labelled logs
    question: str
    grader: Literal["alias", "rouge", "choice", "given"]
    answers: tuple[str, ...] = ()  # TriviaQA aliases
    correct_refs: tuple[str, ...] = ()  # TruthfulQA generation references
    incorrect_refs: tuple[str, ...] = ()
    options: tuple[str, ...] = ()  # multiple choice, as scored responses
    answer_index: int | None = None
    response: str | None = None  # labelled logs
    label: int | None = None
    stop_strings: tuple[str, ...] = ()
    group: str | None = None  # items sharing a source question (TruthfulQA gen/mc) share a split
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def split(self) -> Split:
        """Which deterministic split (see :func:`split_of`) this item belongs to."""
        return split_of(self.group or self.id)

    @property
    def prompt_hash(self) -> str:
        """Hash of everything that decides the model's input; a changed prompt format re-scores."""
        fields: list[Any] = [self.prompt, list(self.options), self.response, list(self.stop_strings)]
        if self.meta.get("ended") is False:  # a reply cut short is scored without end-of-turn
            fields.append("ended=false")
        payload = json.dumps(fields, ensure_ascii=False)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- loaders


class _RowError(ValueError):
    """A row that parses but cannot become an item (missing field, bad key)."""


def _content_id(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


def _require(row: dict[str, Any], key: str, kind: type | tuple[type, ...] = str) -> Any:
    if key not in row:
        raise _RowError(f"missing field '{key}'")
    value = row[key]
    if not isinstance(value, kind):
        raise _RowError(f"field '{key}' has type {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise _RowError(f"field '{key}' is empty")
    return value


def _check_unicode(row: dict[str, Any]) -> None:
    """Refuse a row whose text has no UTF-8 form (a lone surrogate from a JSON escape)."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _RowError("text is not valid Unicode (a lone surrogate such as \\ud800)") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class Dataset:
    """Base loader: reads ``path``, builds items, reports bad rows by line number.

    Subclasses set ``name`` and ``kind`` and implement ``_rows`` (parse) and ``_item`` (one row ->
    one Item). A bad row raises ``DatasetError`` naming its line, unless ``skip_malformed`` is set,
    in which case it is skipped, logged, and listed in ``skipped``.
    """

    name: ClassVar[str]
    kind: ClassVar[Kind]

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prompt_style: PromptStyle = "instruct",
        skip_malformed: bool = False,
        limit: int | None = None,
    ) -> None:
        if prompt_style not in PROMPT_STYLES:
            raise DatasetError(f"unknown prompt style {prompt_style!r}; use one of {PROMPT_STYLES}")
        if limit is not None and limit < 1:
            raise DatasetError(f"limit must be >= 1, got {limit}")
        self.path = Path(path)
        self.prompt_style = prompt_style
        self.skip_malformed = skip_malformed
        self.limit = limit
        if not self.path.is_file():
            raise DatasetError(f"{self.name}: data file not found: {self.path}")
        self.sha256 = _sha256(self.path)
        self.skipped: list[tuple[int, str]] = []
        self.items = self._load()

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Item]:
        return iter(self.items)

    def describe(self) -> dict[str, Any]:
        """Provenance recorded in calibrator artifacts."""
        return {"name": self.name, "file": self.path.name, "sha256": self.sha256, "n": len(self)}

    # -- parsing

    def _load(self) -> list[Item]:
        items: list[Item] = []
        seen: set[str] = set()
        for lineno, row in self._rows():
            try:
                if not isinstance(row, dict):
                    raise _RowError(f"expected an object, got {type(row).__name__}")
                _check_unicode(row)
                item = self._item(row)
                if item.id in seen:
                    raise _RowError(f"duplicate id {item.id!r}")
            except _RowError as exc:
                self._bad(lineno, str(exc))
                continue
            seen.add(item.id)
            items.append(item)
        if not items:
            raise DatasetError(f"{self.name}: no usable items in {self.path}")
        if self.skipped:
            log.warning(
                "dataset_rows_skipped",
                dataset=self.name,
                path=str(self.path),
                n=len(self.skipped),
                lines=[n for n, _ in self.skipped[:20]],
            )
        return limit_subset(items, self.limit)

    def _bad(self, lineno: int, message: str) -> None:
        if not self.skip_malformed:
            raise DatasetError(
                f"{self.path}: line {lineno}: {message} (pass --skip-malformed / "
                "skip_malformed=True to skip bad rows)"
            )
        self.skipped.append((lineno, message))

    def _rows(self) -> Iterator[tuple[int, Any]]:
        """JSON Lines by default; blank lines are ignored."""
        try:
            with open(self.path, encoding="utf-8-sig") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        yield lineno, json.loads(line)
                    except json.JSONDecodeError as exc:
                        self._bad(lineno, f"malformed JSON ({exc.msg} at column {exc.colno})")
                    except RecursionError:
                        self._bad(lineno, "malformed JSON (nested too deeply)")
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{self.path}: not UTF-8 text ({exc.reason})") from exc

    def _item(self, row: dict[str, Any]) -> Item:
        raise NotImplementedError

    def _new(
        self, raw_id: str, question: str, prompt: str | list[dict[str, str]] | None = None, **fields: Any
    ) -> Item:
        """An item of this dataset: namespaced id, default QA prompt, the style's stop strings.

        Few-shot answers end at a newline, generated (qa) or chosen (mc) alike.
        """
        return Item(
            id=f"{self.name}:{raw_id}",
            dataset=self.name,
            kind=self.kind,
            prompt=self.qa_prompt(question) if prompt is None else prompt,
            question=question,
            stop_strings=self.stop_strings,
            **fields,
        )

    # -- prompts

    def qa_prompt(self, question: str) -> str:
        template = FEWSHOT_QA if self.prompt_style == "fewshot" else QA_INSTRUCTION
        return template.format(question=question.strip())

    def mc_options(self, options: Sequence[str]) -> tuple[str, ...]:
        """Options as scored responses: a base model continues "A:" with a leading space."""
        prefix = " " if self.prompt_style == "fewshot" else ""
        return tuple(prefix + o.strip() for o in options)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return FEWSHOT_STOP if self.prompt_style == "fewshot" else ()
