"""LangChain integration on tiny local models and langchain-core's fake models.

Every expectation is computed independently: with ``Guard.score`` / ``Guard.generate`` on the
same text and prompt, or from a sequential run, never from figures measured before.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.language_models.fake_chat_models import FakeListChatModel, GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from guarduq import Guard
from guarduq.errors import GuardUQAbstention, InputError, ScoringError
from guarduq.integrations.langchain import (
    METADATA_KEY,
    GuardedChatModel,
    GuardedOutput,
    GuardUQCallbackHandler,
    guard_runnable,
)
from guarduq.policy import Policy
from guarduq.scoring.uncertainty import GradientScorer
from guarduq.streaming import stable_prefix as _stable_prefix
from tests.conftest import tiny_llama

SYSTEM = "Be brief."
MESSAGES = [SystemMessage(SYSTEM), HumanMessage("Hi there")]
AS_DICTS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"}]
ABSTAIN = {"name": "never", "version": "1", "rules": [{"name": "no", "action": "abstain", "message": "Not sure."}]}
ALLOW = {"name": "always", "version": "1", "rules": [{"name": "yes", "action": "allow"}]}


def varied(tokenizer: Any) -> dict[str, Any]:
    """A random tiny model repeats one token; these settings make greedy output varied text."""
    return {
        "suppress_tokens": tokenizer.convert_tokens_to_ids(["Ġ", "Ċ", "ĉ", "č"]),
        "no_repeat_ngram_size": 1,
    }


@pytest.fixture
def guard(tokenizer):
    return Guard((tiny_llama(seed=3), tokenizer), max_new_tokens=8)


@pytest.fixture
def kw(tokenizer):
    return varied(tokenizer)


def meta(message: Any) -> dict[str, Any]:
    return message.response_metadata[METADATA_KEY]


def numbers(payload: dict[str, Any]) -> dict[str, Any]:
    """The scores without their timings (which differ from run to run)."""
    return {k: v for k, v in payload["scores"].items() if k != "timings"}


def same_scores(payload: dict[str, Any], expected: Any) -> bool:
    s = payload["scores"]
    return (s["epistemic"], s["aleatoric"], s["n_tokens"]) == (
        expected.epistemic, expected.aleatoric, expected.n_tokens
    )


class EchoChat(BaseChatModel):
    """A stand-in for a remote chat API whose reply depends on its prompt."""

    @property
    def _llm_type(self) -> str:
        return "echo"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        reply = AIMessage(content=f"You said: {messages[-1].text}")
        return ChatResult(generations=[ChatGeneration(message=reply)])


# --------------------------------------------------------------------------- Guard.stream


def test_stream_pieces_join_to_the_scored_text(guard, kw):
    items = list(guard.stream("Hi there", **kw))
    pieces, final = items[:-1], items[-1]
    assert len(pieces) > 1 and all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == final.text == guard.generate("Hi there", **kw).text
    assert final.scores.epistemic == guard.score("Hi there", final.text, ended=final.ended).epistemic


def test_stream_stop_string_cuts_the_reply_and_scores_it_as_not_ended(guard, kw, tokenizer):
    full = guard.generate("Hi there", **kw).text
    stop = next(c for c in full[1:] if c.isascii() and c.isprintable())
    expected = full[: full.index(stop)]
    items = list(guard.stream("Hi there", stop=[stop], **kw))
    final = items[-1]
    assert "".join(items[:-1]) == final.text == expected and final.ended is False
    assert final.scores.n_tokens == len(tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert final.scores.epistemic == guard.score("Hi there", expected, ended=False).epistemic


def test_stream_holds_back_a_possible_stop_prefix_and_partial_characters():
    assert _stable_prefix("hello wor", ("world",)) == "hello "
    assert _stable_prefix("abc\ufffd", ()) == "abc"
    assert _stable_prefix("abc", ("x",)) == "abc"


def test_stream_rejects_bad_stop_sequences(guard):
    with pytest.raises(InputError, match="stop"):
        list(guard.stream("Hi", stop=[""]))


# --------------------------------------------------------------------------- GuardedChatModel


def test_chat_model_metadata_equals_guard_score_on_the_templated_messages(guard, kw, tokenizer):
    msg = GuardedChatModel(guard=guard).invoke(MESSAGES, **kw)
    m = meta(msg)
    assert msg.content == guard.generate(AS_DICTS, **kw).text
    expected = guard.score(AS_DICTS, msg.content, ended=m["ended"])
    assert same_scores(m, expected) and m["risk"] is None and m["decision"] is None
    without_system = guard.score("Hi there", msg.content, ended=m["ended"])
    assert m["scores"]["epistemic"] != without_system.epistemic  # the system message was used
    n_in = len(tokenizer.apply_chat_template(AS_DICTS, add_generation_prompt=True, tokenize=True)["input_ids"])
    n_out = len(tokenizer(msg.content, add_special_tokens=False)["input_ids"]) + int(m["ended"])
    assert msg.usage_metadata == {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


def test_chat_model_passes_max_tokens_and_temperature_to_generation(guard, monkeypatch):
    seen: dict[str, Any] = {}
    original = guard.model.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(guard.model, "generate", spy)
    GuardedChatModel(guard=guard, temperature=0.7).invoke("Hi", max_tokens=3)
    assert (seen["max_new_tokens"], seen["do_sample"], seen["temperature"]) == (3, True, 0.7)
    GuardedChatModel(guard=guard).invoke("Hi")
    assert seen["do_sample"] is False and seen["max_new_tokens"] == guard.max_new_tokens
    with pytest.raises(InputError, match="temperature"):
        GuardedChatModel(guard=guard).invoke("Hi", temperature=-1.0)


def test_chat_model_stop_sequence_is_honoured(guard, kw):
    full = guard.generate(AS_DICTS, **kw).text
    stop = next(c for c in full[1:] if c.isascii() and c.isprintable())
    msg = GuardedChatModel(guard=guard).invoke(MESSAGES, stop=[stop], **kw)
    assert msg.content == full[: full.index(stop)] and meta(msg)["ended"] is False
    assert same_scores(meta(msg), guard.score(AS_DICTS, msg.content, ended=False))


def test_batch_with_concurrency_and_ainvoke_equal_sequential_invoke(guard, kw):
    model = GuardedChatModel(guard=guard)
    prompts = ["Hi there", "Tell me something.", "What is 2+2?", "Name a colour."]
    sequential = [model.invoke(p, **kw) for p in prompts]
    assert len({m.content for m in sequential}) > 1  # different prompts, different replies
    batched = model.batch(prompts, config={"max_concurrency": 3}, **kw)

    async def gather():
        return await asyncio.gather(*(model.ainvoke(p, **kw) for p in prompts))

    for got in (batched, asyncio.run(gather())):
        assert [m.content for m in got] == [m.content for m in sequential]
        assert [numbers(meta(m)) for m in got] == [numbers(meta(m)) for m in sequential]


def test_stream_yields_text_incrementally_and_scores_once(guard, kw):
    model = GuardedChatModel(guard=guard)
    whole = model.invoke(MESSAGES, **kw)
    chunks = list(model.stream(MESSAGES, **kw))
    texts = [c.content for c in chunks if c.content]
    assert len(texts) > 1 and "".join(texts) == whole.content
    carrying = [c for c in chunks if METADATA_KEY in c.response_metadata]
    assert carrying == [chunks[-1]] and chunks[-1].chunk_position == "last"
    assert numbers(meta(chunks[-1])) == numbers(meta(whole))

    async def collect():
        return [c async for c in model.astream(MESSAGES, **kw)]

    achunks = asyncio.run(collect())
    assert "".join(c.content for c in achunks) == whole.content
    assert numbers(meta(achunks[-1])) == numbers(meta(whole))


def test_enforced_abstention_is_never_streamed_unless_asked(guard, kw):
    model = GuardedChatModel(guard=guard, policy=Policy.from_dict(ABSTAIN))
    generated = guard.generate(AS_DICTS, **kw).text
    msg = model.invoke(MESSAGES, **kw)
    assert msg.content == "Not sure." and meta(msg)["decision"]["action"] == "abstain"
    assert same_scores(meta(msg), guard.score(AS_DICTS, generated, ended=meta(msg)["ended"]))
    streamed = "".join(c.content for c in model.stream(MESSAGES, **kw))
    assert streamed == "Not sure."
    live = GuardedChatModel(guard=guard, policy=Policy.from_dict(ABSTAIN), stream_unchecked=True)
    chunks = list(live.stream(MESSAGES, **kw))
    assert "".join(c.content for c in chunks) == generated
    assert meta(chunks[-1])["decision"]["action"] == "abstain"


def test_policy_given_twice_is_refused(guard):
    guarded = GuardedChatModel(guard=guard, policy=Policy.from_dict(ALLOW)).guard
    with pytest.raises(ValueError, match="already has policy"):
        GuardedChatModel(guard=guarded, policy=Policy.from_dict(ABSTAIN))


# --------------------------------------------------------------------------- the callback handler


def test_callback_scores_a_remote_chat_model_like_direct_scoring(guard):
    handler = GuardUQCallbackHandler(guard)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("user", "{q}")])
    chain = prompt | FakeListChatModel(responses=["Paris is the capital."])
    run_id = uuid.uuid4()
    out = chain.invoke({"q": "Capital of France?"}, config={"callbacks": [handler], "run_id": run_id})
    assert out.content == "Paris is the capital."  # the chain's output is untouched
    (record,) = handler.get(run_id)  # found by the chain's run id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital of France?"}]
    expected = guard.score(messages, "Paris is the capital.")
    assert record.text == "Paris is the capital." and record.payload["scored_by"] == "scorer"
    assert same_scores(record.payload, expected) and meta(out) == record.payload
    assert handler.get(record.run_id) == [record]  # and by the model's own run id


def test_callback_scores_string_llms_with_their_prompt(guard):
    handler = GuardUQCallbackHandler(guard)
    llm = FakeListLLM(responses=["Four."])
    result = llm.generate(["What is 2+2?"], callbacks=[handler])
    (record,) = handler.get(result.run[0].run_id)
    assert same_scores(record.payload, guard.score("What is 2+2?", "Four."))
    assert result.generations[0][0].generation_info[METADATA_KEY] == record.payload


def test_callback_reuses_a_guarded_models_own_scores(guard, tokenizer, kw, monkeypatch):
    other = Guard((tiny_llama(seed=1), tokenizer), max_new_tokens=8)
    calls = []
    monkeypatch.setattr(other, "guarded", lambda *a, **k: calls.append(a))
    handler = GuardUQCallbackHandler(other)
    run_id = uuid.uuid4()
    msg = GuardedChatModel(guard=guard).invoke(MESSAGES, config={"callbacks": [handler], "run_id": run_id}, **kw)
    (record,) = handler.get(run_id)
    assert calls == [] and record.payload["model_fingerprint"] == guard.info.fingerprint
    assert record.payload == meta(msg) and record.payload["scored_by"] == "model"


def test_failing_scorer_never_breaks_the_chain_and_goes_to_on_error(guard, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(GradientScorer, "score", broken)  # every Guard's scorer, policy copies too
    handler = GuardUQCallbackHandler(guard, policy=Policy.from_dict(ALLOW))
    chain = FakeListChatModel(responses=["Fine."]) | StrOutputParser()
    run_id = uuid.uuid4()
    assert chain.invoke("Hi", config={"callbacks": [handler], "run_id": run_id}) == "Fine."
    (record,) = handler.get(run_id)
    assert record.decision["action"] == "abstain" and record.decision["rule"] == "on_error"
    assert "device lost" in record.decision["explanation"]

    unloadable = GuardUQCallbackHandler("no-such-model-alias")
    assert chain.invoke("Hi", config={"callbacks": [unloadable], "run_id": run_id}) == "Fine."
    (record,) = unloadable.get(run_id)
    assert "no-such-model-alias" in record.error and record.decision is None


def test_callback_keeps_scores_with_their_runs_under_concurrency(guard):
    handler = GuardUQCallbackHandler(guard)
    chain = EchoChat() | StrOutputParser()
    questions = ["one", "two", "three", "four", "five"]
    run_ids = [uuid.uuid4() for _ in questions]
    configs = [{"callbacks": [handler], "run_id": r, "max_concurrency": 3} for r in run_ids]
    outputs = chain.batch(questions, config=configs)
    for q, out, rid in zip(questions, outputs, run_ids, strict=True):
        (record,) = handler.get(rid)
        assert out == record.text == f"You said: {q}"
        assert same_scores(record.payload, guard.score(q, out))


# --------------------------------------------------------------------------- guard_runnable


def chain_of(reply: str):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("user", "{q}")])
    return prompt | GenericFakeChatModel(messages=iter([reply] * 20)) | StrOutputParser()


def test_allow_passes_the_output_scored_against_the_prompt_the_model_saw(guard):
    guarded = guard_runnable(chain_of("Paris."), guard, policy=Policy.from_dict(ALLOW), details=True)
    out = guarded.invoke({"q": "Capital of France?"})
    assert isinstance(out, GuardedOutput) and out.output == "Paris."
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital of France?"}]
    assert same_scores(out.metadata, guard.score(messages, "Paris."))
    assert out.metadata["decision"]["action"] == "allow" and out.metadata["scored_by"] == "scorer"


def test_abstain_replaces_the_output_or_raises(guard):
    policy = Policy.from_dict(ABSTAIN)
    assert guard_runnable(chain_of("Paris."), guard, policy=policy).invoke({"q": "Capital?"}) == "Not sure."
    message_chain = GenericFakeChatModel(messages=iter(["Paris."] * 5))
    msg = guard_runnable(message_chain, guard, policy=policy).invoke("Capital?")
    assert isinstance(msg, AIMessage) and msg.content == "Not sure." and meta(msg)["decision"]["action"] == "abstain"
    with pytest.raises(GuardUQAbstention) as info:
        guard_runnable(chain_of("Paris."), guard, policy=policy, raise_on_abstain=True).invoke({"q": "Capital?"})
    assert info.value.decision.action == "abstain" and str(info.value) == "Not sure."


def test_escalate_hands_the_case_to_the_sink(guard, tmp_path):
    queue_file = tmp_path / "review.jsonl"
    policy = Policy.from_dict({
        "name": "esc", "version": "1",
        "sinks": {"review": {"type": "jsonl", "path": str(queue_file)}},
        "rules": [{"name": "check", "action": "escalate", "sink": "review", "hold": True, "message": "Held."}],
    })
    out = guard_runnable(chain_of("Paris."), guard, policy=policy).invoke({"q": "Capital?"})
    assert out == "Held."
    (case,) = [json.loads(line) for line in queue_file.read_text().splitlines()]
    assert case["response"] == "Paris." and case["decision"]["action"] == "escalate"


def test_second_opinion_runs_the_ensemble(guard, tokenizer, tmp_path):
    from guarduq.sve import SVEnsemble

    sve = SVEnsemble(guard.model, tokenizer, members=3, cache_dir=tmp_path)
    policy = Policy.from_dict({
        "name": "so", "version": "1",
        "rules": [{"name": "ask", "action": "second_opinion", "rules": [
            {"name": "fine", "when": {"so.mean_prob": {"ge": 0.0}}, "action": "allow"},
            {"name": "other", "action": "abstain"},
        ]}],
    })
    armed = Guard((guard.model, tokenizer), policy=policy, second_opinion=sve, max_new_tokens=8)
    out = guard_runnable(chain_of("Paris."), armed, details=True).invoke({"q": "Capital?"})
    decision = out.metadata["decision"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital?"}]
    direct = sve.second_opinion(messages, "Paris.")
    assert out.output == "Paris." and decision["rule"] == "ask/fine"
    assert decision["second_opinion"]["mean_prob"] == pytest.approx(direct.mean_prob)


def test_scoring_failure_goes_to_on_error_or_raises_without_policy(guard, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(GradientScorer, "score", broken)
    out = guard_runnable(chain_of("Paris."), guard, policy=Policy.from_dict(ALLOW)).invoke({"q": "Capital?"})
    assert out == "I can't answer right now: the safety check could not run."
    with pytest.raises(ScoringError):
        guard_runnable(chain_of("Paris."), guard).invoke({"q": "Capital?"})


def test_guarded_runnable_composes_batches_and_awaits(guard):
    guarded = guard_runnable(EchoChat() | StrOutputParser(), guard, policy=Policy.from_dict(ALLOW), details=True)
    shout = (guarded | RunnableLambda(lambda o: o.output.upper())).with_config(run_name="shout")
    assert shout.invoke("hello") == "YOU SAID: HELLO"
    questions = ["one", "two", "three", "four"]
    sequential = [guarded.invoke(q) for q in questions]
    batched = guarded.batch(questions, config={"max_concurrency": 3})

    async def gather():
        return await asyncio.gather(*(guarded.ainvoke(q) for q in questions))

    for got in (batched, asyncio.run(gather())):
        assert [g.output for g in got] == [s.output for s in sequential]
        assert [numbers(g.metadata) for g in got] == [numbers(s.metadata) for s in sequential]
