"""An append-only audit log: one JSON line per guarded call, on disk before the answer returns.

Each ``append`` writes one line, flushes and fsyncs, so a process killed right after a call
returned still leaves that call's complete line. Files rotate by size (``audit.jsonl`` ->
``audit.jsonl.1`` -> ...), keeping ``backups`` old files.

Privacy by default: ``make_record`` stores the sha256 and the length of the prompt and the
response, never their text, unless the policy sets ``audit: {log_text: true}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from guarduq._storage import append_line, check_writable
from guarduq.errors import GuardUQError, StorageError

PromptLike = str | Sequence[Mapping[str, str]]


def _text_of(value: PromptLike | None) -> tuple[str | None, Any]:
    """A prompt (string or chat messages) as one canonical string for hashing, and as logged."""
    if value is None or isinstance(value, str):
        return value, value
    try:
        messages = [dict(m) for m in value]
        return json.dumps(messages, ensure_ascii=False, sort_keys=True, default=repr), messages
    except (TypeError, ValueError):  # not chat messages: record what it is, never fail the call
        return repr(value), repr(value)


def text_fields(name: str, value: PromptLike | None, *, log_text: bool) -> dict[str, Any]:
    """``{name}_sha256`` and ``{name}_chars``, plus ``name`` itself only when ``log_text``."""
    text, logged = _text_of(value)
    if text is None:
        return {f"{name}_sha256": None, f"{name}_chars": None}
    out: dict[str, Any] = {
        f"{name}_sha256": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
        f"{name}_chars": len(text),
    }
    if log_text:
        out[name] = logged
    return out


def make_record(
    *,
    request_id: str,
    model_fingerprint: str | None,
    policy: Mapping[str, Any] | None,
    calibrator_sha256: str | None,
    scores: Mapping[str, Any] | None,
    risk: float | None,
    decision: Mapping[str, Any] | None,
    latency_s: float,
    prompt: PromptLike | None = None,
    response: str | None = None,
    log_text: bool = False,
    in_force: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The one audit line of a guarded call. ``decision`` is ``Decision.to_dict()``; ``in_force``
    the reply's group, drift case and certificate (``guarduq.policy.context.InForce.to_dict()``)."""
    decision = dict(decision or {})
    record: dict[str, Any] = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "request_id": request_id,
        "model_fingerprint": model_fingerprint,
        "policy": dict(policy) if policy else None,
        "calibrator_sha256": calibrator_sha256,
        "scores": dict(scores) if scores is not None else None,
        "risk": risk,
        "rule": decision.get("rule"),
        "action": decision.get("action"),
        "shown": decision.get("shown"),
        "shadow": decision.get("shadow", False),
        "errors": list(decision.get("errors", ())),
        "latency_ms": round(latency_s * 1000.0, 3),
        **({"in_force": dict(in_force)} if in_force is not None else {}),
    }
    record.update(text_fields("prompt", prompt, log_text=log_text))
    record.update(text_fields("response", response, log_text=log_text))
    return record


class AuditLog:
    """Thread-safe, fsynced, size-rotated JSONL log.

    ``max_bytes`` is a soft cap: a file is rotated before a line that would take it past the cap
    (a single line longer than the cap still gets written, alone, to a fresh file).
    """

    def __init__(
        self, path: str | os.PathLike[str], max_bytes: int = 10_000_000, backups: int = 5
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise GuardUQError(f"audit max_bytes must be a positive integer, got {max_bytes!r}")
        if isinstance(backups, bool) or not isinstance(backups, int) or backups < 0:
            raise GuardUQError(f"audit backups must be an integer >= 0, got {backups!r}")
        # An unwritable path (read-only folder, full disk, a directory) fails here, at start,
        # not in the middle of a request.
        self.path = check_writable(path, "audit log")
        self.max_bytes = int(max_bytes)
        self.backups = int(backups)
        self._lock = threading.Lock()

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record as one line; it is on disk when this returns."""
        try:
            line = json_line(record)
        except (TypeError, ValueError, RecursionError) as exc:
            raise GuardUQError(f"audit record is not JSON-serialisable: {exc}") from exc
        with self._lock:
            try:
                self._rotate_if_needed(len(line))
            except OSError as exc:
                raise StorageError(f"cannot rotate audit log {self.path}: {exc.strerror or exc}") from exc
            append_line(self.path, line, "audit log")

    def _rotate_if_needed(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == 0 or size + incoming <= self.max_bytes:
            return
        if self.backups == 0:
            self.path.unlink()
            return
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def files(self) -> list[Path]:
        """The current file and its backups that exist, newest first."""
        candidates = [self.path] + [
            self.path.with_name(f"{self.path.name}.{i}") for i in range(1, self.backups + 1)
        ]
        return [p for p in candidates if p.exists()]


def append_durably(path: Path, line: bytes) -> None:
    """Append ``line`` and fsync: on disk when this returns (callers hold their own lock).

    A failed write is cut back (no torn line) and raised as ``StorageError`` (an ``OSError``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    append_line(path, line, "file")


def json_line(record: Mapping[str, Any]) -> bytes:
    """One strict JSON line (NaN/inf become null: JSON has no spelling for them).

    Raises ``TypeError`` for values JSON cannot hold. Text without a UTF-8 form (a lone
    surrogate) is written with ``\\u`` escapes instead of failing.
    """
    text = json.dumps(_finite(record), ensure_ascii=False, sort_keys=True, allow_nan=False) + "\n"
    try:
        return text.encode()
    except UnicodeEncodeError:
        return (json.dumps(_finite(record), ensure_ascii=True, sort_keys=True, allow_nan=False) + "\n").encode()


def _finite(value: Any) -> Any:
    """Replace NaN/inf floats by None (JSON has no spelling for them)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
