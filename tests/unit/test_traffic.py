"""Decided replies into the store (``Guard(store=...)``, ``guarduq serve --store``): what is kept,
what is sampled, that the sampling follows a reload, that the store never fails a reply, two
server replicas writing one PostgreSQL store at once, and ``kill -9`` of the review app."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("fastapi")

from guarduq import Guard  # noqa: E402
from guarduq.serve import Settings, create_app  # noqa: E402
from guarduq.store import Store  # noqa: E402
from tests.conftest import make_tokenizer, tiny_llama  # noqa: E402
from tests.unit.serve_helpers import free_port, serving, varied  # noqa: E402
from tests.unit.test_reload import fitted_calibrator_doc, replace_text  # noqa: E402

POLICY = """name: t
version: '{version}'
calibrator: cal.json
{audit}
review:
  keep_text: {keep}
  rate: {rate}
rules:
  - name: ok
    when: {{risk: {{le: 0.5}}}}
    action: allow
  - name: risky
    action: escalate
    message: 'Passed on.'
    sink: log
sinks:
  log: {{type: jsonl, path: escalations.jsonl}}
"""


@pytest.fixture
def model() -> tuple[Any, Any]:
    return tiny_llama(), make_tokenizer()


def write_policy(folder: Path, model: Any, *, rate: float = 1.0, keep: bool = True, log_text: bool = False,
                 version: int = 1) -> Path:
    from guarduq.models import fingerprint

    cal = folder / "cal.json"
    if not cal.exists():
        import json

        cal.write_text(json.dumps(fitted_calibrator_doc(fingerprint(model[0]))))
    policy = folder / "policy.yaml"
    replace_text(policy, POLICY.format(version=version, keep=str(keep).lower(), rate=rate,
                                       audit="audit: {log_text: true}" if log_text else ""))
    return policy


def test_sampled_replies_keep_text_and_token_pieces(tmp_path: Path, model: Any) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    guard = Guard(model, policy=write_policy(tmp_path, model), store=store, max_new_tokens=6)
    rs = [guard.generate(p, **varied(guard.tokenizer)) for p in ("hello", "what is 2+2?", "tell me")]
    assert guard.traffic.flush()
    for r in rs:
        item = store.item(r.request_id)
        assert item is not None and item.sample.uniform and item.sample.inclusion_probability == 1.0
        rep = item.reply
        assert rep.response == r.text and rep.prompt == r.prompt and rep.risk == pytest.approx(r.risk)
        assert rep.action == r.decision.action and rep.rule == r.decision.rule
        assert rep.escalated == (r.decision.action == "escalate")
        assert rep.calibrator_sha256 == guard.calibrator.sha256 and rep.policy == "t@1"
        assert r.decided_by is not None and r.decided_by.to_dict() == {  # one identity: the reply's
            "policy": rep.policy, "policy_sha256": rep.policy_sha256, "calibrator_sha256": rep.calibrator_sha256}
        assert rep.policy_sha256 == guard.policy.sha256
        # one piece per scored token, joined they are the reply (plus the end-of-turn token)
        assert len(rep.tokens) == len(rep.token_probs) == r.scores.n_tokens
        assert rep.token_probs == pytest.approx(list(r.scores.token_probs))
        assert r.text.strip()
        joined = "".join(rep.tokens)
        assert joined.startswith(r.text) if r.ended else joined == r.text
    assert store.progress()["replies"] == 3


@pytest.mark.parametrize(("rate", "keep", "log_text"), [(1.0, False, False), (0.0, True, False), (0.0, False, True)])
def test_text_is_kept_only_where_the_policy_opts_in(tmp_path: Path, model: Any, rate: float, keep: bool,
                                                     log_text: bool) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    guard = Guard(model, policy=write_policy(tmp_path, model, rate=rate, keep=keep, log_text=log_text),
                  store=store, max_new_tokens=4)
    r = guard.generate("hello", **varied(guard.tokenizer))
    assert guard.traffic.flush()
    rep = store.reply(r.request_id)
    assert rep is not None and rep.scores["mean_token_prob"] == pytest.approx(r.scores.mean_token_prob)
    item = store.item(r.request_id)
    sampled = item is not None
    assert sampled == (rate == 1.0 or r.decision.action == "escalate")
    kept = log_text or (keep and sampled)
    assert (rep.response is not None) == kept and (rep.tokens is not None) == kept


def test_sampling_follows_a_reload(tmp_path: Path, model: Any) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    policy = write_policy(tmp_path, model, rate=0.0)
    guard = Guard(model, policy=policy, store=store, max_new_tokens=4)
    allowed = [r for r in (guard.generate(f"q{i}") for i in range(4)) if r.decision.action == "allow"]
    assert guard.traffic.flush()
    assert all(store.item(r.request_id) is None for r in allowed)
    write_policy(tmp_path, model, rate=1.0, version=2)
    guard.reload()
    r = guard.generate("after")
    assert guard.traffic.flush()
    item = store.item(r.request_id)
    assert item is not None and item.sample.uniform and item.reply.policy == "t@2"


def test_a_failing_store_never_fails_the_reply(tmp_path: Path, model: Any) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    guard = Guard(model, policy=write_policy(tmp_path, model), store=store, max_new_tokens=4,
                  audit=tmp_path / "audit.jsonl")
    store.close()  # every write now fails
    store.record = _raise  # type: ignore[method-assign]
    r = guard.generate("hello")
    assert guard.traffic.flush()
    assert r.decision is not None and guard.traffic.errors_ == 1
    assert (tmp_path / "audit.jsonl").read_text().count("\n") == 1  # the audit line is still written


def _raise(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("database is gone")


@pytest.mark.postgres
def test_two_replicas_share_one_postgres_store(tmp_path: Path, model: Any, pg_database_url: str) -> None:
    """Two servers (one Guard each), 8 clients each, writing one database at once."""
    policy = write_policy(tmp_path, model, rate=0.5)
    guards = [Guard(model if i == 0 else (tiny_llama(), make_tokenizer()), policy=policy,
                    store=Store(pg_database_url), max_new_tokens=4) for i in range(2)]
    ids: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(port: int, c: int) -> None:
        for j in range(5):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": f"client {c} question {j}"}]})
            with lock:
                if r.status_code != 200:
                    errors.append(r.text)
                else:
                    ids.append(r.json()["guarduq"]["request_id"])

    apps = [create_app(g, settings=Settings(model_ids=("tiny",), generation_defaults=varied(g.tokenizer)))
            for g in guards]
    with serving(apps[0]) as p0, serving(apps[1]) as p1:
        threads = [threading.Thread(target=client, args=(p, c)) for c in range(8) for p in (p0, p1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == [] and len(ids) == 80 == len(set(ids))
    assert all(g.traffic.flush() for g in guards)
    store = Store(pg_database_url)
    assert store.progress()["replies"] == 80
    assert all(store.reply(i) is not None for i in ids)
    sampled = store.progress()["items"]
    assert 20 <= sampled <= 60  # rate 0.5 plus escalations, over 80 replies


def test_kill_9_of_the_review_app_loses_no_committed_label(tmp_path: Path, model: Any) -> None:
    """``guarduq review`` in its own process, labels posted as fast as it takes them, SIGKILL
    mid-way: every label the page confirmed (303) is in the store afterwards."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = Store(url)
    guard = Guard(model, policy=write_policy(tmp_path, model), store=store, max_new_tokens=3)
    ids = [guard.generate(f"question {i}").request_id for i in range(40)]
    assert guard.traffic.flush()
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("guarduq")), "review", "--store", url,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    confirmed: list[str] = []
    try:
        with httpx.Client(base_url=base, timeout=10) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if c.get("/").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            token = c.cookies.get("guarduq_review_csrf")
            assert token
            killer = threading.Timer(1.0, lambda: os.kill(proc.pid, signal.SIGKILL))
            killer.start()
            for rid in ids * 5:  # more than it can take in a second: the kill lands mid-labelling
                try:
                    r = c.post(f"/items/{rid}/label", data={"label": "wrong", "csrf": token},
                               follow_redirects=False)
                except httpx.HTTPError:
                    break
                assert r.status_code == 303, r.text
                confirmed.append(rid)
            killer.join()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert 0 < len(confirmed) < len(ids) * 5
    after = Store(url)
    counts: dict[str, int] = {}
    for rid in confirmed:
        counts[rid] = counts.get(rid, 0) + 1
    for rid, n in counts.items():
        item = after.item(rid)
        assert item is not None and len(item.labels) >= n
    assert re.fullmatch(r"[0-9a-f]{32}", confirmed[0])


