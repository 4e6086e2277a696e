"""SVE on the real SmolLM2 (last block only, so it stays well under a minute)."""

from __future__ import annotations

import pytest
import torch

from guarduq.cli.sve import SST2_LABEL_WORDS, sst2_prompt
from guarduq.sve import SVEnsemble

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"


def test_untrained_members_agree_with_the_guard_and_noise_creates_spread(real_guard):
    ens = SVEnsemble.from_model(real_guard.model, real_guard.tokenizer, members=2,
                                sigma_init=0.0, last_n_blocks=1)
    assert ens._sharing is not None  # the 29 blocks before the SVE block run once, not twice
    op = ens.second_opinion(QUESTION, "The capital of France is Paris.")
    base = real_guard.score(QUESTION, "The capital of France is Paris.")
    assert op.member_mean_probs == pytest.approx([base.mean_token_prob] * 2, rel=1e-4)
    assert op.variance == pytest.approx(0.0, abs=1e-10)

    noisy = SVEnsemble.from_model(real_guard.model, real_guard.tokenizer, members=2,
                                  sigma_init=0.2, last_n_blocks=1)
    op2 = noisy.second_opinion(QUESTION, "The capital of France is Paris.")
    assert op2.variance > 0 and op2.mutual_information > 0
    assert 0 < op2.mean_prob < 1


def test_label_word_probabilities_on_sst2_prompts(real_guard):
    ens = SVEnsemble.from_model(real_guard.model, real_guard.tokenizer, members=2,
                                sigma_init=0.0, last_n_blocks=1)
    prompts = [sst2_prompt("a gorgeous , witty , seductive movie ."),
               sst2_prompt("the plot is nothing but boilerplate clichés from start to finish .")]
    probs = ens.predict_proba(prompts, SST2_LABEL_WORDS)
    assert probs.shape == (2, 2)
    assert torch.allclose(torch.from_numpy(probs).sum(1).double(), torch.ones(2, dtype=torch.float64))
    assert probs[0, 1] > probs[1, 1]  # the positive review is the more positive one
