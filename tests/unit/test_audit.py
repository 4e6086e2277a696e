"""Audit log: content, privacy by default, rotation, thread safety, durability across a kill."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from guarduq.errors import GuardUQError
from guarduq.policy.audit import AuditLog, make_record

PROMPT = "What is the capital of France?"
RESPONSE = "The capital of France is Paris."


def record(i: int = 0, **kw) -> dict:
    args = dict(
        request_id=f"req-{i}",
        model_fingerprint="fp123",
        policy={"name": "default", "version": "1.0", "sha256": "ab" * 32},
        calibrator_sha256="cd" * 32,
        scores={"epistemic": 1.5, "aleatoric": 0.2, "n_tokens": 7},
        risk=0.25,
        decision={"action": "allow", "rule": "confident", "shown": True, "shadow": False, "errors": []},
        latency_s=0.1234,
        prompt=PROMPT,
        response=RESPONSE,
    )
    args.update(kw)
    return make_record(**args)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_record_content(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append(record())
    (row,) = lines(tmp_path / "audit.jsonl")
    assert row["request_id"] == "req-0" and row["model_fingerprint"] == "fp123"
    assert row["policy"] == {"name": "default", "version": "1.0", "sha256": "ab" * 32}
    assert row["calibrator_sha256"] == "cd" * 32
    assert row["scores"]["epistemic"] == 1.5 and row["risk"] == 0.25
    assert (row["rule"], row["action"], row["shown"]) == ("confident", "allow", True)
    assert row["latency_ms"] == pytest.approx(123.4)
    assert row["time"].endswith("+00:00")


def test_privacy_by_default(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append(record())
    raw = (tmp_path / "audit.jsonl").read_text()
    assert "Paris" not in raw and "France" not in raw
    (row,) = lines(tmp_path / "audit.jsonl")
    assert row["prompt_sha256"] == hashlib.sha256(PROMPT.encode()).hexdigest()
    assert row["response_sha256"] == hashlib.sha256(RESPONSE.encode()).hexdigest()
    assert (row["prompt_chars"], row["response_chars"]) == (len(PROMPT), len(RESPONSE))
    assert "prompt" not in row and "response" not in row


def test_text_only_when_enabled(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    log.append(record(log_text=True, prompt=messages))
    (row,) = lines(tmp_path / "audit.jsonl")
    assert row["prompt"] == messages and row["response"] == RESPONSE
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True)
    assert row["prompt_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()


def test_non_finite_numbers_stay_valid_json(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append(record(risk=float("nan"), scores={"epistemic": float("inf")}))
    (row,) = lines(tmp_path / "audit.jsonl")  # json.loads of a NaN token would still parse;
    assert "NaN" not in (tmp_path / "audit.jsonl").read_text()  # strict JSON has none
    assert row["risk"] is None and row["scores"]["epistemic"] is None


def test_unserialisable_record_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(GuardUQError, match="not JSON-serialisable"):
        AuditLog(tmp_path / "a.jsonl").append({"x": object()})


def test_rotation_by_size(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    one = len(json.dumps(record(10), sort_keys=True)) + 1
    log = AuditLog(path, max_bytes=3 * one + 10, backups=2)  # three lines fit in a file
    for i in range(10, 20):
        log.append(record(i))
    files = log.files()
    assert files == [path, path.with_name("audit.jsonl.1"), path.with_name("audit.jsonl.2")]
    assert not path.with_name("audit.jsonl.3").exists()
    assert all(f.stat().st_size <= log.max_bytes for f in files)
    ids = [r["request_id"] for f in reversed(files) for r in lines(f)]
    # 10 records, 3 per file, 3 files kept: the oldest file (req-10..12) was dropped
    assert ids == [f"req-{i}" for i in range(13, 20)]


def test_rotation_without_backups_truncates(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "a.jsonl", max_bytes=50, backups=0)
    log.append(record(1))
    log.append(record(2))  # longer than the cap: alone in a fresh file
    assert [r["request_id"] for r in lines(tmp_path / "a.jsonl")] == ["req-2"]
    assert log.files() == [tmp_path / "a.jsonl"]


def test_bad_settings() -> None:
    with pytest.raises(GuardUQError):
        AuditLog("x.jsonl", max_bytes=0)
    with pytest.raises(GuardUQError):
        AuditLog("x.jsonl", backups=-1)


def test_thread_safe(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", max_bytes=10**9)

    def worker(k: int) -> None:
        for i in range(40):
            log.append(record(k * 1000 + i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = sorted(r["request_id"] for r in lines(tmp_path / "audit.jsonl"))
    assert ids == sorted(f"req-{k * 1000 + i}" for k in range(8) for i in range(40))


def test_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(GuardUQError, match="cannot write audit log"):
        AuditLog(tmp_path / "dir.jsonl").append(record())


def test_a_process_killed_right_after_a_call_leaves_a_complete_last_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    script = textwrap.dedent(f"""\
        import os, signal, sys
        from guarduq.policy.audit import AuditLog, make_record
        log = AuditLog({str(path)!r})
        for i in range(3):
            log.append(make_record(request_id=f"req-{{i}}", model_fingerprint="fp", policy=None,
                                   calibrator_sha256=None, scores={{"n_tokens": i}}, risk=0.1,
                                   decision={{"action": "allow"}}, latency_s=0.0))
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no buffer flush: only what is on disk
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    text = path.read_text()
    assert text.endswith("\n")
    assert [r["request_id"] for r in map(json.loads, text.splitlines())] == ["req-0", "req-1", "req-2"]
