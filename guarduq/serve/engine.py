"""One model, one worker thread, a bounded queue in front of it.

The Guard serialises work per model anyway (``model_lock``); a single worker thread makes the
order explicit, keeps the event loop free, and lets the queue be bounded: past ``max_queue``
waiting jobs ``submit`` raises ``QueueFull`` (the app answers 429 with ``Retry-After``).

Micro-batching: when the Guard has ``generate_batch(prompts, **generation_kwargs)`` and
batching is on, the worker takes the queued non-streaming generate jobs whose generation
settings are identical (no ``seed``, no ``stop``) together, up to ``max_batch``, after waiting
``batch_wait_s`` for more to arrive. Streaming, seeded, stop-string and score jobs run alone.

Between jobs: ``call_between(fn)`` runs ``fn`` on the worker before it takes its next job or
batch, so the one running finishes as it started; a reload swaps the policy/calibrator pair so.

Cancellation: a job whose client went away is skipped if still queued; a running one stops
at the next generated token (non-streaming: a stopping criterion that raises; streaming: the
``Guard.stream`` generator is closed) and is neither scored nor audited.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from guarduq._logging import get_logger
from guarduq.guard import Guard, GuardedResponse
from guarduq.policy.context import traffic_group
from guarduq.scoring.uncertainty import model_lock

log = get_logger("serve")


class QueueFull(Exception):
    """More jobs waiting than the server takes."""


class Cancelled(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The client went away; the job's generation was stopped."""


@dataclass
class Job:
    """One unit of model work. ``kind``: ``generate``, ``stream`` or ``score``."""

    kind: str
    prompt: list[dict[str, str]]
    gen: dict[str, Any] = field(default_factory=dict)
    stop: list[str] | None = None
    seed: int | None = None
    response: str | None = None  # score jobs
    ended: bool = True
    push: Callable[[Any], None] | None = None  # stream jobs: pieces, then the response or an error
    future: concurrent.futures.Future[GuardedResponse] = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started_ns: int = 0
    decider: Any = None  # the Guard's policy/calibrator pair when the worker started the job
    group: str | None = None  # the traffic group whose certificate decides the reply

    def batch_key(self) -> tuple[Any, ...] | None:
        """Jobs with equal keys can share one ``generate_batch`` call; None: run alone."""
        if self.kind != "generate" or self.seed is not None or self.stop:
            return None
        try:
            return (self.group, *sorted(self.gen.items()))  # one batch, one traffic group
        except TypeError:
            return None

    def cancel(self) -> None:
        self.cancelled.set()
        self.future.cancel()


