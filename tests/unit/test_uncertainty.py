"""The scores against independent references: naive full gradients and finite differences."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from guarduq import layout
from guarduq.errors import InputError
from guarduq.scoring.uncertainty import GradientScorer, select_parameters
from tests.conftest import tiny_gpt2, tiny_llama

PROMPT = "What is two plus two?"
RESPONSE = "Four, I think."


def naive_pbar(model, enc):
    """p̄ by an independent route: full logits, softmax, pick the next tokens."""
    logits = model(input_ids=enc.input_ids).logits[0]
    probs = torch.softmax(logits.double(), dim=-1)
    ids = enc.input_ids[0]
    picked = [probs[t - 1, ids[t]] for t in range(enc.response_start, ids.shape[0])]
    return torch.stack(picked).mean()


def naive_epistemic(model, enc, params=None):
    """‖∇θ p̄‖² from one torch.autograd.grad over all (unique) parameters, flattened."""
    params = list(model.parameters()) if params is None else params
    grads = torch.autograd.grad(naive_pbar(model, enc), params, allow_unused=True)
    flat = torch.cat([g.reshape(-1) for g in grads if g is not None]).double()
    return float(flat @ flat)


@pytest.mark.parametrize(
    ("make", "prompt"),
    [
        (tiny_llama, PROMPT),
        (lambda: tiny_llama(tie=False), PROMPT),
        (tiny_llama, "Padding <pad> inside the prompt?"),  # the padding row gets no gradient
        (tiny_gpt2, PROMPT),
    ],
    ids=["llama-tied", "llama-untied", "llama-padding-token", "gpt2"],
)
def test_epistemic_matches_naive_full_gradient(make, prompt, tokenizer):
    model = make()
    enc = layout.encode(tokenizer, model, prompt, RESPONSE)
    scores = GradientScorer(model).score(enc.input_ids, enc.response_start)
    expected = naive_epistemic(model, enc)
    assert expected > 0
    assert abs(scores.epistemic - expected) / expected <= 1e-5


def test_tied_embedding_counted_once(tokenizer):
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    enc = layout.encode(tokenizer, model, PROMPT, RESPONSE)
    scores = GradientScorer(model).score(enc.input_ids, enc.response_start)
    unique = naive_epistemic(model, enc)
    # Counting the shared matrix twice (once per use) would add its squared norm again.
    shared = model.lm_head.weight
    g_shared = torch.autograd.grad(naive_pbar(model, enc), [shared])[0].double()
    twice = unique + float((g_shared * g_shared).sum())
    assert scores.epistemic == pytest.approx(unique, rel=1e-5)
    assert abs(scores.epistemic - twice) / twice > 1e-3
    assert GradientScorer(model).n_params == sum(p.numel() for p in model.parameters())


def test_finite_difference_directional_derivative(tokenizer):
    """Along u = g/‖g‖ the directional derivative of p̄ is ‖g‖, so its square is epistemic."""
    model = tiny_gpt2(seed=3).double()  # fp64 end to end (Llama RMSNorm computes in fp32)
    enc = layout.encode(tokenizer, model, PROMPT, RESPONSE)
    scores = GradientScorer(model).score(enc.input_ids, enc.response_start)
    params = list(model.parameters())
    grads = torch.autograd.grad(naive_pbar(model, enc), params)
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    eps = 1e-5

    def shifted(sign: float) -> float:
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.add_(sign * eps * g / norm)
            value = float(naive_pbar(model, enc))
            for p, g in zip(params, grads, strict=True):
                p.sub_(sign * eps * g / norm)
        return value

    fd = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
    assert fd**2 == pytest.approx(scores.epistemic, rel=1e-4)


def test_probabilities_and_aleatoric(llama, tokenizer):
    enc = layout.encode(tokenizer, llama, PROMPT, RESPONSE)
    s = GradientScorer(llama).score(enc.input_ids, enc.response_start)
    with torch.no_grad():
        p_bar = float(naive_pbar(llama, enc))
    assert s.mean_token_prob == pytest.approx(p_bar, rel=1e-6)
    assert s.aleatoric == pytest.approx(p_bar * (1 - p_bar), rel=1e-6)
    assert s.n_tokens == enc.n_response_tokens == len(s.token_probs)
    assert s.min_token_prob == pytest.approx(min(s.token_probs))
    assert s.mean_logprob == pytest.approx(sum(math.log(p) for p in s.token_probs) / s.n_tokens, rel=1e-5)
    assert 0 < s.mean_entropy <= math.log(llama.config.vocab_size) + 1e-6
    assert s.valid and s.reason is None


def test_parameter_selection_by_pattern_and_last_blocks(tokenizer):
    model = tiny_llama(layers=3)
    enc = layout.encode(tokenizer, model, PROMPT, RESPONSE)
    sel = select_parameters(model, last_n_blocks=1)
    assert sel and all(".layers.2." in n for n, _ in sel)
    s = GradientScorer(model, last_n_blocks=1).score(enc.input_ids, enc.response_start)
    assert s.epistemic == pytest.approx(naive_epistemic(model, enc, [p for _, p in sel]), rel=1e-5)
    mlp = select_parameters(model, r"mlp\.")
    assert mlp and all("mlp." in n for n, _ in mlp)
    s2 = GradientScorer(model, parameters=r"mlp\.").score(enc.input_ids, enc.response_start)
    assert s2.epistemic == pytest.approx(naive_epistemic(model, enc, [p for _, p in mlp]), rel=1e-5)
    assert s2.n_params == sum(p.numel() for _, p in mlp)
    with pytest.raises(InputError):
        select_parameters(model, r"no_such_param")
    with pytest.raises(InputError):
        select_parameters(model, last_n_blocks=0)


def test_model_left_exactly_as_found(tokenizer):
    model = tiny_llama()
    model.train()
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    existing = torch.full_like(model.model.norm.weight, 7.0)
    model.model.norm.weight.grad = existing.clone()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}

    enc = layout.encode(tokenizer, model, PROMPT, RESPONSE)
    GradientScorer(model).score(enc.input_ids, enc.response_start)

    assert model.training
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for n, p in model.named_parameters():
        if p is model.model.norm.weight:
            assert torch.equal(p.grad, existing)
        else:
            assert p.grad is None, n
        assert not getattr(p, "_post_accumulate_grad_hooks", None), n
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_train_mode_model_scored_in_eval_mode(tokenizer):
    """Dropout must be off while scoring, whatever mode the caller left the model in."""
    model = tiny_gpt2()
    enc = layout.encode(tokenizer, model, PROMPT, RESPONSE)
    ref = GradientScorer(model).score(enc.input_ids, enc.response_start)
    model.train()
    again = GradientScorer(model).score(enc.input_ids, enc.response_start)
    assert again.epistemic == ref.epistemic and model.training


def test_deterministic_bit_identical(llama, tokenizer):
    enc = layout.encode(tokenizer, llama, PROMPT, RESPONSE)
    scorer = GradientScorer(llama)
    a, b = scorer.score(enc.input_ids, enc.response_start), scorer.score(enc.input_ids, enc.response_start)
    assert a.epistemic == b.epistemic and a.token_probs == b.token_probs


def test_thread_safe_concurrent_equals_sequential(llama, tokenizer):
    texts = [f"Answer number {i}." for i in range(8)]
    encs = [layout.encode(tokenizer, llama, PROMPT, t) for t in texts]
    scorer = GradientScorer(llama)
    sequential = [scorer.score(e.input_ids, e.response_start).epistemic for e in encs]
    results: list[float | None] = [None] * 8
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        results[i] = scorer.score(encs[i].input_ids, encs[i].response_start).epistemic

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential
    assert len(set(sequential)) > 1  # distinct inputs: a mix-up would show


def test_non_finite_marks_result_invalid(tokenizer):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    enc = layout.encode(tokenizer, model, PROMPT, RESPONSE)
    s = GradientScorer(model).score(enc.input_ids, enc.response_start)
    assert not s.valid
    assert "non-finite" in s.reason
