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

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from guarduq.sampling import Sample

Label = Literal["right", "wrong", "unsure"]
LABELS: tuple[str, ...] = ("right", "wrong", "unsure")
Reason = Literal["escalation", "uniform", "band", "drift"]
REASONS: tuple[str, ...] = ("escalation", "uniform", "band", "drift")


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
