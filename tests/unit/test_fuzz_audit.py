"""Fuzz the audit log and the escalation sinks: any record, case, config and path."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guarduq.errors import GuardUQError
from guarduq.policy.audit import AuditLog, make_record
from guarduq.policy.escalation import JsonlSink, make_sink
from tests.unit.fuzz_support import clean, examples, json_values, junk, prompts, texts

pytestmark = pytest.mark.fuzz


@functools.cache
def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="guarduq-fuzz-audit-"))


@functools.cache
def log() -> AuditLog:
    return AuditLog(workdir() / "audit.jsonl", max_bytes=20_000, backups=2)


def _whole_lines(path: Path) -> int:
    """Every line of a JSONL file parses (no torn or partial line); returns the line count."""
    if not path.exists():
        return 0
    raw = path.read_bytes()
    assert not raw or raw.endswith(b"\n"), f"{path} ends with a torn line"
    for line in raw.splitlines():
        json.loads(line)
    return len(raw.splitlines())


records = st.dictionaries(st.one_of(texts, st.integers(), st.none()), st.one_of(junk, json_values), max_size=5)


@examples(1000)
@given(record=st.one_of(records, junk))
def test_audit_append_any_record(record: Any) -> None:
    audit = log()
    before = audit.path.read_bytes() if audit.path.exists() else b""
    r = clean("audit.append", audit.append, record)
    if isinstance(r, GuardUQError):  # refused: nothing written (a rotation may not have happened either)
        assert (audit.path.read_bytes() if audit.path.exists() else b"") == before
    for path in audit.files():
        _whole_lines(path)


@examples(500)
@given(prompt=st.one_of(prompts, texts), response=st.one_of(texts, st.none()), log_text=st.booleans(),
       scores=st.one_of(st.none(), st.dictionaries(texts, st.floats(), max_size=3)), risk=st.one_of(st.none(), st.floats()))
def test_audit_records_of_any_prompt(prompt: Any, response: Any, log_text: bool, scores: Any, risk: Any) -> None:
    def record_and_append() -> None:
        rec = make_record(request_id="r", model_fingerprint="f", policy=None, calibrator_sha256=None,
                          scores=scores, risk=risk, decision=None, latency_s=0.01, prompt=prompt,
                          response=response, log_text=log_text)
        log().append(rec)

    clean("audit.make_record", record_and_append)
    _whole_lines(log().path)


@examples(200)
@given(name=st.one_of(texts, st.sampled_from(["", ".", "..", "a/b/c.jsonl", "\x00x", "/dev/null", "/proc/x"])),
       max_bytes=st.one_of(st.integers(-2, 10**9), junk), backups=st.one_of(st.integers(-2, 10), junk))
def test_audit_log_construction(name: str, max_bytes: Any, backups: Any) -> None:
    target = name if name.startswith("/") else workdir() / "logs" / name
    clean("audit.construct", AuditLog, target, max_bytes=max_bytes, backups=backups)


sink_configs = st.one_of(
    st.fixed_dictionaries({"type": st.just("jsonl"), "path": st.one_of(texts, junk)}),
    st.fixed_dictionaries({"type": st.just("webhook"), "url": st.one_of(texts, junk)},
                          optional={"timeout_s": junk, "retries": junk, "backoff_s": junk, "headers": junk}),
    st.fixed_dictionaries({"type": st.just("callable"), "target": st.one_of(texts, junk)}),
    st.dictionaries(texts, junk, max_size=3),
    junk,
)


@examples(700)
@given(config=sink_configs, allow=st.lists(texts, max_size=2))
def test_make_sink_any_config(config: Any, allow: list[str]) -> None:
    clean("escalation.make_sink", make_sink, config, base_dir=workdir() / "sinks", allow_callables=allow)


@examples(400)
@given(case=st.one_of(records, junk))
def test_jsonl_sink_any_case(case: Any) -> None:
    sink = JsonlSink(workdir() / "queue.jsonl")
    clean("escalation.jsonl_send", sink.send, case)
    _whole_lines(sink.path)
