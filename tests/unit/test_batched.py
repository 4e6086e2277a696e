"""Batched exact scoring against the sequential scorer and the naive full-gradient reference."""

from __future__ import annotations

import json
import logging
import math
import threading

import pytest
import torch

from guarduq import Guard, layout
from guarduq.errors import InputError
from guarduq.scoring.uncertainty import GradientScorer, Scores, select_parameters
from tests.conftest import VOCAB, tiny_gemma, tiny_gpt2, tiny_llama
from tests.unit.test_uncertainty import naive_epistemic

PAIRS = [
    ("What is two plus two?", "Four, I think."),
    ("Hi", "Hello there, my old friend from the village by the sea!"),
    ("Padding <pad> inside the prompt, and a much longer question than the others?", "Yes"),
    ("x", "y z"),
]
REL = 1e-6


MODELS = {
    "llama-tied": tiny_llama,
    "llama-untied": lambda: tiny_llama(tie=False),
    "gpt2": tiny_gpt2,
    "gemma3": tiny_gemma,
}


def encode_all(tokenizer, model, pairs=PAIRS):
    encs = [layout.encode(tokenizer, model, p, r) for p, r in pairs]
    return encs, [(e.input_ids, e.response_start) for e in encs]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_same(batched: Scores, seq: Scores, tol: float = REL) -> None:
    assert rel(batched.epistemic, seq.epistemic) <= tol
    for f in ("mean_token_prob", "aleatoric", "mean_logprob", "min_token_prob", "mean_entropy"):
        assert rel(getattr(batched, f), getattr(seq, f)) <= tol, f
    assert batched.n_tokens == seq.n_tokens and batched.n_params == seq.n_params
    assert max(rel(a, b) for a, b in zip(batched.token_probs, seq.token_probs, strict=True)) <= tol
    assert batched.valid and batched.timings.keys() == seq.timings.keys()
    assert batched.grad_profile.keys() == seq.grad_profile.keys()
    assert math.fsum(batched.grad_profile.values()) == pytest.approx(batched.epistemic, rel=1e-12)


# fp32 tolerance per model: Gemma's fp32 rounding floor is higher (its RMSNorms compute in fp32
# and its naive fp32 reference alone sits up to ~8e-7 from the fp64 value), so 1e-6 there is
# not a property of batching; in float64 every model agrees to <= 1e-9.
FP32_REL = {"llama-tied": REL, "llama-untied": REL, "gpt2": REL, "gemma3": 3e-6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(MODELS))
def test_batch_equals_sequential_and_naive(name, dtype, tokenizer, caplog):
    model = MODELS[name]().to(dtype)
    tol = FP32_REL[name] if dtype == torch.float32 else 1e-9
    encs, items = encode_all(tokenizer, model)
    assert len({int(ids.shape[1]) for ids, _ in items}) == len(items)  # mixed lengths
    scorer = GradientScorer(model)
    with caplog.at_level(logging.WARNING, logger="guarduq"):
        batched = scorer.score_batch(items)
    assert "batched_scoring_fallback" not in caplog.text  # really the one-pass path
    for enc, b, (ids, start) in zip(encs, batched, items, strict=True):
        assert_same(b, scorer.score(ids, start), tol)
        assert rel(b.epistemic, naive_epistemic(model, enc)) <= tol
    assert len({b.epistemic for b in batched}) == len(batched)  # a mix-up would show


@pytest.mark.parametrize(
    ("make", "selection"),
    [
        (lambda: tiny_llama(layers=3), {"last_n_blocks": 1}),
        (tiny_llama, {"parameters": r"mlp\."}),
        (lambda: tiny_llama(tie=False), {"parameters": r"lm_head"}),  # head only: nothing else needs grad
        (tiny_gpt2, {"parameters": r"wpe|ln_"}),  # position embedding and LayerNorms only
        (tiny_gemma, {"parameters": r"norm"}),
    ],
    ids=["last-block", "mlp", "head-only", "gpt2-wpe-ln", "gemma-norms"],
)
def test_parameter_selection_honoured(make, selection, tokenizer, caplog):
    model = make()
    encs, items = encode_all(tokenizer, model)
    scorer = GradientScorer(model, **selection)
    params = [p for _, p in select_parameters(model, selection.get("parameters"), selection.get("last_n_blocks"))]
    with caplog.at_level(logging.WARNING, logger="guarduq"):
        batched = scorer.score_batch(items, batch_size=3)
    assert "batched_scoring_fallback" not in caplog.text
    for enc, b in zip(encs, batched, strict=True):
        assert rel(b.epistemic, naive_epistemic(model, enc, params)) <= REL
        assert b.n_params == sum(p.numel() for p in params)


def _shared_weight(model):
    """Two Linear layers holding one weight: no one-pass route, so the batch goes sequential."""
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    return "shared by 2 modules"


def _module_twice(model):
    """One norm module used in two places: called twice per forward."""
    model.model.layers[1].input_layernorm = model.model.layers[0].input_layernorm
    return "called more than once"


