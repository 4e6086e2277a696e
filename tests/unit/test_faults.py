"""Faults: ``kill -9`` during ``guarduq calibrate``; read-only, full or unwritable storage."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from guarduq import Guard
from guarduq.calibration.evaluation import ScoreCache
from guarduq.cli import main
from guarduq.errors import StorageError
from guarduq.policy.audit import AuditLog

ROOT = Path(__file__).resolve().parents[2]
N_ITEMS = 40
BATCH = 2  # items per appended batch: a kill loses at most this many

# `guarduq calibrate` with every item slowed down, so a kill lands at a random point of the run.
# score_dataset calls score_items once per batch, so that is what is slowed (per item in the batch).
SLOW_CLI = textwrap.dedent(
    """
    import sys, time
    from guarduq.calibration import evaluation
    real = evaluation.score_items
    def slow(guard, items, **k):
        time.sleep(float(sys.argv[1]) * len(items))
        return real(guard, items, **k)
    evaluation.score_items = slow
    from guarduq.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


def _data(tmp_path: Path) -> Path:
    rows = [{"id": str(i), "prompt": f"Say something {i}", "response": "ok" if i % 3 else "a much longer reply",
             "label": int(i % 3 != 0)} for i in range(N_ITEMS)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _argv(model: Path, data: Path, runs: Path, out: Path) -> list[str]:
    return ["calibrate", "--model", str(model), "--dataset", "jsonl", "--data", str(data), "--runs-dir", str(runs),
            "--out", str(out), "--no-progress", "--json", "--alpha", "0.3", "--alpha", "0.5", "--delta", "0.2",
            "--test-fraction", "0.25", "--threshold-fraction", "0.25", "--batch-size", str(BATCH)]


def _cache_lines(runs: Path) -> list[bytes]:
    files = list((runs / "cache").rglob("*.jsonl"))
    return files[0].read_bytes().split(b"\n") if files else [b""]


def _params(path: Path) -> dict:
    doc = json.loads(path.read_text())
    return {"scaler": doc["scaler"], "logistic": doc["logistic"], "thresholds": doc["thresholds"],
            "n_fit": doc["n_fit"], "metrics": doc["metrics"]}


def _close(a, b, path="") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9), path
    else:
        assert a == b, path


