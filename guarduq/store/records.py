"""What the store holds, as plain dataclasses: the contract between the store, the Guard that
writes to it, the review page that reads and labels, and the calibration that fits on labels.

Three kinds of row:

- a ``ReplyRecord`` per decided reply (every reply when a store is configured): time, model
  fingerprint, policy and calibrator identity, scores, risk, decision. Its text (prompt, reply,
  token pieces and probabilities) is kept only where the policy opts in: ``audit.log_text`` for
  every reply, ``review.keep_text`` for sampled ones.
- a review item per sampled reply: the ``Sample`` that chose it (why, and with what probability;
  defined in ``guarduq.sampling``, re-exported here).
- any number of ``LabelRecord`` per review item (the history); the most recent one counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Literal, get_args

from guarduq.errors import StoreInputError
from guarduq.sampling import Sample

Label = Literal["right", "wrong", "unsure"]
LABELS: tuple[str, ...] = get_args(Label)
Reason = Literal["escalation", "uniform", "band", "drift"]
REASONS: tuple[str, ...] = get_args(Reason)


@dataclass(frozen=True)
class Filters:
    """What ``Store.queue``, ``count`` and ``next_unlabelled`` select (None: no condition), and
    what the review page's filter form (``review.forms``) turns into."""

    reason: str | None = None  # one of REASONS: items picked (also) for this reason
    action: str | None = None  # the policy's action on the reply (allow, abstain, escalate, ...)
    risk_min: float | None = None  # risk >= risk_min (replies without a risk are left out)
    risk_max: float | None = None  # risk <= risk_max
    labelled: bool | None = None  # True: at least one label; False: none yet
    label: str | None = None  # the current label is this one (one of LABELS)
    group: str | None = None  # the replies' traffic group (the policy's groups; metadata.group)

    def __post_init__(self) -> None:
        if self.reason is not None and self.reason not in REASONS:
            raise StoreInputError(f"unknown review reason {self.reason!r}; choose one of {list(REASONS)}")
        if self.label is not None and self.label not in LABELS:
            raise StoreInputError(f"unknown label {self.label!r}; choose one of {list(LABELS)}")
        if self.group is not None and (not isinstance(self.group, str) or not self.group):
            raise StoreInputError(f"group must be a non-empty string, got {self.group!r}")
        if self.labelled is not None and not isinstance(self.labelled, bool):
            raise StoreInputError(f"labelled must be True, False or None, got {self.labelled!r}")
        for name in ("risk_min", "risk_max"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v)):
                raise StoreInputError(f"{name} must be a number, got {v!r}")

    @classmethod
    def of(cls, filters: Filters | None, conditions: Mapping[str, Any]) -> Filters:
        """``filters``, or the same conditions given as keywords (``store.queue(reason="band")``)."""
        if filters is not None and conditions:
            raise StoreInputError(f"give a Filters or keyword conditions, not both (got {sorted(conditions)})")
        if filters is not None:
            return filters
        unknown = set(conditions) - {f.name for f in fields(cls)}
        if unknown:
            raise StoreInputError(f"unknown queue filter(s) {sorted(unknown)}; choose from {[f.name for f in fields(cls)]}")
        return cls(**conditions)


@dataclass(frozen=True)
class ReplyRecord:
    """One decided reply, as the Guard saw it. Text fields are None unless kept."""

    request_id: str
    time: datetime
    model_fingerprint: str | None
    policy: str | None  # "name@version"
    policy_sha256: str | None
    calibrator_sha256: str | None
    parameter_set: str
    scores: dict[str, Any]  # Scores.to_dict(with_token_probs=False)
    risk: float | None
    action: str | None
    rule: str | None
    shown: bool
    escalated: bool
    second_opinion: dict[str, Any] | None = None
    prompt: str | list[dict[str, str]] | None = None
    response: str | None = None
    tokens: list[str] | None = None  # the reply's token pieces, for shading by probability
    token_probs: list[float] | None = None
    ended: bool = True
    group: str | None = None  # the kind of traffic whose certificate decided it (None: pooled)
    drift: str | None = None  # the drift case in force: ok, slice:<group>, unseen (None: no monitor)


@dataclass(frozen=True)
class LabelRecord:
    """One reviewer's verdict on one item; every verdict is kept (the history)."""

    id: int
    request_id: str
    reviewer: str
    label: str  # one of LABELS
    note: str | None
    corrected: str | None
    time: datetime


@dataclass(frozen=True)
class ReviewItem:
    """A sampled reply with why it was sampled and its label history (oldest first)."""

    reply: ReplyRecord
    sample: Sample
    labels: list[LabelRecord] = field(default_factory=list)

    @property
    def current(self) -> LabelRecord | None:
        """The label that counts: the most recent one."""
        return self.labels[-1] if self.labels else None


@dataclass(frozen=True)
class LabelledReview:
    """A reviewed reply ready for calibration: text, a right/wrong label, its sampling record."""

    request_id: str
    time: datetime
    prompt: str | list[dict[str, str]]
    response: str
    correct: int  # 1 = right, 0 = wrong (the current label; 'unsure' items are left out)
    ended: bool
    sample: Sample
    model_fingerprint: str | None
    scores: dict[str, Any]
    group: str | None = None


@dataclass(frozen=True)
class QueueRow:
    """One line of the review queue: enough to list and sort items without loading their text.

    ``label`` is the current label (the most recent) or None; ``preview`` the reply's first
    characters (at most ``PREVIEW_CHARS``, ending in an ellipsis when cut), None without text.
    """

    request_id: str
    time: datetime
    risk: float | None
    action: str | None
    rule: str | None
    reasons: tuple[str, ...]
    inclusion_probability: float
    label: str | None
    n_labels: int
    preview: str | None
    group: str | None = None


PREVIEW_CHARS = 120
