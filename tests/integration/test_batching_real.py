"""Batched generation and bf16 weights on the real SmolLM2 (whose pad token is its end-of-turn)."""

from __future__ import annotations

import math

import pytest

from guarduq import Guard

PROMPTS = ["Hi", "What is the capital of France?",
           "Explain in one sentence why the sky is blue, and mention Rayleigh scattering please."]


def test_generate_batch_equals_generate(real_guard: Guard) -> None:
    single = [real_guard.generate(p, max_new_tokens=16) for p in PROMPTS]
    batch = real_guard.generate_batch(PROMPTS, batch_size=3, max_new_tokens=16)
    assert {r.ended for r in single} == {True, False}  # rows that stop early and one that is cut
    assert [(r.text, r.ended) for r in batch] == [(r.text, r.ended) for r in single]
    for a, b in zip(single, batch, strict=True):
        # batched vs sequential scorer in fp32 on a 30-layer model: both sit ~1e-4 from an fp64 copy
        # (benchmarks/throughput.py --fp64-check); 1e-6 exactness is tested on tiny models (test_batched.py)
        assert b.scores.epistemic == pytest.approx(a.scores.epistemic, rel=1e-3)


def test_bf16_weights_same_fingerprint_close_scores(real_guard: Guard) -> None:
    g16 = Guard("smollm2-135m-instruct", dtype="bf16")
    assert g16.info.fingerprint == real_guard.info.fingerprint
    for prompt, response in [("What is the capital of France?", "The capital of France is Paris."),
                             ("Name a prime number.", "The prime number I'm referring to is 2.")]:
        a, b = real_guard.score(prompt, response), g16.score(prompt, response)
        # Measured (6 replies): p̄ differs by <= 1.1e-2 relative, epistemic by <= 0.16 relative.
        assert b.mean_token_prob == pytest.approx(a.mean_token_prob, rel=5e-2)
        assert abs(math.log10(b.epistemic) - math.log10(a.epistemic)) < 0.15