def test_token_pieces_join_to_the_decoded_text() -> None:
    """A byte-level tokenizer splits 'é' and '✓' across tokens: decoded one by one they are
    replacement characters; as pieces they join to the text, one piece per token."""
    from guarduq.layout import token_pieces

    tok = make_tokenizer()
    ids = tok("héllo ✓ ok", add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) > len("héllo ✓ ok")
    assert "".join(pieces) == "héllo ✓ ok"
    assert "".join(tok.decode([i]) for i in ids) != "héllo ✓ ok"  # why the prefix growth is needed


def test_a_slow_store_never_holds_a_reply_up(tmp_path: Path, model: Any) -> None:
    """The writer thread takes the wait: replies return at once, the store catches up, and
    past ``max_pending`` waiting writes the rest are dropped and counted, never raised."""
    from guarduq.traffic import Traffic

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    release = threading.Event()
    real = store.record

    def slow(*args: Any) -> None:
        release.wait(30)
        real(*args)

    store.record = slow  # type: ignore[method-assign]
    guard = Guard(model, policy=write_policy(tmp_path, model), max_new_tokens=3)
    guard.traffic = Traffic(store, max_pending=2)
    t0 = time.perf_counter()
    rs = [guard.generate(f"q{i}") for i in range(5)]
    assert time.perf_counter() - t0 < 20  # nothing waited on the blocked store
    assert not guard.traffic.flush(timeout=0.2)
    release.set()
    assert guard.traffic.flush()
    t = guard.traffic
    assert t.written_ + t.dropped_ == 5 and t.dropped_ >= 2 and t.errors_ == 0
    assert sum(store.reply(r.request_id) is not None for r in rs) == t.written_
