"""Escalation sinks: JSONL queue, webhook retries against a local server, callable allow-list."""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from guarduq.errors import EscalationError, PolicyError
from guarduq.policy import Policy
from guarduq.policy.escalation import CallableSink, JsonlSink, WebhookSink, make_sink

CASE = {"request_id": "r-1", "prompt": "Q?", "response": "A.", "scores": {"risk": 0.5}}


# ------------------------------------------------------------------ JSONL queue


def test_jsonl_appends_one_line_per_case(tmp_path: Path) -> None:
    path = tmp_path / "deep/dir/queue.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"earlier": true}\n')
    sink = JsonlSink(path)
    sink.send(CASE)
    sink.send({**CASE, "request_id": "r-2"})
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"earlier": True}, CASE, {**CASE, "request_id": "r-2"}]


def test_jsonl_concurrent_writers_leave_whole_lines(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "q.jsonl")
    big = "x" * 5000  # long lines make interleaving visible if the lock were missing

    def worker(k: int) -> None:
        for i in range(20):
            sink.send({"k": k, "i": i, "pad": big})

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = [json.loads(x) for x in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert sorted((r["k"], r["i"]) for r in rows) == [(k, i) for k in range(6) for i in range(20)]


def test_jsonl_failure_is_an_escalation_error(tmp_path: Path) -> None:
    (tmp_path / "q.jsonl").mkdir()
    with pytest.raises(EscalationError, match="cannot write"):
        JsonlSink(tmp_path / "q.jsonl").send(CASE)
    with pytest.raises(EscalationError, match="not JSON-serialisable"):
        JsonlSink(tmp_path / "other.jsonl").send({"bad": object()})
    JsonlSink(tmp_path / "nan.jsonl").send({"risk": float("nan")})
    assert json.loads((tmp_path / "nan.jsonl").read_text()) == {"risk": None}


# ------------------------------------------------------------------ webhook


class Receiver:
    """A local HTTP server whose first ``fail`` requests get ``status`` (or sleep ``delay``)."""

    def __init__(self, fail: int = 0, status: int = 500, delay: float = 0.0) -> None:
        self.fail, self.status, self.delay = fail, status, delay
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.bodies.append(json.loads(body))
                receiver.headers.append(dict(self.headers))
                if len(receiver.bodies) <= receiver.fail:
                    if receiver.delay:
                        time.sleep(receiver.delay)
                    self.send_response(receiver.status)
                else:
                    self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(request) -> Iterator[Receiver]:
    r = Receiver(**getattr(request, "param", {}))
    yield r
    r.close()


@pytest.mark.parametrize("receiver", [{"fail": 2, "status": 503}], indirect=True)
def test_webhook_retries_with_exponential_backoff_then_succeeds(receiver: Receiver) -> None:
    waits: list[float] = []
    sink = WebhookSink(receiver.url, timeout_s=2, retries=3, backoff_s=0.1, sleep=waits.append,
                       headers={"X-Token": "t"})
    sink.send(CASE)
    assert len(receiver.bodies) == 3 and all(b == CASE for b in receiver.bodies)
    assert waits == [0.1, 0.2]  # backoff_s * 2**k before retry k
    assert receiver.headers[0]["X-Token"] == "t"
    assert receiver.headers[0]["Content-Type"] == "application/json"


@pytest.mark.parametrize("receiver", [{"fail": 99, "status": 500}], indirect=True)
def test_webhook_gives_up_after_bounded_retries(receiver: Receiver) -> None:
    waits: list[float] = []
    sink = WebhookSink(receiver.url, timeout_s=2, retries=2, backoff_s=0.05, sleep=waits.append)
    with pytest.raises(EscalationError, match=r"failed after 3 attempt\(s\): HTTP 500"):
        sink.send(CASE)
    assert len(receiver.bodies) == 3 and waits == [0.05, 0.1]


@pytest.mark.parametrize("receiver", [{"fail": 99, "status": 400}], indirect=True)
def test_webhook_does_not_retry_a_rejection(receiver: Receiver) -> None:
    with pytest.raises(EscalationError, match="HTTP 400"):
        WebhookSink(receiver.url, retries=3, backoff_s=0).send(CASE)
    assert len(receiver.bodies) == 1


@pytest.mark.parametrize("receiver", [{"fail": 99, "delay": 1.0}], indirect=True)
def test_webhook_timeout(receiver: Receiver) -> None:
    t0 = time.perf_counter()
    with pytest.raises(EscalationError, match=r"failed after 2 attempt\(s\)"):
        WebhookSink(receiver.url, timeout_s=0.2, retries=1, backoff_s=0).send(CASE)
    assert time.perf_counter() - t0 < 1.9  # each try was cut at the timeout, not the 1 s sleep
    assert len(receiver.bodies) == 2


def test_webhook_unreachable() -> None:
    # a port nobody listens on: bind, read the port, close
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(EscalationError, match="failed after 2 attempt"):
        WebhookSink(f"http://127.0.0.1:{port}/", timeout_s=1, retries=1, backoff_s=0).send(CASE)


def _policy_with(tmp_path: Path, sink_yaml: str, on_error: str = "") -> Policy:
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: esc
        version: 1
        {on_error}
        sinks:
          out: {sink_yaml}
        rules:
          - name: send
            action: escalate
            sink: out
            hold: false
        """))
    return Policy.from_yaml(path)


@pytest.mark.parametrize("receiver", [{"fail": 99, "delay": 1.0}], indirect=True)
def test_webhook_timeout_routes_to_on_error(tmp_path: Path, receiver: Receiver) -> None:
    policy = _policy_with(tmp_path, f"{{type: webhook, url: '{receiver.url}', timeout_s: 0.2, retries: 0}}")
    d = policy.decide({}, prompt="Q?", response="A.", request_id="r-9")
    # the rule released the answer, but the escalation failed: fail closed
    assert (d.action, d.shown, d.rule) == ("abstain", False, "on_error")
    assert d.errors[0].startswith("escalation: EscalationError: webhook")
    assert receiver.bodies[0]["request_id"] == "r-9" and receiver.bodies[0]["response"] == "A."


@pytest.mark.parametrize("receiver", [{"fail": 0}], indirect=True)
def test_webhook_success_through_a_policy(tmp_path: Path, receiver: Receiver) -> None:
    policy = _policy_with(tmp_path, f"{{type: webhook, url: '{receiver.url}'}}")
    d = policy.decide({"risk": 0.4}, prompt="Q?", response="A.", request_id="r-3")
    assert (d.action, d.shown, d.text) == ("escalate", True, "A.")
    assert d.escalation is not None and d.escalation.delivered
    assert receiver.bodies[0]["decision"]["rule"] == "send"


# ------------------------------------------------------------------ callables and the allow-list


@pytest.fixture
def hooks_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module with a recording hook and a failing one."""
    (tmp_path / "guq_test_hooks.py").write_text(textwrap.dedent("""\
        received = []

        def record(case):
            received.append(case)

        def explode(case):
            raise RuntimeError("hook is down")

        not_callable = 3
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("guq_test_hooks", None)
    yield "guq_test_hooks"
    sys.modules.pop("guq_test_hooks", None)


def test_callable_sink_needs_the_allow_list(tmp_path: Path, hooks_module: str) -> None:
    target = f"{hooks_module}.record"
    policy = _policy_with(tmp_path, f"{{type: callable, target: {target}}}")
    with pytest.raises(PolicyError, match="not allowed"):
        policy.bind()
    with pytest.raises(PolicyError, match="not allowed"):  # deciding without binding: same refusal
        policy.decide({}, response="A.")
    assert hooks_module not in sys.modules  # refused before anything was imported
    with pytest.raises(PolicyError, match="not allowed"):  # a prefix is not the exact path
        policy.bind(allow_callables=[hooks_module])
    bound = policy.bind(allow_callables=[target])
    d = bound.decide({"risk": 0.2}, prompt="Q?", response="A.", request_id="r-5")
    assert d.action == "escalate" and d.escalation.delivered
    received = sys.modules[hooks_module].received
    assert [c["request_id"] for c in received] == ["r-5"] and received[0]["prompt"] == "Q?"


def test_failing_callable_routes_to_on_error(tmp_path: Path, hooks_module: str) -> None:
    target = f"{hooks_module}.explode"
    policy = _policy_with(tmp_path, f"{{type: callable, target: {target}}}").bind(allow_callables=[target])
    d = policy.decide({}, response="A.")
    assert (d.action, d.shown) == ("abstain", False)
    assert "hook is down" in d.errors[0]


@pytest.mark.parametrize(
    ("target", "message"),
    [("guq_test_hooks.missing", "cannot be imported"), ("guq_no_such_module.f", "cannot be imported"),
     ("guq_test_hooks.not_callable", "is not callable")],
)
def test_bad_callable_targets(hooks_module: str, target: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        make_sink({"type": "callable", "target": target}, allow_callables=[target])


def test_callable_target_must_be_an_import_path(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: x\nversion: 1\nsinks:\n  s: {type: callable, target: 'os.system(\"ls\")'}\n"
                    "rules:\n  - {name: a, action: allow}\n")
    with pytest.raises(PolicyError, match=r"p.yaml:4: sinks.s.target"):
        Policy.from_yaml(path)


# ------------------------------------------------------------------ factory


def test_factory_keyed_by_plain_strings(tmp_path: Path) -> None:
    jsonl = make_sink({"type": "jsonl", "path": "q.jsonl"}, base_dir=tmp_path)
    assert isinstance(jsonl, JsonlSink) and jsonl.path == tmp_path / "q.jsonl"
    absolute = make_sink({"type": "jsonl", "path": str(tmp_path / "abs.jsonl")}, base_dir="/elsewhere")
    assert absolute.path == tmp_path / "abs.jsonl"
    hook = make_sink({"type": "webhook", "url": "https://example.invalid/x", "retries": 4})
    assert isinstance(hook, WebhookSink) and hook.retries == 4
    fn = make_sink({"type": "callable", "target": "json.dumps"}, allow_callables=["json.dumps"])
    assert isinstance(fn, CallableSink) and fn.fn is json.dumps
    with pytest.raises(PolicyError, match="unknown sink type 'smtp'"):
        make_sink({"type": "smtp"})
    with pytest.raises(PolicyError, match="invalid webhook sink"):
        make_sink({"type": "webhook", "url": "https://x", "retries": 1000})


def test_sink_override_by_name(tmp_path: Path) -> None:
    sent = []

    class Memory:
        def send(self, case):
            sent.append(case)

    policy = _policy_with(tmp_path, "{type: jsonl, path: q.jsonl}")
    policy.bind(sinks={"out": Memory()}).decide({}, response="A.", request_id="r-7")
    assert [c["request_id"] for c in sent] == ["r-7"] and not (tmp_path / "q.jsonl").exists()
    with pytest.raises(PolicyError, match="not declared"):
        policy.bind(sinks={"other": Memory()})
