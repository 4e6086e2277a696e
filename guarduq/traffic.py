"""Recording decided replies in a store, and drawing the ones that go to human review.

``Traffic`` sits beside the audit log in the Guard's decide step: every decided reply becomes
one ``ReplyRecord`` (scores, risk, decision, the policy and calibrator that decided), and the
policy's ``review`` settings draw the sample reviewers will label (every escalation, a uniform
random share of all replies, optionally more from risk bands), each with its inclusion
probability, which is what lets calibration reweight the sample back to the traffic.

Text is kept only where the policy opts in: ``audit.log_text`` keeps every reply's text (as the
audit log does), ``review.keep_text`` only the sampled replies'. A reply whose text is not kept
is still recorded (its scores feed drift and counts) but cannot be labelled for calibration.

The audit log stays the durable record of every call; a store that fails to write is logged and
counted, never fails the reply (``errors_`` counts them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from guarduq._logging import get_logger

if TYPE_CHECKING:  # the store extra (SQLAlchemy) is only needed when a store is configured
    from guarduq.store import ReviewSampler, Store
    from guarduq.store.records import Sample

log = get_logger("traffic")


@dataclass
class Traffic:
    """A store plus the sampler and text settings of the policy in force."""

    store: Store
    sampler: ReviewSampler | None  # None: nothing is sampled for review
    keep_text: bool = False  # the policy's review.keep_text: sampled replies keep their text
    log_text: bool = False  # the policy's audit.log_text: every reply keeps its text
    errors_: int = 0
    _policy: Any = None  # the policy the settings were taken from

    @classmethod
    def open(cls, store: Store | str | os.PathLike[str], policy: Any | None = None) -> Traffic:
        """A store (object or URL) with the sampling and text settings of ``policy``."""
        from guarduq.store import Store

        if not isinstance(store, Store):
            store = Store(str(store))
        t = cls(store=store, sampler=None)
        t.configure(policy)
        return t

    def configure(self, policy: Any | None) -> None:
        """Take the sampling and text settings of ``policy`` (after a reload, the new one's)."""
        from guarduq.store import ReviewSampler

        self._policy = policy
        review = getattr(getattr(policy, "config", None), "review", None)
        self.sampler = ReviewSampler.from_settings(review) if review is not None else None
        self.keep_text = bool(review is not None and review.keep_text)
        self.log_text = bool(policy is not None and policy.log_text)

    def record(self, r: Any, *, policy: Any | None, calibrator_sha256: str | None,
               tokens: Callable[[], list[str]]) -> Sample | None:
        """Record the decided reply ``r`` (a ``GuardedResponse``); returns its review sample.

        ``tokens()`` gives the reply's token pieces, kept with the text for shading by
        probability (called only when the text is kept).
        """
        from guarduq.store.records import ReplyRecord

        if policy is not self._policy:  # a reload swapped the policy: take its review settings
            self.configure(policy)
        d = r.decision
        escalated = d is not None and d.action == "escalate"
        sample = self.sampler.draw(r.risk, escalated) if self.sampler is not None else None
        keep = self.log_text or (self.keep_text and sample is not None and sample.sampled)
        ident = policy.identity() if policy is not None else None
        reply = ReplyRecord(
            request_id=r.request_id,
            time=datetime.now(UTC),
            model_fingerprint=r.model.fingerprint,
            policy=f"{ident['name']}@{ident['version']}" if ident else None,
            policy_sha256=ident["sha256"] if ident else None,
            calibrator_sha256=calibrator_sha256,
            parameter_set=r.scores.parameter_set,
            scores=r.scores.to_dict(with_token_probs=False, with_grad_profile=False),
            risk=r.risk,
            action=d.action if d is not None else None,
            rule=d.rule if d is not None else None,
            shown=d.shown if d is not None else True,
            escalated=escalated,
            second_opinion=_second_opinion(d),
            prompt=_prompt(r.prompt) if keep else None,
            response=r.text if keep else None,
            tokens=_pieces(tokens, r.request_id) if keep else None,
            token_probs=[float(p) for p in r.scores.token_probs] if keep else None,
            ended=r.ended,
        )
        try:
            self.store.record(reply, sample)
        except Exception as exc:  # the reply was decided and audited: never fail it here
            self.errors_ += 1
            log.error("store_record_failed", request_id=r.request_id, error=f"{type(exc).__name__}: {exc}")
        return sample


def _pieces(tokens: Callable[[], list[str]], request_id: str) -> list[str] | None:
    """The reply's token pieces, or None where it has none: a blank reply (a model that ends its
    turn at once) cannot be tokenized, and must still be recorded, text and all, not fail."""
    try:
        return tokens()
    except Exception as exc:
        log.warning("store_token_pieces_unavailable", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
        return None


def _prompt(prompt: Any) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        return prompt
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def _second_opinion(d: Any) -> dict[str, Any] | None:
    so = getattr(d, "second_opinion", None) if d is not None else None
    if so is None:
        return None
    from dataclasses import asdict, is_dataclass

    return asdict(so) if is_dataclass(so) else dict(so)
