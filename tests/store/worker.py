"""A second process writing to a store, for the concurrency and kill -9 tests.

    worker.py write URL PREFIX N START_AT   record N sampled replies, labelling each, from START_AT
    worker.py label URL PREFIX              record one item, then label it forever, printing
                                            each label's id once add_label has returned

Imports ``guarduq.store`` without running ``guarduq/__init__`` (which loads torch): the store
layer needs none of it, and each process starts in a fraction of the time.
"""

from __future__ import annotations

import sys
import time
import types
from datetime import UTC, datetime
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "guarduq"
_stub = types.ModuleType("guarduq")
_stub.__path__ = [str(PKG)]
sys.modules.setdefault("guarduq", _stub)

from guarduq.store import ReplyRecord, Sample, Store  # noqa: E402

UNIFORM = Sample(("uniform",), True, 0.5, 0.0, 0.5)


def _reply(rid: str, risk: float) -> ReplyRecord:
    return ReplyRecord(
        request_id=rid, time=datetime.now(UTC), model_fingerprint="f" * 32, policy="p@1",
        policy_sha256=None, calibrator_sha256=None, parameter_set="all", scores={"epistemic": 0.1},
        risk=risk, action="allow", rule="r", shown=True, escalated=False, prompt="q?", response="a",
    )


def write(url: str, prefix: str, n: int, start_at: float) -> None:
    time.sleep(max(0.0, start_at - time.time()))  # both workers open the store at once
    store = Store(url)
    for i in range(n):
        rid = f"{prefix}-{i:04d}"
        store.record(_reply(rid, i / n), UNIFORM)
        store.add_label(rid, reviewer=prefix, label=("right", "wrong", "unsure")[i % 3])
    store.close()
    print("done", flush=True)


def label(url: str, prefix: str) -> None:
    store = Store(url)
    rid = f"{prefix}-item"
    store.record(_reply(rid, 0.5), UNIFORM)
    print("ready", flush=True)
    i = 0
    while True:
        rec = store.add_label(rid, reviewer=prefix, label=("right", "wrong")[i % 2], note=f"n{i}")
        print(rec.id, flush=True)
        i += 1


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "write":
        write(rest[0], rest[1], int(rest[2]), float(rest[3]))
    elif mode == "label":
        label(rest[0], rest[1])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
