"""Property test of the HTTP boundary: generated request bodies never get a 5xx.

Against a fake Guard (the model call is not what is tested) with the profile's example count
(>= 2,000 by default, ``HYPOTHESIS_PROFILE=fuzz`` for more), then a small sample against a
tiny real model.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
from hypothesis import event, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from guarduq import Guard  # noqa: E402
from guarduq.serve import Settings, create_app  # noqa: E402
from tests.conftest import make_tokenizer, tiny_llama  # noqa: E402
from tests.unit.fuzz_support import COUNTS, examples  # noqa: E402
from tests.unit.serve_helpers import fake_app, varied  # noqa: E402

TOKENIZER = make_tokenizer()
LOOP = asyncio.new_event_loop()  # one loop for all examples: in-process ASGI calls, no sockets


class Client:
    def __init__(self, app: Any) -> None:
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return LOOP.run_until_complete(self.http.post(path, **kw))


FAKE = Client(fake_app(TOKENIZER, max_tokens=64, max_body_bytes=20_000)[0])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "USER"]) | st.text(max_size=8)
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "x"])},
                              optional={"text": st.text(max_size=30) | json_values, "image_url": json_values})
contents = st.text(max_size=60) | st.lists(parts, max_size=3) | st.none() | st.integers() | json_values
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": contents},
                          optional={"name": st.text(max_size=5), "tool_calls": json_values}),
    max_size=5,
) | json_values
OPTIONAL = {
    "max_tokens": st.integers(-5, 100_000) | json_values,
    "max_completion_tokens": st.integers(-5, 100) | st.none(),
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | st.none(),
    "stop": st.none() | st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6) | json_values,
    "seed": st.integers(-10, 2**64) | st.none(),
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "user": st.text(max_size=10) | json_values,
    "tools": st.none() | json_values,
    "logprobs": st.booleans() | st.none(),
    "response_format": st.none() | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "presence_penalty": st.floats(-2, 2) | st.none(),
    "unknown_field": json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny"]) | st.text(max_size=10) | json_values, "messages": messages},
    optional=OPTIONAL,
)
score_bodies = st.fixed_dictionaries(
    {"messages": messages, "response": st.text(max_size=40) | json_values},
    optional={"ended": st.booleans() | json_values, "model": st.sampled_from(["tiny", "nope"])},
)
valid_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": st.text(min_size=1, max_size=40) | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), min_size=1, max_size=2),
}), min_size=1, max_size=4)
plausible_bodies = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": valid_messages},
    optional={"max_tokens": st.integers(1, 80), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4), "seed": st.integers(0, 2**32),
              "stream": st.booleans(), "n": st.just(1), "user": st.text(max_size=8),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})},
)
requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), plausible_bodies.map(json.dumps)),
    st.tuples(st.just("/v1/guarduq/score"), st.fixed_dictionaries(
        {"messages": valid_messages, "response": st.text(max_size=30)}).map(json.dumps)),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies.map(json.dumps)),
    st.tuples(st.just("/v1/guarduq/score"), score_bodies.map(json.dumps)),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/guarduq/score"]),
              json_values.map(json.dumps) | st.binary(max_size=200) | st.text(max_size=200)),
)


def check(client: Client, path: str, payload: Any) -> None:
    resp = client.post(path, content=payload, headers={"content-type": "application/json"})
    event(f"HTTP {resp.status_code}")
    assert resp.status_code < 500, (resp.status_code, resp.text[:300], payload[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert resp.text.endswith("data: [DONE]\n\n") and '"error"' not in resp.text
    else:
        assert "guarduq" in resp.json()


@examples(2000)
@given(requests)
def test_no_generated_request_gets_a_5xx(req):
    check(FAKE, *req)
    COUNTS["serve: request (stub guard)"] += 1


REAL = None


def real_client() -> Client:
    global REAL
    if REAL is None:
        guard = Guard((tiny_llama(seed=3), TOKENIZER), max_new_tokens=4)
        REAL = Client(create_app(guard, settings=Settings(
            model_ids=("tiny",), max_tokens=4, max_body_bytes=20_000, generation_defaults=varied(TOKENIZER))))
    return REAL


@examples(60)
@given(requests)
def test_no_generated_request_gets_a_5xx_from_a_tiny_model(req):
    check(real_client(), *req)
    COUNTS["serve: request (tiny model)"] += 1
