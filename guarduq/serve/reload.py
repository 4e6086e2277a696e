"""Hot reload for ``guarduq serve``: ``POST /admin/reload``, SIGHUP and ``--watch``.

A reload re-reads the files the server was started with (a path never comes from the network),
builds and checks a whole new policy/calibrator pair (``Decider.reloaded``) off the worker thread,
then has the engine's worker swap it in between jobs: the job or batch running at that moment
finishes on the old pair, every later one uses the new. A pair that fails is refused and the old
one stays; the failure is logged (``reload_failed``), counted
(``guarduq_reloads_total{outcome="failed"}``) and, over HTTP, answered with a 422.

A pair under which a threshold rule of the policy can never match (no threshold certified at its
alpha: every reply the rule would let through is withheld) fails too, by the check ``guarduq
policy check --strict`` makes: :func:`guarduq.decider.check_certified`, the check ``Guard(...)``
and ``Guard.reload`` make. Only an admin's explicit ``POST /admin/reload?force=true`` puts such a
pair in force, logged as a warning; SIGHUP and ``--watch`` never do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guarduq._logging import get_logger
from guarduq.decider import Decider, Identity, check_certified, uncertified
from guarduq.errors import GuardUQError, ReloadError, UncertifiedPairError

# uncertified and UncertifiedPairError lived here; their old import paths keep working
__all__ = ["Prepare", "ReloadResult", "Reloader", "UncertifiedPairError", "install_sighup", "signature",
           "uncertified"]

log = get_logger("serve")

# (old, new) -> None, or what the worker runs together with the swap (e.g. a new drift monitor)
Prepare = Callable[[Decider, Decider], Callable[[], None] | None]


@dataclass(frozen=True)
class ReloadResult:
    old: Identity
    new: Identity

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def to_dict(self) -> dict[str, Any]:
        return {"object": "guarduq.reload", "changed": self.changed, "old": self.old.to_dict(),
                "new": self.new.to_dict()}


class Reloader:
    """The reloads of one server's Guard, one at a time. ``prepare`` runs off the worker thread."""

    def __init__(self, guard: Any, engine: Any, metrics: Any, prepare: Prepare | None = None) -> None:
        self.guard, self.engine, self.metrics, self._prepare = guard, engine, metrics, prepare
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def available(self) -> bool:
        """Whether the Guard holds a ``Decider`` (a stand-in Guard in tests may not)."""
        return isinstance(getattr(self.guard, "decider", None), Decider)

    def reload(self, trigger: str, *, force: bool = False) -> ReloadResult:
        """Build and check a new pair, then swap it in between jobs (blocks until then).
        ``ReloadError`` when it is refused (``UncertifiedPairError`` for an uncertified pair,
        unless ``force``); the pair in force then stays."""
        with self._lock:
            old: Decider = self.guard.decider
            try:
                new = old.reloaded(self.guard.info, parameter_set=self.guard.scorer.parameter_set)
                check_certified(new, force=force, event="reload_forced_uncertified", trigger=trigger,
                                how_to_force="an admin can force it: POST /admin/reload?force=true")
                then = self._prepare(old, new) if self._prepare is not None else None
                self.engine.call_between(lambda: self._swap(new, then)).result()
            except Exception as exc:  # whatever failed, the old pair stays and says so
                self.metrics.reloads.labels("failed").inc()
                detail = str(exc) if isinstance(exc, GuardUQError) else f"{type(exc).__name__}: {exc}"
                log.error("reload_failed", trigger=trigger, error=type(exc).__name__, detail=detail[:1000],
                          **old.identity.to_dict())
                kind = UncertifiedPairError if isinstance(exc, UncertifiedPairError) else ReloadError
                raise kind(f"reload refused; the policy and calibrator in force stay: {detail}") from exc
            result = ReloadResult(old.identity, new.identity)
            self.metrics.reloads.labels("ok").inc()
            log.warning("reloaded", trigger=trigger, changed=result.changed,
                        **{f"new_{k}": v for k, v in result.new.to_dict().items()})
            return result

    def _swap(self, new: Decider, then: Callable[[], None] | None) -> None:
        """On the worker thread, between jobs."""
        if then is not None:
            then()
        self.guard.decider = new

    async def areload(self, trigger: str, *, force: bool = False) -> ReloadResult:
        """``reload`` on a thread: the event loop keeps answering meanwhile."""
        return await asyncio.to_thread(lambda: self.reload(trigger, force=force))

    def spawn(self, trigger: str) -> None:
        """Start a reload from the event loop (SIGHUP); a failure is logged and counted, no more."""
        task = asyncio.get_running_loop().create_task(self._quiet(trigger))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quiet(self, trigger: str) -> None:
        with contextlib.suppress(ReloadError):
            await self.areload(trigger)

    async def watch(self, interval_s: float) -> None:
        """Poll the pair's files' (mtime, size) every ``interval_s`` and reload when one changes
        (a failed reload is retried only when a file changes again)."""
        seen = signature(self.guard.decider.files())
        while True:
            await asyncio.sleep(interval_s)
            now = signature(self.guard.decider.files())
            if now == seen:
                continue
            seen = now
            await self._quiet("watch")
            files = self.guard.decider.files()
            if set(files) != set(seen):  # the new policy names another calibrator file
                seen = signature(files)


def signature(files: Iterable[Path]) -> dict[Path, tuple[int, int] | None]:
    """(mtime_ns, size) of each file; None where it cannot be read (mid-replace, deleted)."""
    out: dict[Path, tuple[int, int] | None] = {}
    for f in files:
        try:
            st = os.stat(f)
            out[f] = (st.st_mtime_ns, st.st_size)
        except OSError:
            out[f] = None
    return out


def install_sighup(reloader: Reloader) -> Callable[[], None] | None:
    """SIGHUP -> reload, on POSIX when the event loop runs on the main thread (``guarduq serve``);
    returns the function that removes the handler, or None where none was installed."""
    sig = getattr(signal, "SIGHUP", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(sig, reloader.spawn, "sighup")
    return lambda: loop.remove_signal_handler(sig)