@pytest.mark.parametrize("breaker", [_shared_weight, _module_twice], ids=["static", "at-run-time"])
def test_fallback_is_logged_and_exact(breaker, tokenizer, caplog):
    model = tiny_llama()
    reason = breaker(model)
    encs, items = encode_all(tokenizer, model)
    scorer = GradientScorer(model)
    with caplog.at_level(logging.WARNING, logger="guarduq"):
        batched = scorer.score_batch(items)
    assert "batched_scoring_fallback" in caplog.text and reason in caplog.text
    for enc, b in zip(encs, batched, strict=True):
        assert rel(b.epistemic, naive_epistemic(model, enc)) <= REL


def test_model_left_exactly_as_found(tokenizer):
    model = tiny_gpt2()
    model.train()
    model.transformer.h[0].mlp.c_fc.weight.requires_grad_(False)
    existing = torch.full_like(model.transformer.ln_f.weight, 7.0)
    model.transformer.ln_f.weight.grad = existing.clone()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    _, items = encode_all(tokenizer, model)
    GradientScorer(model).score_batch(items)
    assert model.training
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, existing) if p is model.transformer.ln_f.weight else p.grad is None, n
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_non_finite_marks_each_result_invalid(tokenizer):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    _, items = encode_all(tokenizer, model)
    for s in GradientScorer(model).score_batch(items):
        assert not s.valid and "non-finite" in s.reason


def test_concurrent_batches_and_single_scores(tokenizer):
    model = tiny_llama()
    _, items = encode_all(tokenizer, model)
    scorer = GradientScorer(model)
    expected = [s.epistemic for s in scorer.score_batch(items)]
    results: dict[int, list[float]] = {}
    barrier = threading.Barrier(4)

    def work(k: int) -> None:
        barrier.wait()
        if k % 2:
            results[k] = [s.epistemic for s in scorer.score_batch(items, batch_size=2)]
        else:
            results[k] = [scorer.score(*it).epistemic for it in items]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results.values():
        assert all(rel(a, b) <= REL for a, b in zip(got, expected, strict=True))


def test_bad_items_raise_input_error(tokenizer):
    model = tiny_llama()
    _, items = encode_all(tokenizer, model)
    scorer = GradientScorer(model)
    with pytest.raises(InputError):
        scorer.score_batch([(items[0][0], items[0][0].shape[1])])  # no response token
    with pytest.raises(InputError):
        scorer.score_batch([(items[0][0][0], 3)])  # not [1, L]
    with pytest.raises(InputError):
        scorer.score_batch(items, batch_size=0)
    assert scorer.score_batch([]) == []


def test_grad_profile_round_trips_and_old_caches_load(tokenizer):
    model = tiny_llama(tie=False)
    _, items = encode_all(tokenizer, model)
    s = GradientScorer(model).score(*items[0])
    assert {"embed", "head", "final_norm", "block.0.attn", "block.1.mlp", "block.1.norm"} <= s.grad_profile.keys()
    assert math.fsum(s.grad_profile.values()) == pytest.approx(s.epistemic, rel=1e-12)
    d = json.loads(json.dumps(s.to_dict()))
    assert Scores.from_dict(d) == s
    d.pop("grad_profile")
    assert Scores.from_dict(d).grad_profile == {}


def test_guard_score_batch_matches_score(tokenizer):
    guard = Guard((tiny_llama(), tokenizer))
    flags = [True, False, True, False]
    batched = guard.score_batch(PAIRS, ended=flags, batch_size=2)
    for (p, r), e, b in zip(PAIRS, flags, batched, strict=True):
        assert_same(b, guard.score(p, r, ended=e))
    with pytest.raises(InputError):
        guard.score_batch(PAIRS, ended=[True])
    with pytest.raises(InputError):
        guard.score_batch(PAIRS, batch_size=0)
    with pytest.raises(InputError):
        guard.score_batch([("prompt", "")])


@pytest.mark.parametrize("name", ["gpt2", "llama-tied"])  # Llama: q/k/v share one input Gram
@pytest.mark.parametrize("gram", [True, False], ids=["gram", "explicit"])
def test_both_linear_routes_exact(gram, name, tokenizer, monkeypatch):
    """Ghost norm (T×T Grams) and explicit per-sequence gradients give the same numbers."""
    from guarduq.scoring.batched import _Tape

    monkeypatch.setattr(_Tape, "_use_gram", lambda self, m: gram)
    model = MODELS[name]()
    encs, items = encode_all(tokenizer, model)
    for enc, b in zip(encs, GradientScorer(model).score_batch(items), strict=True):
        assert rel(b.epistemic, naive_epistemic(model, enc)) <= REL


def test_tied_head_with_bias_counts_both_uses(tokenizer, caplog):
    """A tied head the vocabulary route cannot take (it has a bias): the shared matrix goes to
    the ordinary per-parameter path (sequential, logged), cross term included."""
    model = tiny_llama(tie=True)
    model.lm_head.bias = torch.nn.Parameter(torch.randn(VOCAB) * 0.1)
    encs, items = encode_all(tokenizer, model)
    scorer = GradientScorer(model)
    with caplog.at_level(logging.WARNING, logger="guarduq"):
        batched = scorer.score_batch(items)
    assert "shared by 2 modules" in caplog.text
    for enc, b, it in zip(encs, batched, items, strict=True):
        expected = naive_epistemic(model, enc)
        assert rel(scorer.score(*it).epistemic, expected) <= REL
        assert rel(b.epistemic, expected) <= REL
