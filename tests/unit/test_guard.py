"""Guard: the one token layout, generation/scoring agreement, bad input."""

from __future__ import annotations

import pytest

from guarduq import Guard, layout
from guarduq.errors import ContextLengthError, GuardUQError, InputError
from tests.conftest import tiny_gpt2, tiny_llama


@pytest.fixture
def guard(llama, tokenizer):
    return Guard((llama, tokenizer), max_new_tokens=8)


def no_blank(tokenizer) -> dict:
    """A random model likes whitespace; suppress it so greedy output is a scorable text."""
    return {"suppress_tokens": tokenizer.convert_tokens_to_ids(["Ġ", "Ċ", "ĉ", "č"])}


def test_layout_appends_end_of_turn_only_when_ended(tokenizer, llama):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert layout.end_of_turn_id(tokenizer) == im_end
    ended = layout.encode(tokenizer, llama, "Hi", "Hello")
    cut = layout.encode(tokenizer, llama, "Hi", "Hello", ended=False)
    assert ended.input_ids[0, -1].item() == im_end
    assert ended.n_response_tokens == cut.n_response_tokens + 1 == len("Hello") + 1
    text = tokenizer.decode(ended.input_ids[0, : ended.response_start])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text


def test_layout_without_template_uses_eos(plain_tokenizer, llama):
    enc = layout.encode(plain_tokenizer, llama, "Q: 2+2?\nA:", " 4")
    assert enc.input_ids[0, -1].item() == plain_tokenizer.eos_token_id
    assert plain_tokenizer.decode(enc.input_ids[0, : enc.response_start], skip_special_tokens=True) == "Q: 2+2?\nA:"


def test_generate_then_score_reproduces_exactly(guard, tokenizer):
    r = guard.generate("Tell me something.", **no_blank(tokenizer))
    assert r.text.strip() and r.scores.valid
    again = guard.score("Tell me something.", r.text, ended=r.ended)
    assert again.epistemic == r.scores.epistemic
    assert again.token_probs == r.scores.token_probs


def test_blank_generation_is_marked_invalid_not_nan(guard):
    r = guard.generate("Tell me something.", max_new_tokens=3, suppress_tokens=list(range(5, 261)))
    assert not r.scores.valid and "empty" in r.scores.reason


def test_generation_that_ends_its_turn_is_scored_with_end_token(tokenizer):
    """Force the end-of-turn token after 3 tokens: the turn ended, so the layout adds it."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    guard = Guard((tiny_llama(), tokenizer), max_new_tokens=3)
    r = guard.generate("Hi", **no_blank(tokenizer))
    assert r.ended is False  # a random model does not stop within 3 tokens
    assert r.scores.n_tokens == len(tokenizer(r.text, add_special_tokens=False)["input_ids"])
    forced = guard.generate("Hi", max_new_tokens=6, forced_eos_token_id=im_end, **no_blank(tokenizer))
    assert forced.ended is True
    assert forced.scores.n_tokens == len(tokenizer(forced.text, add_special_tokens=False)["input_ids"]) + 1


def test_generation_kwargs_do_not_mutate_model_config(guard):
    before = guard.model.generation_config.to_dict()
    guard.generate("Hi", max_new_tokens=2, do_sample=True, temperature=0.7, top_k=5)
    assert guard.model.generation_config.to_dict() == before


def test_score_batch_equals_individual_scores(guard):
    pairs = [("Hi", "Hello there"), ("2+2?", "4"), ("Name?", "Bob")]
    batch = guard.score_batch(pairs)
    # one forward+backward for the batch: equal to float rounding (tests/unit/test_batched.py)
    assert [b.epistemic for b in batch] == pytest.approx([guard.score(p, r).epistemic for p, r in pairs], rel=1e-6)


def test_option_probs_rank_by_mean_token_prob(guard):
    probs = guard.option_probs("Pick one", ["alpha", "beta"])
    expected = [guard.score("Pick one", o).mean_token_prob for o in ["alpha", "beta"]]
    assert probs == pytest.approx(expected, rel=1e-5)


def test_chat_messages_with_system_prompt(guard, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    s = guard.score(msgs, "Hello")
    ids = layout.prompt_ids(tokenizer, msgs)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tokenizer.decode(ids)
    assert s.valid


@pytest.mark.parametrize(
    ("prompt", "response", "match"),
    [
        ("", "x", "prompt is empty"),
        ("   \n", "x", "prompt is empty"),
        ("Hi", "", "response is empty"),
        ("Hi", "  ", "response is empty"),
        (42, "x", "prompt must be a string"),
        ("Hi", 3.5, "response must be a string"),
        ([], "x", "messages list is empty"),
        ([{"role": "wizard", "content": "x"}], "x", "unknown role"),
    ],
)
def test_bad_input_gives_typed_error(guard, prompt, response, match):
    with pytest.raises(InputError, match=match):
        guard.score(prompt, response)


def test_too_long_for_context(tokenizer):
    guard = Guard((tiny_gpt2(), tokenizer))
    with pytest.raises(ContextLengthError, match="longer than the model's context of 256"):
        guard.score("x" * 300, "y")
    with pytest.raises(ContextLengthError):
        guard.generate("x" * 300)


def test_bad_guard_argument():
    with pytest.raises(GuardUQError, match="model spec"):
        Guard(12345)
