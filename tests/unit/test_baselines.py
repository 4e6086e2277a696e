"""Baselines: score-derived maths vs a direct computation, P(True), sampling consistency."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from guarduq import Guard, layout
from guarduq.errors import InputError, ScoringError
from guarduq.scoring.baselines import (
    BASELINES,
    Consistency,
    MaxProbability,
    PTrue,
    agreement,
    continuation_logprobs,
    cut_at_stops,
    from_scores,
    make_baseline,
    p_true_prompt,
    sample_answers,
    token_f1,
    true_probability,
    word_variants,
)
from guarduq.scoring.uncertainty import Scores


class BigramLM(nn.Module):
    """A fake causal LM whose next token depends only on the current one (peaked table).

    ``chain`` maps a token to the token that must follow it; everything else is ~e^-30 as likely.
    """

    def __init__(self, vocab: int, chain: dict[int, int], default: int) -> None:
        super().__init__()
        table = torch.zeros(vocab, vocab)
        table[:, default] = 30.0
        for a, b in chain.items():
            table[a] = 0.0
            table[a, b] = 30.0
        self.table = nn.Parameter(table)
        self.config = SimpleNamespace(max_position_embeddings=512)

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])

    def generate(self, input_ids, attention_mask=None, **gen):  # minimal sampler, HF-like output
        n = gen.get("num_return_sequences", 1)
        seqs = input_ids.repeat(n, 1)
        stop = set(gen["eos_token_id"])
        done = torch.zeros(n, dtype=torch.bool)
        for _ in range(gen["max_new_tokens"]):
            probs = torch.softmax(self.table[seqs[:, -1]] / gen["temperature"], -1)
            nxt = torch.multinomial(probs, 1)[:, 0]
            nxt[done] = gen["pad_token_id"]
            seqs = torch.cat([seqs, nxt[:, None]], 1)
            done |= torch.tensor([int(t) in stop for t in nxt])
            if done.all():
                break
        return seqs


def answering_lm(tokenizer, word: str) -> BigramLM:
    """After the chat template's 'assistant\\n' it spells ``word`` and ends its turn."""
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    im_end = layout.end_of_turn_id(tokenizer)
    chain = {newline: ids[0], **dict(zip(ids[:-1], ids[1:], strict=True)), ids[-1]: im_end}
    return BigramLM(len(tokenizer), chain, default=im_end)


# --------------------------------------------------------------------------- from Scores


def test_score_baselines_match_a_direct_computation(llama, tokenizer):
    """−Σ log p, −mean log p and mean entropy recomputed here from a plain forward pass."""
    guard = Guard((llama, tokenizer))
    prompt, response = "What is two plus two?", "Four, I think."
    scores = guard.score(prompt, response)
    enc = layout.encode(tokenizer, llama, prompt, response)
    with torch.no_grad():
        logits = llama(input_ids=enc.input_ids).logits[0].double()
    rows = torch.log_softmax(logits[enc.response_start - 1 : -1], -1)
    targets = enc.input_ids[0, enc.response_start :]
    tok_lp = rows[torch.arange(len(targets)), targets]
    entropy = -(rows.exp() * rows).sum(-1).mean()

    got = from_scores(scores)
    assert got["max_prob"] == pytest.approx(float(-tok_lp.sum()), rel=1e-5)
    assert got["perplexity"] == pytest.approx(float(-tok_lp.mean()), rel=1e-5)
    assert got["mean_entropy"] == pytest.approx(float(entropy), rel=1e-5)
    # standalone use: without precomputed scores the baseline asks the guard
    assert make_baseline("perplexity").score(guard, prompt, response) == pytest.approx(
        got["perplexity"], rel=1e-9
    )


def test_score_baselines_hand_made_and_invalid():
    s = Scores(0.1, 0.2, 0.6, -0.5, 0.3, 1.25, 4, (0.6,) * 4, 10)
    assert MaxProbability().from_scores(s) == pytest.approx(2.0)
    assert from_scores(s) == pytest.approx({"max_prob": 2.0, "perplexity": 0.5, "mean_entropy": 1.25})
    bad = Scores(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, 0, (), 10, valid=False)
    assert all(math.isnan(v) for v in from_scores(bad).values())


