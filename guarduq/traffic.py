"""Recording decided replies in a store, and drawing the ones that go to human review.

``Traffic`` sits beside the audit log in the Guard's decide step: every decided reply becomes
one ``ReplyRecord`` (scores, risk, decision, the policy and calibrator that decided), and the
policy's ``review`` settings draw the sample reviewers will label (every escalation, a uniform
random share of all replies, optionally more from risk bands), each with its inclusion
probability, which is what lets calibration reweight the sample back to the traffic.

Text is kept only where the policy opts in: ``audit.log_text`` keeps every reply's text (as the
audit log does), ``review.keep_text`` only the sampled replies'. A reply whose text is not kept
is still recorded (its scores feed drift and counts) but cannot be labelled for calibration.

The audit log stays the durable record of every call; the store is written by a background
thread, so a slow, failing or unreachable database never holds a reply up or fails it (failed and
dropped writes are logged and counted).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from guarduq._logging import get_logger

if TYPE_CHECKING:  # the store extra (SQLAlchemy) is only needed when a store is configured
    from guarduq.decider import Decider
    from guarduq.store import Store
    from guarduq.store.records import ReplyRecord, Sample

log = get_logger("traffic")


MAX_PENDING = 10_000  # replies waiting for the writer; past this they are dropped and counted


class Traffic:
    """A store and one writer thread.

    ``record`` decides on the caller's thread (the sample draw by the deciding pair's sampler,
    what text is kept) and hands the
    write to the writer, so a slow or unreachable database never holds a reply up: past
    ``max_pending`` waiting writes, new ones are dropped and counted (``dropped_``), and a failed
    write is logged and counted (``errors_``). The audit log, written before the reply returns,
    stays the durable record; ``flush()`` waits for the writer (tests, shutdown).
    """

    def __init__(self, store: Store, *, max_pending: int = MAX_PENDING) -> None:
        self.store = store
        self.written_ = self.errors_ = self.dropped_ = 0
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=max_pending)
        self._writer = threading.Thread(target=self._write_loop, name="guarduq-store-writer", daemon=True)
        self._writer.start()
        atexit.register(self.flush, 5.0)

    @classmethod
    def open(cls, store: Store | str | os.PathLike[str]) -> Traffic:
        """A store, given as an object or a URL."""
        from guarduq.store import Store

        return cls(store if isinstance(store, Store) else Store(str(store)))

    def record(self, r: Any, pair: Decider, *, tokens: Callable[[], list[str]]) -> Sample | None:
        """Queue the decided reply ``r`` (a ``GuardedResponse``) for the store; returns its
        review sample. ``pair``: the ``Decider`` that decided it, whose sampler draws the sample and
        whose policy says which text is kept; the record names it as ``r.decided_by`` does.

        ``tokens()`` gives the reply's token pieces, kept with the text for shading by
        probability. It is called here, on the caller's thread, and only when the text is kept:
        a tokenizer is not safe to share between threads (a Rust tokenizer raises "Already
        borrowed" when one thread pads a batch while another decodes).
        """
        d = r.decision
        escalated = d is not None and d.action == "escalate"
        ctx = getattr(r, "in_force", None)  # a drift action may raise review (policy on_drift)
        rate = ctx.review_rate if ctx is not None else 0.0
        sampler = pair.review_sampler
        sample = sampler.draw(r.risk, escalated, drift_rate=rate) if sampler is not None else None
        keep = pair.keeps_text(sample is not None and sample.sampled)
        pieces = _pieces(tokens, r.request_id) if keep else None
        try:
            self._queue.put_nowait((r, pieces, sample, keep, escalated))
        except queue.Full:
            self.dropped_ += 1
            log.error("store_write_dropped", request_id=r.request_id, pending=self._queue.qsize(),
                      reason="the store is not keeping up")
        return sample

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every queued reply is written (or failed); False if ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self.store.record(*_reply(*job))
                self.written_ += 1
            except Exception as exc:  # the reply was decided and audited: never fail it here
                self.errors_ += 1
                log.error("store_record_failed", request_id=job[0].request_id, error=f"{type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()
        self._queue.task_done()


def _reply(r: Any, pieces: list[str] | None, sample: Sample | None, keep: bool,
           escalated: bool) -> tuple[ReplyRecord, Sample | None]:
    """The store's record of ``r``: text only when ``keep``; the pair that decided it is
    ``r.decided_by``, the identity the Guard gave the reply."""
    from guarduq.store.records import ReplyRecord

    d = r.decision
    ident = r.decided_by
    reply = ReplyRecord(
        request_id=r.request_id,
        time=datetime.now(UTC),
        model_fingerprint=r.model.fingerprint,
        policy=ident.policy if ident is not None else None,
        policy_sha256=ident.policy_sha256 if ident is not None else None,
        calibrator_sha256=ident.calibrator_sha256 if ident is not None else None,
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
        tokens=pieces,
        token_probs=[float(p) for p in r.scores.token_probs] if keep else None,
        ended=r.ended,
        group=getattr(r.in_force, "group", None),
        drift=getattr(r.in_force, "drift", None),
    )
    return reply, sample


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
