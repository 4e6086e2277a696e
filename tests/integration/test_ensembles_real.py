"""The ensemble harness's cached frozen-block path on real SmolLM2 equals its full forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from guarduq import Guard, layout

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _ensemble_methods import FAMILIES, Example, SVEMethod, Top, encode_split  # noqa: E402

QUESTIONS = [
    ("Which gas do plants take in to make food?", ["oxygen", "carbon dioxide", "nitrogen", "helium"], 1),
    ("What melts ice fastest on a road?", ["salt", "sand", "sugar"], 0),
    ("Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
    ("What do bees make?", ["milk", "silk", "wax and honey", "paper"], 2),
]


def test_cached_states_reproduce_the_full_model(real_guard: Guard) -> None:
    model, tok = real_guard.model, real_guard.tokenizer
    n_blocks = len(model.base_model.layers)
    top = Top(model, tok, n_blocks - 2)
    exs = [Example(f"Answer briefly: {q}", tuple(o), y) for q, o, y in QUESTIONS]
    enc = encode_split(top, exs, 4)
    rows = list(range(len(enc)))
    for method in (SVEMethod(2, 1e-2, sigma_init=0.1), FAMILIES["lora"](1, 1e-2), FAMILIES["deep"](1, 1e-4)):
        method.build(top)
        with torch.no_grad():
            cached = method.member_logits(top, enc, rows)
            m = method.members
            blocks = method.blocks if isinstance(method, SVEMethod) else method.copies[0]
            full = top.full_logits(enc, rows * m, member=blocks).reshape(m, len(enc), -1)
        finite = torch.isfinite(full)
        gap = float((cached[finite] - full[finite]).abs().max())
        assert gap <= 1e-4 * float(full[finite].abs().max()) + 1e-5, (method.name, gap)
    # the base scores recorded with the states: each option's mean token log-probability, as a
    # plain forward of prompt + option through the model computes it
    for i, ex in enumerate(exs):
        prompt = layout.prompt_ids(tok, ex.prompt)
        for j, option in enumerate(ex.options):
            ids = torch.tensor([prompt + layout.response_ids(tok, option, ended=True)])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            expected = logp[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt):].unsqueeze(-1)).mean()
            assert float(enc.base_logits[i, j]) == pytest.approx(float(expected), abs=1e-4)