def test_higher_is_more_uncertain_for_score_baselines():
    sure = Scores(0, 0, 0.99, math.log(0.99), 0.99, 0.05, 3, (0.99,) * 3, 1)
    unsure = Scores(0, 0, 0.3, math.log(0.3), 0.3, 2.0, 3, (0.3,) * 3, 1)
    for name, value in from_scores(unsure).items():
        assert value > from_scores(sure)[name], name


# --------------------------------------------------------------------------- P(True)


def test_p_true_prompt_construction():
    text = p_true_prompt("  Capital of France? ", " Paris\n")
    assert text.startswith("Question: Capital of France?\nProposed answer: Paris\n")
    assert text.rstrip().endswith("Answer:") and "True or False" in text
    assert p_true_prompt("Q", "A", template="{answer}|{question}") == "A|Q"
    for q, a in [("", "Paris"), ("Q?", "  "), (None, "x")]:
        with pytest.raises(InputError):
            p_true_prompt(q, a)


def test_true_probability_hand_made():
    # P(true words) = 0.6 + 0.2, P(false words) = 0.1 -> 0.8 / 0.9
    got = true_probability([math.log(0.6), math.log(0.2)], [math.log(0.1)])
    assert got == pytest.approx(0.8 / 0.9)
    assert true_probability([-3.0], [-3.0]) == pytest.approx(0.5)
    assert true_probability([-1000.0], [-1000.5]) == pytest.approx(1 / (1 + math.exp(-0.5)))
    with pytest.raises(ScoringError):
        true_probability([], [-1.0])


def test_word_variants_bare_and_spaced_deduplicated(tokenizer):
    variants = word_variants(tokenizer, ["True", "True", "No"])
    decoded = sorted(tokenizer.decode(list(v)) for v in variants)
    assert decoded == sorted(["True", " True", "No", " No"])


def test_continuation_logprobs_match_full_forward(llama, tokenizer):
    prompt = tokenizer("Answer:", add_special_tokens=False)["input_ids"]
    conts = [tokenizer(" yes", add_special_tokens=False)["input_ids"], [7]]
    got = continuation_logprobs(llama, prompt, conts)
    for cont, value in zip(conts, got, strict=True):
        with torch.no_grad():
            logits = llama(input_ids=torch.tensor([prompt + cont])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        expected = sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(cont))
        assert value == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    ("word", "expected_uncertainty"), [("True", 0.0), ("Yes", 0.0), ("False", 1.0), ("No", 1.0)]
)
def test_p_true_reads_the_models_verdict(tokenizer, word, expected_uncertainty):
    guard = SimpleNamespace(model=answering_lm(tokenizer, word), tokenizer=tokenizer)
    score = PTrue().score(guard, "Capital of France?", "Paris")
    assert score == pytest.approx(expected_uncertainty, abs=1e-6)


def test_p_true_needs_a_string_question(tokenizer):
    guard = SimpleNamespace(model=answering_lm(tokenizer, "True"), tokenizer=tokenizer)
    with pytest.raises(InputError):
        PTrue().score(guard, [{"role": "user", "content": "Q?"}], "A")
    assert PTrue().score(guard, [{"role": "user", "content": "Q?"}], "A", question="Q?") < 1e-6


# --------------------------------------------------------------------------- consistency


def test_agreement_counts_after_squad_normalisation():
    samples = ["eiffel tower", "Eiffel  Tower!", "Paris", "the Eiffel Tower"]
    assert agreement("The Eiffel Tower.", samples) == pytest.approx(3 / 4)
    assert agreement("Paris", samples) == pytest.approx(1 / 4)
    assert agreement("London", samples) == 0.0
    assert agreement("The", ["the", "a"]) == 0.0  # blank after normalisation agrees with nothing
    with pytest.raises(InputError):
        agreement("x", [])


