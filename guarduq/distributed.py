"""Offline scoring spread over Ray actors, each holding one model (``--ray [ADDRESS]``).

One actor per GPU when the cluster has GPUs (and the device asked for is not "cpu"), else one
per ``cpus_per_actor`` CPU cores. Actors only compute: they receive batches of items (as plain
dicts) and return records (plain dicts); the driver alone writes the resumable cache, through the
same ``score_dataset`` loop as a single process, so a killed run resumes the same way and the
records are the ones a single process writes (same code, same weights; floating-point sums may
differ in the last bits when the actors use another number of threads).

Ray is an optional extra (``pip install 'guarduq[ray]'``); nothing below this module imports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

from guarduq import batching
from guarduq._logging import get_logger
from guarduq.calibration.datasets import Item
from guarduq.calibration.evaluation import ScoredItem, score_items
from guarduq.errors import GuardUQError, InputError, ScoringError
from guarduq.models import ModelInfo
from guarduq.scoring.uncertainty import Scores

log = get_logger("distributed")

DEFAULT_CPUS_PER_ACTOR = 4


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise InputError("--ray needs Ray: pip install 'guarduq[ray]'") from exc
    return ray


class _Worker:
    """The actor body: one Guard, fed batches by the driver."""

    def __init__(self, spec: str, guard_kwargs: dict[str, Any]) -> None:
        from guarduq.guard import Guard  # the actor's process imports the model stack itself

        self.guard = Guard(spec, **guard_kwargs)

    def describe(self) -> dict[str, Any]:
        from guarduq.layout import has_chat_template

        return {"info": asdict(self.guard.info), "chat_template": has_chat_template(self.guard.tokenizer),
                "parameter_set": self.guard.scorer.parameter_set}

    def score_items(self, rows: list[dict[str, Any]], max_new_tokens: int) -> list[dict[str, Any]]:
        items = [Item(**row) for row in rows]
        return [asdict(r) for r in score_items(self.guard, items, max_new_tokens=max_new_tokens)]

    def score_pairs(self, pairs: list[tuple[str, str]], ended: list[bool]) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.guard.score_batch(pairs, ended=ended)]


class RayScorer:
    """A pool of Ray actors that score like a ``Guard`` (``score_dataset`` takes it as a guard).

    ``address``: None starts a local Ray instance (or joins ``RAY_ADDRESS``); "auto" or
    "ray://host:port" joins a cluster. A Ray instance already initialised in this process is
    used as it is, and left running.
    """

    def __init__(
        self,
        model: str,
        *,
        address: str | None = None,
        cpus_per_actor: int = DEFAULT_CPUS_PER_ACTOR,
        max_actors: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        scoring: dict[str, Any] | None = None,
    ) -> None:
        ray = self._ray = _ray()
        if cpus_per_actor < 1 or (max_actors is not None and max_actors < 1):
            raise InputError("cpus_per_actor and max_actors must be >= 1")
        if device is not None and str(device).startswith("cuda:"):
            raise InputError("with Ray each actor holds one GPU: pass --device cuda, not cuda:N")
        self._started = not ray.is_initialized()
        if self._started:
            try:
                ray.init(address=address or None, include_dashboard=False, logging_level="warning")
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise InputError(f"cannot start or join Ray at {address or 'local'}: {exc}") from exc
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), max(1, int(resources.get("CPU", 1)))
        if gpus and device != "cpu":
            n, options, device = gpus, {"num_gpus": 1, "num_cpus": 1}, "cuda"
        else:
            per = min(cpus_per_actor, cpus)
            n, options = max(1, cpus // per), {"num_cpus": per}
        n = min(n, max_actors) if max_actors else n
        worker = ray.remote(_Worker)
        kwargs = {"device": device, "dtype": dtype, **(scoring or {})}  # scoring: the parameter set
        self.actors = [worker.options(**options).remote(model, kwargs) for _ in range(n)]
        log.info("ray_actors", n=n, **options)
        try:  # an actor that cannot load the model fails here, with the model's own error
            described = self._get([a.describe.remote() for a in self.actors])
            fingerprints = {d["info"]["fingerprint"] for d in described}
            if len(fingerprints) != 1:
                raise ScoringError(f"the Ray actors loaded different weights (fingerprints {sorted(fingerprints)})")
        except BaseException:
            self.close()
            raise
        self.info = ModelInfo(**described[0]["info"])
        self.chat_template = bool(described[0]["chat_template"])
        self.parameter_set = str(described[0]["parameter_set"])  # what the actors' scores cover

    def _get(self, refs: Any) -> Any:
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayError as exc:
            raise _error(exc) from exc

    def _pool(self) -> Any:
        from ray.util import ActorPool

        return ActorPool(self.actors)

    def score_item_batches(self, batches: list[list[Item]], *, max_new_tokens: int) -> Iterator[list[ScoredItem]]:
        """Each batch's records as soon as an actor returns them (completion order)."""
        pool = self._pool()
        for batch in batches:
            pool.submit(lambda a, b: a.score_items.remote([asdict(i) for i in b], max_new_tokens), batch)
        while pool.has_next():
            try:
                rows = pool.get_next_unordered()
            except self._ray.exceptions.RayError as exc:
                raise _error(exc) from exc
            yield [ScoredItem(**row) for row in rows]

    def score_pairs(
        self, pairs: Sequence[tuple[str, str]], ended: Sequence[bool], *, batch_size: int | None = None
    ) -> list[Scores]:
        """Scores of (prompt, response) pairs, in order, ``batch_size`` pairs per actor call."""
        size = batching.check_batch_size(batch_size)
        chunks = list(batching.chunked(list(zip(pairs, ended, strict=True)), size))
        refs = []
        for i, chunk in enumerate(chunks):
            actor = self.actors[i % len(self.actors)]
            refs.append(actor.score_pairs.remote([p for p, _ in chunk], [e for _, e in chunk]))
        return [Scores.from_dict(d) for rows in self._get(refs) for d in rows]

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self.actors = []
        if self._started:
            self._ray.shutdown()

    def __enter__(self) -> RayScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error(exc: BaseException) -> GuardUQError:
    """An actor's GuardUQError as itself (e.g. a bad model spec); anything else as ScoringError."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, GuardUQError):
        return cause
    lines = str(cause or exc).strip().splitlines()
    return ScoringError(f"a Ray actor failed: {lines[-1] if lines else type(exc).__name__}")
