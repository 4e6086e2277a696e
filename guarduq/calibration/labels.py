"""Labels for scored answers: is a free-form answer right (alias match, TruthfulQA's ROUGE-L
rule), is a multiple-choice pick the key. The loaders in ``datasets`` build the items these read."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from guarduq.answers import normalize_answer, same_answer  # noqa: F401  (re-exported: the old path works)
from guarduq.errors import DatasetError

if TYPE_CHECKING:
    from guarduq.calibration.datasets import Item


def alias_match(response: str, aliases: Sequence[str]) -> bool:
    """True when the normalised response equals or contains (as whole words) a normalised alias."""
    answer = normalize_answer(response)
    if not answer:
        return False
    padded = f" {answer} "
    for alias in aliases:
        norm = normalize_answer(alias)
        if norm and (norm == answer or f" {norm} " in padded):
            return True
    return False


@lru_cache(maxsize=1)
def _rouge() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def max_rouge_l(response: str, references: Sequence[str]) -> float:
    """Best ROUGE-L F-measure of ``response`` against any reference (0 for none)."""
    scorer = _rouge()
    return max((scorer.score(ref, response)["rougeL"].fmeasure for ref in references), default=0.0)


def truthfulqa_label(response: str, correct: Sequence[str], incorrect: Sequence[str]) -> int:
    """1 when the answer is closer (max ROUGE-L) to a correct reference than to any incorrect one.

    Ties count as wrong: an answer equally close to both sets has not shown it is truthful.
    """
    if not response.strip():
        return 0
    return int(max_rouge_l(response, correct) > max_rouge_l(response, incorrect))


def label_response(item: Item, response: str) -> int:
    """Label a free-form answer to a ``qa`` item (1 = correct)."""
    if item.grader == "alias":
        return int(alias_match(response, item.answers))
    if item.grader == "rouge":
        return truthfulqa_label(response, item.correct_refs, item.incorrect_refs)
    raise DatasetError(f"item {item.id} ({item.kind}) is not labelled from a free-form answer")


def label_choice(item: Item, index: int) -> int:
    """Label a multiple-choice pick (1 = the key)."""
    if item.kind != "mc" or item.answer_index is None:
        raise DatasetError(f"item {item.id} is not a multiple-choice item")
    return int(index == item.answer_index)
