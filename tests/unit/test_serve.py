"""The server through FastAPI's TestClient: a tiny random model Guard, and a fake one where the
HTTP boundary (queueing, batching, limits) is what is tested."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")

from guarduq import Guard  # noqa: E402
from guarduq.policy import Policy  # noqa: E402
from guarduq.policy.audit import AuditLog  # noqa: E402
from guarduq.serve import Settings, create_app  # noqa: E402
from guarduq.serve.engine import Cancelled, Engine, Job  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402
from tests.unit.serve_helpers import USER, body, fake_app, local_client, varied  # noqa: E402

ABSTAIN = {"name": "never", "version": "1", "rules": [{"name": "no", "action": "abstain", "message": "Not sure."}]}


@pytest.fixture
def guard(tokenizer) -> Guard:
    return Guard((tiny_llama(seed=3), tokenizer), max_new_tokens=8)


def client_for(guard: Guard, tokenizer: Any, **settings: Any) -> Any:
    s = Settings(model_ids=("tiny",), generation_defaults=varied(tokenizer), **settings)
    return local_client(create_app(guard, settings=s))


def sse(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def error_of(resp: Any) -> dict[str, Any]:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# --------------------------------------------------------------------------- completions


def test_completion_carries_the_guard_scores_of_the_returned_text(guard, tokenizer):
    c = client_for(guard, tokenizer)
    resp = c.post("/v1/chat/completions", json=body())
    assert resp.status_code == 200
    out = resp.json()
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    choice = out["choices"][0]
    text, g = choice["message"]["content"], out["guarduq"]
    assert text.strip() and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == ("stop" if g["ended"] else "length")
    expected = guard.score(USER, text, ended=g["ended"])
    assert g["scores"]["epistemic"] == expected.epistemic
    assert g["scores"]["aleatoric"] == expected.aleatoric
    assert g["model_fingerprint"] == guard.info.fingerprint and g["decision"] is None
    templated = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    n_in = len(tokenizer(templated, add_special_tokens=False)["input_ids"])
    assert out["usage"]["prompt_tokens"] == n_in
    assert out["usage"]["total_tokens"] == n_in + out["usage"]["completion_tokens"]


def test_streaming_chunks_join_to_the_non_streamed_reply(guard, tokenizer):
    c = client_for(guard, tokenizer)
    whole = c.post("/v1/chat/completions", json=body()).json()
    resp = c.post("/v1/chat/completions", json=body(stream=True, stream_options={"include_usage": True}))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = sse(resp.text)
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert len([ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")]) > 1
    final = [ch for ch in chunks if "guarduq" in ch]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] in {"stop", "length"}
    drop = {"timings"}
    assert {k: v for k, v in final[0]["guarduq"]["scores"].items() if k not in drop} == \
        {k: v for k, v in whole["guarduq"]["scores"].items() if k not in drop}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_enforced_abstention_is_content_filtered_and_never_streamed(guard, tokenizer, tmp_path):
    generated = guard.generate(USER, max_new_tokens=6, **varied(tokenizer)).text
    audit = tmp_path / "audit.jsonl"
    strict = Guard((guard.model, tokenizer), policy=Policy.from_dict(ABSTAIN), audit=AuditLog(audit))
    c = client_for(strict, tokenizer)
    out = c.post("/v1/chat/completions", json=body()).json()
    assert out["choices"][0]["message"]["content"] == "Not sure."
    assert out["choices"][0]["finish_reason"] == "content_filter"
    assert out["guarduq"]["decision"]["action"] == "abstain" and out["guarduq"]["decision"]["rule"] == "no"
    chunks = sse(c.post("/v1/chat/completions", json=body(stream=True)).text)
    streamed = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert streamed == "Not sure." and generated[:3] not in streamed
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert len(lines) == 2 and all(x["action"] == "abstain" for x in lines)
    assert all("prompt" not in x and "response" not in x for x in lines)  # privacy default


def test_shadow_mode_streams_live_and_reports_the_would_be_decision(guard, tokenizer):
    shadow = Guard((guard.model, tokenizer), policy=Policy.from_dict({**ABSTAIN, "mode": "shadow"}))
    c = client_for(shadow, tokenizer)
    whole = c.post("/v1/chat/completions", json=body()).json()
    assert whole["choices"][0]["finish_reason"] != "content_filter"
    chunks = sse(c.post("/v1/chat/completions", json=body(stream=True)).text)
    pieces = [ch["choices"][0]["delta"].get("content", "") for ch in chunks]
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["guarduq"]["decision"]["shadow"] is True


def test_score_endpoint_equals_guard_guarded(guard, tokenizer):
    c = client_for(guard, tokenizer)
    resp = c.post("/v1/guarduq/score", json={"messages": USER, "response": "Blue", "ended": False})
    assert resp.status_code == 200
    expected = guard.guarded(USER, "Blue", ended=False).scores
    got = resp.json()["guarduq"]
    assert got["scores"]["epistemic"] == expected.epistemic and got["ended"] is False


def test_generation_settings_map_honestly(tokenizer):
    app, fake = fake_app(tokenizer)
    c = local_client(app)
    assert c.post("/v1/chat/completions", json=body(temperature=0, top_p=0.5)).status_code == 200
    assert c.post("/v1/chat/completions", json=body(temperature=0.7, top_p=0.9, max_tokens=None,
                                                   max_completion_tokens=5)).status_code == 200
    greedy, sampled = fake.calls
    assert "do_sample" not in greedy and "top_p" not in greedy and greedy["max_new_tokens"] == 6
    assert sampled["do_sample"] is True and sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9
    assert sampled["max_new_tokens"] == 5


def test_same_seed_same_sample(guard, tokenizer):
    c = client_for(guard, tokenizer)
    texts = [c.post("/v1/chat/completions", json=body(temperature=1.5, seed=s)).json()
             ["choices"][0]["message"]["content"] for s in (7, 7, 8, 8)]
    assert texts[0] == texts[1] and texts[2] == texts[3]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("payload", "status", "param"), [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps(body(messages=[])).encode(), 400, "messages"),
    (json.dumps(body(messages=[{"role": "robot", "content": "x"}])).encode(), 400, "messages[0].role"),
    (json.dumps(body(messages=[{"role": "tool", "content": "x"}])).encode(), 400, "messages[0].role"),
    (json.dumps(body(messages=[{"role": "user", "content": "  "}])).encode(), 400, "messages"),
    (json.dumps(body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}])).encode(), 400, "messages[0].content[0]"),
    (json.dumps(body(n=2)).encode(), 400, "n"),
    (json.dumps(body(tools=[{"type": "function", "function": {"name": "f"}}])).encode(), 400, "tools"),
    (json.dumps(body(logprobs=True)).encode(), 400, "logprobs"),
    (json.dumps(body(response_format={"type": "json_object"})).encode(), 400, "response_format"),
    (json.dumps(body(max_tokens=0)).encode(), 400, "max_tokens"),
    (json.dumps(body(max_tokens=100_000)).encode(), 400, "max_tokens"),
    (json.dumps(body(temperature=3)).encode(), 400, "temperature"),
    (json.dumps(body(messages="hello")).encode(), 400, "messages"),
    (json.dumps(body(model="gpt-4")).encode(), 404, "model"),
    (json.dumps({"messages": USER}).encode(), 400, "model"),
])
def test_bad_requests_get_a_clear_openai_error(tokenizer, payload, status, param):
    app, fake = fake_app(tokenizer)
    resp = local_client(app).post("/v1/chat/completions", content=payload,
                                headers={"content-type": "application/json"})
    assert resp.status_code == status
    assert error_of(resp)["param"] == param
    assert fake.calls == []


def test_unknown_fields_are_ignored_like_openai_clients_expect(tokenizer):
    app, _ = fake_app(tokenizer)
    resp = local_client(app).post("/v1/chat/completions", json=body(store=False, metadata={"a": "b"},
                                                                   frobnicate=1))
    assert resp.status_code == 200


def test_limits_on_body_messages_and_prompt(tokenizer):
    app, fake = fake_app(tokenizer, max_body_bytes=2000, max_messages=3, max_prompt_chars=500)
    c = local_client(app)
    huge = c.post("/v1/chat/completions", json=body(messages=[{"role": "user", "content": "x" * 5000}]))
    assert huge.status_code == 413 and error_of(huge)["code"] == "body_too_large"
    many = c.post("/v1/chat/completions", json=body(messages=USER * 4))
    assert many.status_code == 400 and error_of(many)["param"] == "messages"
    long = c.post("/v1/chat/completions", json=body(messages=[{"role": "user", "content": "y" * 600}]))
    assert long.status_code == 400 and error_of(long)["code"] == "prompt_too_long"
    assert fake.calls == []


def test_full_queue_answers_429_with_retry_after(tokenizer):
    app, fake = fake_app(tokenizer, max_queue=1, retry_after_s=3, batching=False)
    fake.gate.clear()  # the worker blocks on the first job; the second waits; the third is refused
    c = local_client(app)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(
        c.post("/v1/chat/completions", json=body()).status_code)) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    refused = c.post("/v1/chat/completions", json=body())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
    assert error_of(refused)["type"] == "rate_limit_error"
    fake.gate.set()
    for t in threads:
        t.join(10)
    assert sorted(results) == [200, 200]


# --------------------------------------------------------------------------- auth and binding


def test_api_key_is_required_and_checked(tokenizer):
    app, _ = fake_app(tokenizer, api_keys=("s3cret", "other"))
    c = local_client(app)
    assert c.get("/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        resp = c.post("/v1/chat/completions", json=body(), headers=headers)
        assert resp.status_code == 401 and error_of(resp)["code"] == "invalid_api_key"
    assert c.get("/metrics").status_code == 401
    for key in ("s3cret", "other"):
        ok = c.post("/v1/chat/completions", json=body(), headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200


def test_no_key_refuses_a_non_loopback_host():
    from guarduq.cli.serve import check_bind
    from guarduq.errors import InputError

    for host in ("127.0.0.1", "localhost", "::1"):
        check_bind(host, has_key=False, allow_unauthenticated_remote=False)
    for host in ("0.0.0.0", "192.168.1.5", "::"):
        with pytest.raises(InputError, match="allow-unauthenticated-remote"):
            check_bind(host, has_key=False, allow_unauthenticated_remote=False)
        check_bind(host, has_key=True, allow_unauthenticated_remote=False)
        check_bind(host, has_key=False, allow_unauthenticated_remote=True)


def test_serve_command_refuses_before_loading_a_model(monkeypatch, capsys):
    from guarduq.cli import main

    assert main(["serve", "--model", "no-such-model", "--host", "0.0.0.0"]) == 2
    assert "allow-unauthenticated-remote" in capsys.readouterr().err
    monkeypatch.setenv("GUARDUQ_TEST_KEY", "short")
    assert main(["serve", "--model", "no-such-model", "--api-key-env", "GUARDUQ_TEST_KEY"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    for name in ("\ud800", "A=B", ""):  # "\ud800" raised UnicodeEncodeError from os.environ (make fuzz)
        assert main(["serve", "--model", "no-such-model", "--api-key-env", name]) == 2
        assert "not a valid environment variable name" in capsys.readouterr().err


# --------------------------------------------------------------------------- operations


def test_models_health_ready_and_metrics(tokenizer):
    app, _ = fake_app(tokenizer)
    c = local_client(app)
    assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert c.get("/readyz").json()["status"] == "ready"
    secret = "my very private question"
    c.post("/v1/chat/completions", json=body(messages=[{"role": "user", "content": secret}]))
    c.post("/v1/chat/completions", json=body(n=3))
    text = c.get("/metrics").text
    assert 'guarduq_decisions_total{action="none",endpoint="chat",rule="none",shadow="false"} 1.0' in text
    assert 'guarduq_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert "guarduq_generation_seconds_count 1.0" in text and "guarduq_queue_depth 0.0" in text
    assert "guarduq_score_aleatoric_count 1.0" in text
    assert secret not in text and "echo" not in text


def test_batching_groups_compatible_queued_requests(tokenizer):
    app, fake = fake_app(tokenizer, batch=True, max_batch=8, batch_wait_s=0.2)
    c = local_client(app)
    fake.gate.clear()
    codes: list[int] = []
    threads = [threading.Thread(target=lambda i=i: codes.append(c.post(
        "/v1/chat/completions", json=body(messages=[{"role": "user", "content": f"q{i}"}])).status_code))
        for i in range(5)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    fake.gate.set()
    for t in threads:
        t.join(10)
    assert codes == [200] * 5 and sum(fake.batches) == 5 and max(fake.batches) > 1
    off, fake_off = fake_app(tokenizer, batch=True, batching=False)
    local_client(off).post("/v1/chat/completions", json=body())
    assert fake_off.batches == [] and len(fake_off.calls) == 1


def test_cancelled_job_is_not_run(tokenizer):
    from tests.unit.serve_helpers import FakeGuard

    fake = FakeGuard(tokenizer)
    fake.gate.clear()
    engine = Engine(fake, max_queue=4, batching=False)  # type: ignore[arg-type]
    first = engine.submit(Job("generate", USER, gen={"max_new_tokens": 2}))
    second = engine.submit(Job("generate", [{"role": "user", "content": "gone"}], gen={"max_new_tokens": 2}))
    time.sleep(0.2)
    second.cancel()
    fake.gate.set()
    assert first.future.result(5).text == "echo Hi there"
    engine.close()
    assert len(fake.calls) == 1


def test_running_generation_stops_when_cancelled(guard, tokenizer):
    engine = Engine(guard, batching=False)
    job = Job("generate", USER, gen={"max_new_tokens": 200, **varied(tokenizer)})
    calls = []
    original = guard.model.forward

    def slow_forward(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            job.cancel()
        return original(*a, **kw)

    guard.model.forward = slow_forward
    engine.submit(job)
    with pytest.raises(Cancelled):
        job.future.result(20)
    assert len(calls) < 10
    engine.close()


def test_drift_gauges_follow_the_live_window(tokenizer):
    import numpy as np

    from guarduq.calibration.drift import Reference, psi

    ref = Reference({"aleatoric": np.linspace(0.0, 0.25, 40), "log_epistemic": np.linspace(-3, 3, 40)}, "t")
    app, _ = fake_app(tokenizer, drift_reference=ref, drift_min_n=3, drift_window=10)
    c = local_client(app)
    for _ in range(2):
        c.post("/v1/chat/completions", json=body())
    assert 'guarduq_drift_window{feature="aleatoric"} 2.0' in c.get("/metrics").text
    c.post("/v1/chat/completions", json=body())
    text = c.get("/metrics").text
    gauge = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith('guarduq_drift_psi{feature="aleatoric"}')))
    assert gauge == pytest.approx(psi(ref.values["aleatoric"], [0.25] * 3), rel=1e-12)  # FakeGuard's value
    assert 'guarduq_drift_level{feature="aleatoric"} 2.0' in text  # every live value in one decile


def test_a_drift_window_shorter_than_min_n_reads_once_it_is_full(tokenizer):
    """``guarduq serve --drift-window 10`` (min_n stays 50) used to refuse to start."""
    import numpy as np

    from guarduq.calibration.drift import Reference

    ref = Reference({"aleatoric": np.linspace(0.0, 0.25, 40), "log_epistemic": np.linspace(-3, 3, 40)}, "t")
    app, _ = fake_app(tokenizer, drift_reference=ref, drift_window=4)
    c = local_client(app)
    for n in range(1, 5):
        c.post("/v1/chat/completions", json=body())
        assert ('guarduq_drift_level{feature="aleatoric"} 2.0' in c.get("/metrics").text) == (n == 4)


def test_tracing_is_a_no_op_without_otel_env_and_harmless_with_it(tokenizer, monkeypatch):
    from guarduq.serve import tracing

    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    assert tracing.make_tracer() is None
    pytest.importorskip("opentelemetry")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "guarduq-test")
    tracer = tracing.make_tracer()
    assert tracer is not None
    app, fake = fake_app(tokenizer)
    tracing.record(tracer, "chat", time.time_ns(), fake._response(USER, "x"))  # raises nothing
    assert local_client(app).post("/v1/chat/completions", json=body()).status_code == 200