def test_token_f1_hand_made():
    assert token_f1("The Eiffel Tower.", "eiffel tower") == pytest.approx(1.0)
    # "it is in paris" vs "paris": 1 common token; precision 1/1, recall 1/4 -> F1 = 0.4
    assert token_f1("It is in Paris.", "Paris") == pytest.approx(2 * 1 * 0.25 / 1.25)
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("the", "the") == 0.0  # blank after normalisation


def test_f1_agreement_lets_paraphrased_sentences_agree():
    greedy = "The capital of France is Paris."  # -> capital of france is paris (5 tokens)
    samples = [
        "Paris is the capital of France.",  # same 5 tokens: F1 1
        "It is Paris.",  # it is paris: 2 shared, P 2/3, R 2/5 -> F1 0.5
        "Lyon",  # nothing shared: 0
        "France's capital: Paris",  # frances capital paris: 2 shared -> F1 0.5
    ]
    assert agreement(greedy, samples) == 0.0  # exact match: no sentence is the same string
    assert agreement(greedy, samples, match="f1") == pytest.approx(3 / 4)
    assert agreement(greedy, samples, match="f1", f1_threshold=0.6) == pytest.approx(1 / 4)
    with pytest.raises(InputError):
        agreement(greedy, samples, match="fuzzy")


def test_cut_at_stops():
    assert cut_at_stops("Paris\nQ: next", ["\n"]) == "Paris"
    assert cut_at_stops("Paris. Q:", ["\n", " Q:"]) == "Paris."
    assert cut_at_stops("Paris", []) == "Paris"


def test_consistency_with_a_model_that_always_says_the_same(tokenizer):
    guard = SimpleNamespace(model=answering_lm(tokenizer, "Paris"), tokenizer=tokenizer)
    c = Consistency(k=5, max_new_tokens=8)
    assert c.score(guard, "Capital of France?", "paris.") == pytest.approx(0.0)
    assert c.samples_ == ["Paris"] * 5
    assert c.score(guard, "Capital of France?", "Lyon") == pytest.approx(1.0)


def test_consistency_f1_lets_a_sentence_agree_with_its_short_answer(tokenizer):
    guard = SimpleNamespace(model=answering_lm(tokenizer, "Paris"), tokenizer=tokenizer)
    sentence = "It is Paris."  # vs "paris": 1 shared of 3 and 1 tokens -> F1 0.5
    assert Consistency(k=3, max_new_tokens=8).score(guard, "Capital?", sentence) == pytest.approx(1.0)
    assert Consistency(k=3, max_new_tokens=8, match="f1").score(guard, "Capital?", sentence) == 0.0
    with pytest.raises(InputError):
        Consistency(match="fuzzy")


def test_sample_answers_on_a_real_tiny_model_is_seeded_and_leaves_rng_alone(llama, tokenizer):
    state = torch.random.get_rng_state()
    a = sample_answers(llama, tokenizer, "Say something", 4, max_new_tokens=5, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = sample_answers(llama, tokenizer, "Say something", 4, max_new_tokens=5, seed=1)
    c = sample_answers(llama, tokenizer, "Say something", 4, max_new_tokens=5, seed=2)
    assert len(a) == 4 and all(isinstance(t, str) for t in a)
    assert a == b and a != c  # a random 261-token model repeats a 5-token draw with prob ~0


# --------------------------------------------------------------------------- factory


def test_factory_by_plain_names():
    assert set(BASELINES) == {"max_prob", "perplexity", "mean_entropy", "p_true", "consistency"}
    c = make_baseline("consistency", k=3, temperature=0.7)
    assert isinstance(c, Consistency) and c.k == 3 and c.temperature == 0.7
    with pytest.raises(InputError, match="unknown baseline"):
        make_baseline("semantic_entropy")
    with pytest.raises(InputError, match="bad parameters"):
        make_baseline("p_true", k=3)
    with pytest.raises(InputError):
        make_baseline("consistency", k=0)
