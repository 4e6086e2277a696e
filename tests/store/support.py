"""Helpers for the store tests: replies and samples to record, and the worker process."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from guarduq.store.records import ReplyRecord, Sample

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
WORKER = Path(__file__).with_name("worker.py")

UNIFORM = Sample(("uniform",), True, 0.1, 0.0, 0.1)
ESCALATION = Sample(("escalation",), False, 0.1, 1.0, 1.0)
ESCALATION_UNIFORM = Sample(("escalation", "uniform"), True, 0.1, 1.0, 1.0)
BAND = Sample(("band",), False, 0.1, 0.5, 0.55)
NOT_SAMPLED = Sample((), False, 0.1, 0.0, 0.1)


def reply(i: int, *, risk: float | None = 0.5, action: str | None = "allow", **kw: Any) -> ReplyRecord:
    """Reply ``i`` (newer for larger ``i``), text kept unless overridden."""
    fields: dict[str, Any] = {
        "request_id": f"req{i:04d}",
        "time": T0 + timedelta(minutes=i),
        "model_fingerprint": "f" * 32,
        "policy": "default@1.0",
        "policy_sha256": "a" * 64,
        "calibrator_sha256": "b" * 64,
        "parameter_set": "all",
        "scores": {"epistemic": 0.012, "aleatoric": 0.21, "n_tokens": 3, "valid": True, "reason": None},
        "risk": risk,
        "action": action,
        "rule": "confident" if action == "allow" else "uncertain",
        "shown": action == "allow",
        "escalated": action == "escalate",
        "prompt": f"question {i}?",
        "response": f"answer {i}",
        "tokens": ["ans", "wer"],
        "token_probs": [0.5, 0.25],
    }
    fields.update(kw)
    return ReplyRecord(**fields)


def worker(*args: str, **popen: Any) -> subprocess.Popen[str]:
    """``tests/store/worker.py`` in a fresh interpreter (see its docstring for the modes)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(WORKER), *args], text=True, env=env, **popen)
