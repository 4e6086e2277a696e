"""Two processes writing one store at once, and a writer killed with SIGKILL mid-stream."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from guarduq.store import Store
from tests.store.support import worker

N = 200


def test_two_processes_write_at_once(store_url: str) -> None:
    """Both open a fresh database at the same moment (racing to create the schema), then each
    records 200 replies and labels each: all 400 land, none fails."""
    start_at = time.time() + 1.5
    procs = [worker("write", store_url, prefix, str(N), str(start_at),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for prefix in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "done"
    with Store(store_url) as s:
        p = s.progress()
        assert p["replies"] == p["items"] == 2 * N
        assert p["unlabelled"] == 0
        assert p["right"] + p["wrong"] + p["unsure"] == 2 * N
        rows = s.queue(limit=2 * N)
        assert {r.request_id for r in rows} == {f"{x}-{i:04d}" for x in "ab" for i in range(N)}
        assert all(r.n_labels == 1 for r in rows)


def test_committed_labels_survive_kill_9(store_url: str) -> None:
    """Every label id the writer printed (after add_label returned) is in the store after the
    writer is killed with SIGKILL in the middle of its loop."""
    proc = worker("label", store_url, "k", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    printed: list[int] = []
    deadline = time.time() + 60
    try:
        assert proc.stdout.readline().strip() == "ready"
        while len(printed) < 50 and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            printed.append(int(line))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        rest, err = proc.communicate(timeout=30)
    printed += [int(x) for x in rest.split()]  # printed before the kill, read after it
    assert proc.returncode == -signal.SIGKILL
    assert len(printed) >= 50, err
    with Store(store_url) as s:
        item = s.item("k-item")
        assert item is not None
        stored = {rec.id for rec in item.labels}
        missing = sorted(set(printed) - stored)
        assert missing == [], f"labels committed but lost: {missing}"
        s.add_label("k-item", reviewer="after", label="right")  # the store still takes writes


@pytest.mark.parametrize("n", [3])
def test_three_stores_open_a_fresh_database_at_once(store_url: str, n: int) -> None:
    """Schema creation under a race, in threads of one process (separate engines)."""
    import threading

    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def open_one() -> None:
        try:
            barrier.wait()
            Store(store_url).close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