class _CancelCheck:
    """A stopping criterion for ``model.generate`` that aborts when the job is cancelled."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if all(j.cancelled.is_set() for j in self.jobs):
            raise Cancelled()
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


class Engine:
    """The worker thread and its queue. ``on_done(job, response)`` runs on the worker thread."""

    def __init__(self, guard: Guard, *, max_queue: int = 64, batching: bool = True,
                 max_batch: int = 8, batch_wait_s: float = 0.005,
                 on_done: Callable[[Job, GuardedResponse], None] | None = None,
                 on_depth: Callable[[int], None] | None = None,
                 on_start: Callable[[list[Job]], None] | None = None) -> None:
        self.guard = guard
        self.max_queue = max_queue
        self.batching = batching and callable(getattr(guard, "generate_batch", None))
        self.max_batch = max(1, max_batch)
        self.batch_wait_s = batch_wait_s
        self._on_done, self._on_depth, self._on_start = on_done, on_depth, on_start
        self._queue: deque[Job] = deque()
        self._between: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="guarduq-engine", daemon=True)
        self._thread.start()

    # -- the caller's side

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def depth(self) -> int:
        with self._cv:
            return len(self._queue)

    def submit(self, job: Job) -> Job:
        with self._cv:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (max {self.max_queue})")
            self._queue.append(job)
            depth = len(self._queue)
            self._cv.notify()
        self._depth(depth)
        return job

    def call_between(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the worker thread before it takes its next job or batch (the one running
        now finishes first); the future holds its result or its exception."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                fut.set_exception(RuntimeError("the server's worker has stopped"))
                return fut
            self._between.append((fn, fut))
            self._cv.notify_all()
        return fut

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            for job in self._queue:
                job.cancel()
            self._queue.clear()
            for _, fut in self._between:
                fut.set_exception(RuntimeError("the server is shutting down"))
            self._between.clear()
            self._cv.notify_all()
        self._thread.join(timeout)

    # -- the worker's side

    def _depth(self, n: int) -> None:
        if self._on_depth is not None:
            self._on_depth(n)

    def _take(self) -> list[Job] | None:
        with self._cv:
            while not self._queue and not self._between and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            if self._between:  # _loop runs them before the next job
                return []
            job = self._queue.popleft()
            key = job.batch_key() if self.batching else None
            batch = [job]
            if key is not None:
                deadline = time.monotonic() + self.batch_wait_s
                while len(batch) < self.max_batch:
                    batch += self._pop_matching(key, self.max_batch - len(batch))
                    left = deadline - time.monotonic()
                    if len(batch) >= self.max_batch or left <= 0:
                        break
                    self._cv.wait(left)
            depth = len(self._queue)
        self._depth(depth)
        return batch

    def _pop_matching(self, key: tuple[Any, ...], n: int) -> list[Job]:
        out = [j for j in self._queue if j.batch_key() == key][:n]
        for j in out:
            self._queue.remove(j)
        return out

    def _run_between(self) -> None:
        with self._cv:
            calls, self._between = list(self._between), deque()
        for fn, fut in calls:
            if not fut.set_running_or_notify_cancel():  # the caller gave up: do not run it
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller; the worker goes on
                fut.set_exception(exc)

    def _loop(self) -> None:
        while True:
            self._run_between()
            if (batch := self._take()) is None:
                break
            batch = [j for j in batch if not j.cancelled.is_set() and j.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            now_ns, decider = time.time_ns(), getattr(self.guard, "decider", None)
            for j in batch:
                j.started_ns, j.decider = now_ns, decider
            if self._on_start is not None:
                self._on_start(batch)
            try:
                with traffic_group(batch[0].group):  # the Guard decides with this group's certificate
                    if len(batch) > 1:
                        self._run_batch(batch)
                    else:
                        self._run_one(batch[0])
            except BaseException as exc:  # never let the worker die; hand the error on
                for j in batch:
                    self._fail(j, exc)

    def _run_one(self, job: Job) -> None:
        g = self.guard
        if job.kind == "score":
            self._finish(job, g.guarded(job.prompt, job.response or "", ended=job.ended))
        elif job.kind == "stream" or job.stop:
            self._run_stream(job)
        else:
            gen = {**job.gen, "stopping_criteria": [_CancelCheck([job])]}
            try:
                with model_lock(g.model):
                    if job.seed is not None:
                        torch.manual_seed(job.seed)
                    r = g.generate(job.prompt, **gen)
            except Cancelled:
                self._fail(job, Cancelled())
                return
            self._finish(job, r)

    def _run_stream(self, job: Job) -> None:
        """Guard.stream; its generation runs on its own thread, so the seed is set here (this
        worker is the only user of the model's random state in the server process)."""
        if job.seed is not None:
            torch.manual_seed(job.seed)
        pieces = self.guard.stream(job.prompt, stop=job.stop or (), **job.gen)
        try:
            for item in pieces:
                if job.cancelled.is_set():
                    self._fail(job, Cancelled())
                    return
                if isinstance(item, GuardedResponse):
                    self._finish(job, item)
                elif job.kind == "stream" and job.push is not None:
                    job.push(item)
        finally:
            pieces.close()  # stops the generation when the client went away

    def _run_batch(self, batch: list[Job]) -> None:
        # Queued jobs of clients that left were dropped in _loop; a running batch completes.
        out = self.guard.generate_batch([j.prompt for j in batch], **batch[0].gen)  # type: ignore[attr-defined]
        for j, r in zip(batch, out, strict=True):
            self._finish(j, r)

    def _finish(self, job: Job, r: GuardedResponse) -> None:
        if self._on_done is not None:
            try:
                self._on_done(job, r)
            except Exception as exc:  # metrics/drift must never lose a reply
                log.error("serve_on_done_failed", error=f"{type(exc).__name__}: {exc}")
        if job.push is not None:
            job.push(r)
        if not job.future.done():
            job.future.set_result(r)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if job.push is not None:
            job.push(exc)
        if not job.future.done():
            job.future.set_exception(exc)
