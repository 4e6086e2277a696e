"""SmolLM2: scores from the states generation recorded (last N blocks) equal a fresh full forward's
to ≤ 1e-4 relative in float32, on every generation path, the server's included."""

from __future__ import annotations

import httpx
import pytest

from guarduq import Guard
from guarduq.models import LoadedModel
from guarduq.scoring import reuse
from tests.unit.serve_helpers import serving

pytestmark = pytest.mark.integration

REL = 1e-4


@pytest.fixture(scope="module")
def last2(real_guard: Guard) -> Guard:
    g = real_guard
    return Guard(LoadedModel(g.model, g.tokenizer, g.info), last_n_blocks=2, max_new_tokens=12)


def check(guard: Guard, prompt: str, r) -> None:
    again = guard.score(prompt, r.text, ended=r.ended)  # teacher forcing: the full model
    assert r.scores.valid and r.scores.parameter_set == again.parameter_set == "last_n_blocks=2"
    assert abs(r.scores.epistemic - again.epistemic) <= REL * again.epistemic
    assert max(abs(a - b) for a, b in zip(r.scores.token_probs, again.token_probs, strict=True)) <= REL


class LowBlockCalls:
    def __init__(self, guard: Guard) -> None:
        self.n = 0
        reuse.decoder_blocks(guard.model)[0].mlp.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        import torch

        self.n += int(torch.is_grad_enabled())


def test_reuse_paths_equal_teacher_forcing(last2: Guard):
    assert last2.scorer.reuse_block == 28
    calls = LowBlockCalls(last2)
    prompts = ["What is the capital of France?", "Name a primary colour.", "Who wrote Hamlet? Answer briefly."]
    one = last2.generate(prompts[0])
    many = last2.generate_batch(prompts)  # left-padded rows
    streamed = list(last2.stream(prompts[2]))[-1]
    assert calls.n == 0  # no scoring pass ran block 0
    check(last2, prompts[0], one)
    for p, r in zip(prompts, many, strict=True):
        check(last2, p, r)
    check(last2, prompts[2], streamed)


def test_server_replies_reuse_generation(last2: Guard):
    from guarduq.serve import Settings, create_app

    app = create_app(last2, settings=Settings(model_ids=("smollm2-135m-instruct",)))
    with serving(app) as port:
        prompt = "What is the capital of France?"
        body = {"model": "smollm2-135m-instruct", "max_tokens": 12,
                "messages": [{"role": "user", "content": prompt}]}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).json()
    meta = reply["guarduq"]
    text = reply["choices"][0]["message"]["content"]
    again = last2.score([{"role": "user", "content": prompt}], text, ended=meta["ended"])
    assert meta["scores"]["parameter_set"] == "last_n_blocks=2"
    assert abs(meta["scores"]["epistemic"] - again.epistemic) <= REL * again.epistemic
