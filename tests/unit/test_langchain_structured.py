"""Structured output, tool calling and tracing metadata of GuardedChatModel, on tiny models.

Expectations come from outside the code under test: pydantic's own validation, the tokenizer's
own chat template, ``Guard.score`` on the same text, a full forward pass of the model.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from guarduq import Guard
from guarduq.errors import GuardUQAbstention, InputError
from guarduq.integrations.langchain import METADATA_KEY, GuardedChatModel, to_chat_messages
from guarduq.integrations.langchain.structured import JsonWriter, instruction
from guarduq.integrations.langchain.tools import parse_tool_calls
from tests.conftest import TOOL_CHATML, make_tokenizer, tiny_llama

ABSTAIN = {"name": "never", "version": "1", "rules": [{"name": "no", "action": "abstain", "message": "Not sure."}]}


class Inner(BaseModel):
    count: int


class Everything(BaseModel):
    """One field of each supported kind."""

    name: str = Field(description="a name")
    age: int
    height: float
    happy: bool
    colour: Literal["red", "green", "blue"]
    nickname: str | None = None
    scores: list[int] = []
    inner: Inner


class Pair(TypedDict):
    left: str
    right: str


def long_llama(seed: int):
    """A tiny llama that takes long prompts (a schema instruction is ~1k bytes = tokens here)."""
    model = tiny_llama(seed=seed)
    model.config.max_position_embeddings = 2048  # rotary positions: no table to grow
    return model


@pytest.fixture
def guard(tokenizer):
    return Guard((long_llama(3), tokenizer), max_new_tokens=24)


@pytest.fixture
def tool_guard():
    tok = make_tokenizer()
    tok.chat_template = TOOL_CHATML
    return Guard((long_llama(3), tok), max_new_tokens=24)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_structured_output_validates_for_every_supported_kind(guard):
    for seed in (0, 1):  # two different random models: different values, same validity
        g = Guard((long_llama(seed), guard.tokenizer), max_new_tokens=24)
        out = GuardedChatModel(guard=g).with_structured_output(Everything).invoke("Hi")
        assert isinstance(out, Everything) and out.colour in ("red", "green", "blue")
    pair = GuardedChatModel(guard=guard).with_structured_output(Pair).invoke("Hi")
    assert set(pair) == {"left", "right"} and all(isinstance(v, str) for v in pair.values())


def test_structured_raw_carries_the_scores_of_the_json_text(guard, tokenizer):
    out = GuardedChatModel(guard=guard).with_structured_output(Everything, include_raw=True).invoke("Hi")
    raw, parsed = out["raw"], out["parsed"]
    assert out["parsing_error"] is None and Everything.model_validate_json(raw.content) == parsed
    schema = Everything.model_json_schema()
    assert json.loads(raw.content).keys() == schema["properties"].keys()
    prompt = [{"role": "system", "content": instruction(raw_schema(raw))}, {"role": "user", "content": "Hi"}]
    expected = guard.score(prompt, raw.content, ended=True)
    got = raw.response_metadata[METADATA_KEY]["scores"]
    assert (got["epistemic"], got["n_tokens"]) == (expected.epistemic, expected.n_tokens)
    assert set(raw.response_metadata[METADATA_KEY]["timings"]) >= {"generate_s", "score_s"}
    n_in = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert raw.usage_metadata["input_tokens"] == n_in
    assert raw.usage_metadata["output_tokens"] == len(tokenizer(raw.content, add_special_tokens=False)["input_ids"]) + 1


def raw_schema(raw: AIMessage) -> dict:
    """The JSON schema the model was told, as LangChain converts the pydantic class."""
    from langchain_core.utils.function_calling import convert_to_json_schema

    return convert_to_json_schema(Everything)


def test_json_mode_adds_no_instruction_to_the_prompt(guard):
    out = GuardedChatModel(guard=guard).with_structured_output(Pair, method="json_mode", include_raw=True).invoke("Hi")
    expected = guard.score("Hi", out["raw"].content, ended=True)
    assert out["raw"].response_metadata[METADATA_KEY]["scores"]["epistemic"] == expected.epistemic


def test_structured_stream_yields_one_whole_object(guard):
    chunks = list(GuardedChatModel(guard=guard).with_structured_output(Everything).stream("Hi"))
    assert len(chunks) == 1 and isinstance(chunks[0], Everything)


def test_structured_answer_withheld_by_the_policy_raises(guard):
    chat = GuardedChatModel(guard=guard, policy=ABSTAIN).with_structured_output(Pair)
    with pytest.raises(GuardUQAbstention, match="Not sure"):
        chat.invoke("Hi")


def test_writer_cache_gives_the_logits_of_a_full_forward_pass(guard):
    writer = JsonWriter(guard, "Hi", 8)
    writer._prompt_ids = [int(i) for i in guard.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)["input_ids"]]
    with torch.no_grad():
        for text in ('{"a": "', '{"a": "xy", "b": ', '{"a": "xy", "b": 12, "c": ["'):
            writer.text = text
            got = writer._next_logits()
            ids = writer._prompt_ids + guard.tokenizer(text, add_special_tokens=False)["input_ids"]
            full = guard.model(input_ids=torch.tensor([ids])).logits[0, -1]
            assert torch.allclose(got, full, atol=1e-4)


def test_bad_schemas_and_methods_are_input_errors(guard):
    chat = GuardedChatModel(guard=guard)
    with pytest.raises(InputError, match="method"):
        chat.with_structured_output(Pair, method="xml")
    with pytest.raises(InputError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(InputError, match="allOf"):
        chat.with_structured_output({"title": "x", "type": "object", "properties": {
            "v": {"allOf": [{"type": "string"}, {"type": "string"}]}}}).invoke("Hi")


# --------------------------------------------------------------------------- tools


def test_bind_tools_on_a_template_without_tools_says_so(guard):
    with pytest.raises(InputError, match="does not support tools"):
        GuardedChatModel(guard=guard).bind_tools([add])


def test_forced_tool_call_fills_the_arguments_and_the_prompt_carries_the_tools(tool_guard):
    chat = GuardedChatModel(guard=tool_guard).bind_tools([add], tool_choice="any")
    msg = chat.invoke("Hi")
    (call,) = msg.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())
    from langchain_core.utils.function_calling import convert_to_openai_tool

    rendered = tool_guard.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tools=[convert_to_openai_tool(add)],
        add_generation_prompt=True, tokenize=True)["input_ids"]
    assert msg.usage_metadata["input_tokens"] == len(rendered)
    without_tools = tool_guard.score("Hi", json.dumps({"name": "add", "arguments": call["args"]}), ended=True)
    assert msg.response_metadata[METADATA_KEY]["scores"]["epistemic"] != without_tools.epistemic
    streamed = list(chat.stream("Hi"))
    assert streamed[-1].tool_call_chunks[0]["name"] == "add"


def test_tool_choice_naming_an_unbound_tool_is_an_input_error(tool_guard):
    with pytest.raises(InputError, match="names no bound tool"):
        GuardedChatModel(guard=tool_guard).bind_tools([add], tool_choice="multiply")


def test_parse_tool_calls_reads_hermes_blocks_and_bare_json():
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls, invalid = parse_tool_calls(text, ["add"])
    assert content == "Sure." and [(c["name"], c["args"]) for c in calls] == [("add", {"a": 1, "b": 2})] and not invalid
    _, calls, _ = parse_tool_calls('[{"name": "add", "parameters": "{\\"a\\": 3}"}]', ["add"])
    assert calls[0]["args"] == {"a": 3}
    _, calls, invalid = parse_tool_calls("<tool_call>{oops</tool_call>", ["add"])
    assert not calls and "not JSON" in invalid[0]["error"]
    assert parse_tool_calls('{"answer": 4}', ["add"]) == ('{"answer": 4}', [], [])  # plain JSON reply


def test_tool_histories_are_written_back_as_the_model_would_write_them():
    history = [HumanMessage("Hi"), AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1"}]),
               ToolMessage("2", tool_call_id="c1")]
    out = to_chat_messages(history)
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]
    assert json.loads(out[1]["content"].split("\n")[1]) == {"name": "add", "arguments": {"a": 1}}


# --------------------------------------------------------------------------- tracing and model override


def test_ls_params_name_the_model_and_honour_a_per_call_model(guard):
    chat = GuardedChatModel(guard=guard, max_tokens=5, stop=["x"])
    params = chat._get_ls_params(stop=["y"])
    assert (params["ls_provider"], params["ls_model_name"]) == ("guarduq", guard.info.name)
    assert (params["ls_max_tokens"], params["ls_stop"], params["ls_temperature"]) == (5, ["x", "y"], 0.0)
    assert chat._get_ls_params(model="other")["ls_model_name"] == "other"
    assert GuardedChatModel(guard=guard)._get_ls_params()["ls_max_tokens"] == guard.max_new_tokens
    with pytest.raises(InputError, match="per-call model"):
        chat.invoke("Hi", model="other")
    assert isinstance(chat.invoke("Hi", model=guard.info.name), AIMessage)
    assert GuardedChatModel.is_lc_serializable() is False
