"""Escalation sinks: where a case goes when a policy says a human (or another system) must look.

Three variants, one small class each, built by ``make_sink`` from a plain-string ``type``
(so a YAML file can name them):

* ``jsonl``: append one JSON line per case to a queue file (flush + fsync: a case that was
  acknowledged survives a crash).
* ``webhook``: POST the case as JSON to an http(s) URL, with a timeout and a bounded number of
  retries with exponential backoff; when every try fails the sink raises ``EscalationError``
  and the policy's ``on_error`` decides what the user sees.
* ``callable``: call a Python function named by import path. Importing code named in a config
  file is code execution, so the caller must opt in with an exact allow-list of paths.

A sink receives one JSON-ready ``dict`` (prompt, response, scores, decision, ids); it knows
nothing of policies.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from guarduq._logging import get_logger
from guarduq.errors import EscalationError, PolicyError
from guarduq.policy.audit import append_durably, json_line

log = get_logger("escalation")

Case = Mapping[str, Any]


# ---------------------------------------------------------------- configuration (YAML boundary)


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JsonlSinkConfig(_Config):
    type: Literal["jsonl"]
    path: str = Field(min_length=1, description="queue file; relative paths are resolved against the policy file")


class WebhookSinkConfig(_Config):
    type: Literal["webhook"]
    url: str
    timeout_s: float = Field(default=5.0, gt=0, le=120)
    retries: int = Field(default=2, ge=0, le=10, description="extra tries after the first")
    backoff_s: float = Field(default=0.5, ge=0, le=60, description="wait before retry k is backoff_s * 2**k")
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http_only(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("webhook url must start with http:// or https://")
        return url


class CallableSinkConfig(_Config):
    type: Literal["callable"]
    target: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$",
        description="import path 'package.module.function'",
    )


SinkConfig = Annotated[
    JsonlSinkConfig | WebhookSinkConfig | CallableSinkConfig, Field(discriminator="type")
]


# ---------------------------------------------------------------- sinks


class Sink:
    """Accepts one case or raises ``EscalationError``."""

    kind: str = "base"

    def send(self, case: Case) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:
        return self.kind


def _json_line(case: Case) -> bytes:
    try:
        return json_line(case)
    except TypeError as exc:
        raise EscalationError(f"case is not JSON-serialisable: {exc}") from exc


class JsonlSink(Sink):
    """Append-only queue file; each ``send`` is on disk (fsynced) when it returns."""

    kind = "jsonl"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def send(self, case: Case) -> None:
        line = _json_line(case)
        try:
            with self._lock:
                append_durably(self.path, line)
        except OSError as exc:
            raise EscalationError(f"jsonl sink cannot write {self.path}: {exc}") from exc

    def describe(self) -> str:
        return f"jsonl:{self.path}"


class WebhookSink(Sink):
    """POST JSON to a URL. 2xx is success; 429/5xx/network errors are retried; other 4xx are not."""

    kind = "webhook"

    def __init__(
        self,
        url: str,
        timeout_s: float = 5.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        headers: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.headers = dict(headers or {})
        self._sleep = sleep

    def send(self, case: Case) -> None:
        body = _json_line(case)
        headers = {"Content-Type": "application/json", **self.headers}
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:  # noqa: S310 (scheme checked)
                    resp.read()
                    return
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
                if exc.code != 429 and exc.code < 500:
                    break  # the receiver rejected the case; retrying will not change its mind
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"{type(reason).__name__}: {reason}"
            log.warning("webhook_attempt_failed", url=self.url, attempt=attempt + 1, error=last)
        raise EscalationError(f"webhook {self.url} failed after {attempt + 1} attempt(s): {last}")

    def describe(self) -> str:
        return f"webhook:{self.url}"


class CallableSink(Sink):
    """Calls ``fn(case)``; any exception it raises becomes ``EscalationError``."""

    kind = "callable"

    def __init__(self, fn: Callable[[Case], Any], target: str = "") -> None:
        self.fn = fn
        self.target = target or getattr(fn, "__qualname__", repr(fn))

    def send(self, case: Case) -> None:
        try:
            self.fn(case)
        except Exception as exc:  # user code: anything it raises is a sink failure
            raise EscalationError(f"callable sink {self.target} raised {type(exc).__name__}: {exc}") from exc

    def describe(self) -> str:
        return f"callable:{self.target}"


def import_allowed(target: str, allow_callables: Collection[str]) -> Callable[[Case], Any]:
    """Import ``package.module.function`` only if ``target`` is in the allow-list, verbatim."""
    if target not in set(allow_callables):
        raise PolicyError(
            f"callable sink target {target!r} is not allowed: pass it in allow_callables "
            f"(exact import path) to let a policy file run it"
        )
    module_name, _, attr = target.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PolicyError(f"callable sink target {target!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise PolicyError(f"callable sink target {target!r} is not callable")
    return fn


def make_sink(
    config: Mapping[str, Any] | JsonlSinkConfig | WebhookSinkConfig | CallableSinkConfig,
    *,
    base_dir: str | os.PathLike[str] = ".",
    allow_callables: Collection[str] = (),
) -> Sink:
    """Build a sink from its config; ``type`` picks the class ("jsonl", "webhook", "callable")."""
    if isinstance(config, Mapping):
        kind = config.get("type")
        if kind not in _CONFIGS:
            raise PolicyError(f"unknown sink type {kind!r}; expected one of {sorted(_CONFIGS)}")
        try:
            config = _CONFIGS[kind].model_validate(dict(config))
        except ValueError as exc:
            raise PolicyError(f"invalid {kind} sink: {exc}") from exc
    if not isinstance(config, JsonlSinkConfig | WebhookSinkConfig | CallableSinkConfig):
        raise PolicyError(f"a sink config must be a mapping with a 'type', got {type(config).__name__}")
    if isinstance(config, JsonlSinkConfig):
        path = Path(config.path)
        return JsonlSink(path if path.is_absolute() else Path(base_dir) / path)
    if isinstance(config, WebhookSinkConfig):
        return WebhookSink(
            config.url, config.timeout_s, config.retries, config.backoff_s, config.headers
        )
    return CallableSink(import_allowed(config.target, allow_callables), config.target)


_CONFIGS: dict[str, type[_Config]] = {
    "jsonl": JsonlSinkConfig,
    "webhook": WebhookSinkConfig,
    "callable": CallableSinkConfig,
}
