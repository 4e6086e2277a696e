"""Deterministic splits and subsets by id hash, so an item lands in the same split, and ``--limit``
keeps the same items, on every run and every machine (the scoring cache is reused)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, TypeVar

from guarduq.errors import DatasetError

Split = Literal["fit", "threshold", "test"]


class _Keyed(Protocol):
    """What the subsets read of an item: structural, so ``datasets`` (which imports this) is not imported back."""

    @property
    def id(self) -> str: ...

    @property
    def question(self) -> str: ...


_ItemT = TypeVar("_ItemT", bound=_Keyed)


def hash_unit(item_id: str, salt: str = "guarduq-split-v1") -> float:
    """A number in [0, 1) fixed by the id alone (sha256), the same on every machine."""
    digest = hashlib.sha256(f"{salt}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


# The default shares of the held-out test split and of the threshold (certification) split: the
# one place every face (calibrate, the policy's review settings, the review page) reads them from.
TEST_FRACTION = 0.3
THRESHOLD_FRACTION = 0.3


def split_of(key: str, *, test_fraction: float = TEST_FRACTION,
             threshold_fraction: float = THRESHOLD_FRACTION) -> Split:
    """Deterministic split by id hash.

    The calibration split is ``fit`` (the logistic regression) plus ``threshold`` (the risk
    thresholds): the finite-sample guarantee needs labels the risk model has not seen.
    ``test`` is held out for the metrics.
    """
    if not (0 <= test_fraction < 1 and 0 <= threshold_fraction < 1 - test_fraction):
        raise DatasetError(
            f"bad split fractions: test={test_fraction}, threshold={threshold_fraction}"
        )
    u = hash_unit(key)
    if u >= 1 - test_fraction:
        return "test"
    if u >= 1 - test_fraction - threshold_fraction:
        return "threshold"
    return "fit"


def limit_subset(items: Sequence[_ItemT], limit: int | None) -> list[_ItemT]:
    """What ``--limit`` keeps: the ``limit`` items with the smallest id hash, in file order.

    A stable pseudo-random subset, so a larger limit extends a smaller one and the cache is reused.
    """
    if limit is None or limit >= len(items):
        return list(items)
    keep = set(sorted((it.id for it in items), key=lambda i: hash_unit(i, "limit"))[:limit])
    return [it for it in items if it.id in keep]


def outside_limits(
    groups: Mapping[str, Sequence[_ItemT]], limits: Mapping[str, int]
) -> dict[str, list[_ItemT]]:
    """Each dataset's items that ``guarduq calibrate --limit`` would not score, for training a
    second opinion that never sees what its calibrator is fitted, certified or tested on.

    ``limits`` maps a dataset name to its limit (``""``: every other dataset; a dataset with
    neither is scored whole, so nothing of it is left). An item is also left out when its question
    is asked by a scored item of *any* of the datasets: TruthfulQA's gen and mc modes share
    questions under different ids.
    """
    scored_questions: set[str] = set()
    left: dict[str, list[_ItemT]] = {}
    for name, items in groups.items():
        limit = limits.get(name, limits.get(""))
        scored = limit_subset(items, limit)
        ids = {it.id for it in scored}
        scored_questions |= {_question_key(it) for it in scored}
        left[name] = [it for it in items if it.id not in ids]
    return {name: [it for it in items if _question_key(it) not in scored_questions] for name, items in left.items()}


def _question_key(item: _Keyed) -> str:
    return " ".join(item.question.split()).casefold()
