"""The ensemble harness's cached frozen-block path on real SmolLM2 equals its full forward."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from guarduq import Guard

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _ensemble_methods import FAMILIES, Example, SVEMethod, Top, encode_split, mc_prompt, mc_words  # noqa: E402

QUESTIONS = [
    ("Which gas do plants take in to make food?", ["oxygen", "carbon dioxide", "nitrogen", "helium"], 1),
    ("What melts ice fastest on a road?", ["salt", "sand", "sugar"], 0),
    ("Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
    ("What do bees make?", ["milk", "silk", "wax and honey", "paper"], 2),
]


def test_cached_states_reproduce_the_full_model(real_guard: Guard) -> None:
    model, tok = real_guard.model, real_guard.tokenizer
    n_blocks = len(model.base_model.layers)
    top = Top(model, tok, n_blocks - 2, mc_words(False))
    enc = encode_split(top, [Example(mc_prompt(q, o), y, len(o)) for q, o, y in QUESTIONS])
    for method in (SVEMethod(2, 1e-2, sigma_init=0.1), FAMILIES["lora"](1, 1e-2), FAMILIES["deep"](1, 1e-4)):
        method.build(top)
        with torch.no_grad():
            cached = method.member_logits(top, enc, list(range(len(enc))))
            m = method.members
            blocks = method.blocks if isinstance(method, SVEMethod) else method.copies[0]
            full = top.full_logits(enc.ids * m, np.tile(enc.n_options, m), member=blocks).reshape(m, len(enc), -1)
        finite = torch.isfinite(full)
        gap = float((cached[finite] - full[finite]).abs().max())
        assert gap <= 1e-4 * float(full[finite].abs().max()), (method.name, gap)
    # the base answers recorded with the states are the model's own next-token logits
    input_ids, mask = top.collate(enc.ids, None)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    last = logits[torch.arange(len(enc)), mask.sum(1) - 1][:, top.label_ids]
    for i, k in enumerate(enc.n_options):
        torch.testing.assert_close(enc.base_logits[i, :k], last[i, :k].float(), rtol=1e-4, atol=1e-3)
