"""What every group of routes shares: the server's settings, its parts (guard, engine, metrics,
reloader, drift monitor) and the JSON response every route answers with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from guarduq.calibration.drift import DriftMonitor, Reference
from guarduq.decider import Decider
from guarduq.policy.audit import json_line
from guarduq.serve.schema import ApiError


@dataclass(frozen=True)
class Settings:
    """Limits and switches of one server. ``model_ids``: names accepted in ``model`` (the first
    is listed by /v1/models; default: the Guard's model name)."""

    model_ids: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    # key -> name, for the API keys given as NAME:KEY; under the policy's groups.from_key a request
    # that key authenticates belongs to traffic group NAME (guarduq.policy.context.group_of)
    api_key_names: dict[str, str] = field(default_factory=dict)
    admin_keys: tuple[str, ...] = ()  # /admin/*; none: those answer 403
    # Without API keys every route answers this machine only, under a loopback Host name (a
    # DNS-rebinding page cannot reach it); True answers anyone (guarduq serve's flag of that name).
    allow_unauthenticated_remote: bool = False
    reload_on_sighup: bool = False  # installed only where the loop runs on the main thread
    watch_s: float | None = None  # poll the policy/calibrator files this often; reload on change
    max_queue: int = 64
    retry_after_s: int = 1
    max_body_bytes: int = 1_000_000
    max_messages: int = 64
    max_prompt_chars: int = 32_000
    max_prompt_tokens: int = 4096
    max_tokens: int = 512
    default_max_tokens: int | None = None  # None: the Guard's max_new_tokens
    batching: bool = True
    max_batch: int = 8
    batch_wait_s: float = 0.005
    drift_reference: Reference | None = None
    drift_window: int = 500
    drift_min_n: int = 50
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # under the request's


class Json(JSONResponse):
    """Strict JSON with NaN/inf as null (an invalid score is NaN; JSON cannot spell it)."""

    def render(self, content: Any) -> bytes:
        return json_line(content).rstrip(b"\n")


def error_response(exc: ApiError) -> Json:
    return Json(exc.body(), status_code=exc.status, headers=exc.headers)


@dataclass
class Server:
    """One server's parts, handed to each group of routes. ``drift`` is swapped by a reload (on
    the worker thread, with the pair)."""

    guard: Any
    settings: Settings
    model_ids: tuple[str, ...]
    engine: Any
    metrics: Any
    reloader: Any
    drift: DriftMonitor | None = None

    def pair(self) -> Decider:
        return pair_of(self.guard)


def pair_of(guard: Any) -> Decider:
    """The Guard's policy/calibrator pair in force (a stand-in Guard: built from its attributes)."""
    pair = getattr(guard, "decider", None)
    return pair if isinstance(pair, Decider) else Decider(guard.policy, guard.calibrator)