@pytest.mark.slow
@pytest.mark.long
def test_kill_9_during_calibrate_then_rerun_equals_an_uninterrupted_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    seed = int(os.environ.get("GUARDUQ_FAULT_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    data = _data(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = tmp_path / "slow_cli.py"
    script.write_text(SLOW_CLI)

    def run(runs: Path, out: Path, delay: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(delay), *_argv(tiny_model_dir, data, runs, out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    reference = tmp_path / "ref.json"
    proc = run(tmp_path / "ref-runs", reference, 0.0)
    assert proc.wait(timeout=240) == 0, proc.stderr.read().decode()[-2000:]

    runs, out = tmp_path / "runs", tmp_path / "cal.json"
    kills = []
    for _ in range(3):  # kill -9 after a random number of new items (0: while it starts up)
        cached = sum(1 for line in _cache_lines(runs)[:-1] if line.strip())
        # At most half of what is left (minus a batch of overshoot), so the run never ends before the kill.
        more = rng.randrange(0, max(1, (N_ITEMS - cached - 2 * BATCH) // 2))
        wait = rng.uniform(0, 3) if more == 0 else 0.0
        proc = run(runs, out, 0.08)
        t0, deadline = time.monotonic(), time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            done = sum(1 for line in _cache_lines(runs)[:-1] if line.strip())
            if done >= cached + more and time.monotonic() - t0 >= wait:
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"the run ended before the kill (seed {seed}): {proc.stderr.read().decode()[-800:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        lines = _cache_lines(runs)
        kills.append(sum(1 for line in lines[:-1] if line.strip()))
        for line in lines[:-1]:  # every complete line is whole JSON; only the last may be torn
            if line.strip():
                json.loads(line)
        assert not out.exists(), "a killed run wrote a calibrator"
        assert not list(tmp_path.glob(".cal.json.*")), "a killed run left a temp file"

    proc = run(runs, out, 0.0)
    assert proc.wait(timeout=240) == 0, proc.stderr.read().decode()[-2000:]
    raw = b"\n".join(_cache_lines(runs))
    assert raw.endswith(b"\n")
    ids = [json.loads(line)["id"] for line in raw.splitlines()]
    assert sorted(ids) == sorted(f"jsonl:{i}" for i in range(N_ITEMS)), f"seed {seed}, kills at {kills}"
    _close(_params(out), _params(reference))
    print(f"kill -9 points (cached items): {kills}; seed {seed}")


# --------------------------------------------------------------------------- storage faults


def _refuse_writes_under(monkeypatch: pytest.MonkeyPatch, folder: Path, code: int) -> None:
    """Make the OS refuse writes to files under ``folder`` (a read-only mount or a full disk)."""
    real_open, real_write = os.open, os.write
    fds: set[int] = set()

    def fake_open(path, flags, *args, **kwargs):
        if Path(path).resolve().is_relative_to(folder.resolve()) and flags & (os.O_WRONLY | os.O_RDWR):
            if code == errno.EROFS:
                raise OSError(code, os.strerror(code), str(path))
            fd = real_open(path, flags, *args, **kwargs)
            fds.add(fd)
            return fd
        return real_open(path, flags, *args, **kwargs)

    def fake_write(fd, data):
        if fd in fds:
            n = real_write(fd, bytes(data[: max(1, len(data) // 2)]))  # half a line lands, then ENOSPC
            if n:
                raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "write", fake_write)


def _statvfs_full(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    def full(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, st.f_files, st.f_ffree,
                                  st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(os, "statvfs", full)


def test_read_only_audit_folder_fails_at_guard_construction(tmp_path, monkeypatch, llama, tokenizer):
    ro = tmp_path / "ro"
    ro.mkdir()
    _refuse_writes_under(monkeypatch, ro, errno.EROFS)
    with pytest.raises(StorageError, match="audit log .*Read-only file system"):
        Guard((llama, tokenizer), audit=ro / "audit.jsonl")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores chmod: the read-only case runs monkeypatched above")
def test_chmod_read_only_audit_folder_fails_at_guard_construction(tmp_path, llama, tokenizer):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(StorageError, match="audit log"):
            Guard((llama, tokenizer), audit=ro / "audit.jsonl")
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("where", ["a directory", "under a file", "full disk"])
def test_unwritable_audit_path_fails_at_start(tmp_path, monkeypatch, llama, tokenizer, where):
    (tmp_path / "file").write_text("x")
    path = {"a directory": tmp_path, "under a file": tmp_path / "file" / "audit.jsonl",
            "full disk": tmp_path / "audit.jsonl"}[where]
    if where == "full disk":
        _statvfs_full(monkeypatch)
    with pytest.raises(StorageError, match="audit log"):
        Guard((llama, tokenizer), audit=path)
    assert not (tmp_path / "audit.jsonl").exists()


def test_disk_filling_up_mid_run_leaves_no_torn_audit_line(tmp_path, monkeypatch, llama, tokenizer):
    path = tmp_path / "audit.jsonl"
    guard = Guard((llama, tokenizer), audit=path)
    guard.guarded("Name a colour.", "Blue")
    before = path.read_bytes()
    _refuse_writes_under(monkeypatch, tmp_path, errno.ENOSPC)
    with pytest.raises(StorageError, match="No space left"):
        guard.guarded("Name a colour.", "Red")
    assert path.read_bytes() == before  # the half-written line was cut back


def test_dev_full_audit_path_is_a_clear_error(llama, tokenizer):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    guard = Guard((llama, tokenizer), audit=AuditLog("/dev/full"))
    with pytest.raises(StorageError, match="No space left"):
        guard.guarded("Name a colour.", "Blue")


@pytest.mark.parametrize("fault", [errno.EROFS, "full disk", "a directory"])
def test_unwritable_score_cache_fails_at_open(tmp_path, monkeypatch, fault):
    path = tmp_path / "cache" / "c.jsonl"
    if fault == errno.EROFS:
        (tmp_path / "cache").mkdir()
        _refuse_writes_under(monkeypatch, tmp_path / "cache", errno.EROFS)
    elif fault == "full disk":
        _statvfs_full(monkeypatch)
    else:
        path.mkdir(parents=True)
    with pytest.raises(StorageError, match="scoring cache"):
        ScoreCache(path)
    ScoreCache(tmp_path / "elsewhere.jsonl", read_only=True)  # a reader needs no write access


@pytest.mark.parametrize("fault", ["read-only runs dir", "full disk", "read-only out dir"])
def test_calibrate_fails_before_loading_the_model(tmp_path, monkeypatch, capsys, fault):
    data = _data(tmp_path)
    runs, out = tmp_path / "runs", tmp_path / "out" / "cal.json"
    for d in (runs, out.parent):
        d.mkdir()
    if fault == "full disk":
        _statvfs_full(monkeypatch)
    else:
        _refuse_writes_under(monkeypatch, runs if fault.endswith("runs dir") else out.parent, errno.EROFS)
    # The model does not exist: reaching it would be a different error, so this proves the order.
    assert main(_argv(Path("no-such-model"), data, runs, out)) == 2
    err = capsys.readouterr().err
    assert ("No space left" in err or "Read-only" in err or "no space left" in err) and err.count("\n") == 1
    assert not out.exists()
