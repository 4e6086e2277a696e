"""The real server (uvicorn on a free loopback port, SmolLM2) through the official clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


from guarduq import Guard, LoadedModel  # noqa: E402
from guarduq.serve import Settings, create_app  # noqa: E402
from tests.unit.serve_helpers import serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-guarduq-test-key-0123456789"
MESSAGES = [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(real_guard: Guard, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The shipped default policy in shadow mode, so the generated text is what comes back."""
    tmp = tmp_path_factory.mktemp("serve")
    policy = (ROOT / "policies/default.yaml").read_text().replace("mode: enforce", "mode: shadow")
    policy = policy.replace("calibrator: calibrators/", f"calibrator: {ROOT}/policies/calibrators/")
    (tmp / "policy.yaml").write_text(policy)
    g = real_guard
    guard = Guard(LoadedModel(g.model, g.tokenizer, g.info), policy=tmp / "policy.yaml",
                  audit=tmp / "audit.jsonl")
    app = create_app(guard, settings=Settings(api_keys=(KEY,), model_ids=("smollm2-135m-instruct",)))
    with serving(app) as port:
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "guard": guard, "audit": tmp / "audit.jsonl"}


def client(server: dict[str, Any], key: str = KEY) -> Any:
    return openai.OpenAI(base_url=server["base_url"], api_key=key, max_retries=0)


def assert_scores_are_guards(server: dict[str, Any], text: str, g: dict[str, Any]) -> None:
    expected = server["guard"].score(MESSAGES, text, ended=g["ended"])
    assert g["scores"]["epistemic"] == expected.epistemic
    assert g["scores"]["aleatoric"] == expected.aleatoric
    assert g["model_fingerprint"] == server["guard"].info.fingerprint
    assert g["decision"]["shadow"] is True and g["decision"]["action"] in {"allow", "abstain"}
    assert 0.0 <= g["risk"] <= 1.0


def test_openai_client_sync(server):
    resp = client(server).chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES,
                                                  max_tokens=16)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.choices[0].finish_reason in {"stop", "length"}
    assert_scores_are_guards(server, text, resp.model_extra["guarduq"])
    lines = server["audit"].read_text().splitlines()
    assert json.loads(lines[-1])["request_id"] == resp.model_extra["guarduq"]["request_id"]


def test_openai_client_streaming(server):
    stream = client(server).chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES,
                                                    max_tokens=16, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = [c for c in chunks if (c.model_extra or {}).get("guarduq")]
    assert len(final) == 1 and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert_scores_are_guards(server, text, final[0].model_extra["guarduq"])


def test_wrong_key_is_refused(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="sk-wrong-key-000000000000").chat.completions.create(
            model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=4)


def test_langchain_chat_openai(server):
    lc = pytest.importorskip("langchain_openai")
    model = lc.ChatOpenAI(base_url=server["base_url"], api_key=KEY, model="smollm2-135m-instruct",
                          max_tokens=16, temperature=0, include_response_headers=True, max_retries=0)
    msg = model.invoke([("system", MESSAGES[0]["content"]), ("human", MESSAGES[1]["content"])])
    verdict = json.loads(msg.response_metadata["headers"]["x-guarduq"])
    expected = server["guard"].score(MESSAGES, msg.content, ended=verdict["ended"])
    assert verdict["epistemic"] == expected.epistemic and verdict["action"] in {"allow", "abstain"}
    assert msg.response_metadata["system_fingerprint"] == server["guard"].info.fingerprint
    streamed = "".join(c.content for c in model.stream(MESSAGES[1]["content"]))
    assert streamed.strip()
