"""The SVE second opinion scores a reply in the same layout as the first opinion (``ended``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from guarduq import Guard
from guarduq.sve import SVEnsemble

PROMPT = "Name a colour."
SO_POLICY = (
    "name: t\nversion: 1\nrules:\n"
    "  - name: so\n    action: second_opinion\n    rules:\n"
    "      - name: a\n        when: {so.mean_prob: {ge: 0}}\n        action: allow\n"
)


@pytest.fixture
def setup(tmp_path: Path, llama, tokenizer):
    policy = tmp_path / "p.yaml"
    policy.write_text(SO_POLICY)
    ens = SVEnsemble.from_model(llama, tokenizer, members=3, sigma_init=0.3, seed=1)
    seen: list[bool] = []

    class Recording:
        def second_opinion(self, prompt, response, *, ended=True):
            seen.append(ended)
            return ens.second_opinion(prompt, response, ended=ended)

    guard = Guard((llama, tokenizer), max_new_tokens=3, policy=policy, second_opinion=Recording())
    return guard, ens, seen


def _check_same_layout(r, ens: SVEnsemble) -> None:
    so = r.decision.second_opinion
    same = ens.second_opinion(PROMPT, r.text, ended=r.ended)
    other = ens.second_opinion(PROMPT, r.text, ended=not r.ended)
    assert same.n_tokens == r.scores.n_tokens == other.n_tokens + (1 if r.ended else -1)
    assert so.mean_prob == pytest.approx(same.mean_prob, rel=1e-9)
    assert so.mean_prob != pytest.approx(other.mean_prob, rel=1e-6)


def test_a_reply_cut_by_max_new_tokens_is_second_opinioned_as_cut(setup) -> None:
    guard, ens, seen = setup
    # The random model repeats the prompt's last token (a newline), a blank reply; ban it.
    r = guard.generate(PROMPT, suppress_tokens=[guard.tokenizer.convert_tokens_to_ids("Ċ")])
    assert r.ended is False and r.scores.n_tokens == 3  # cut after 3 byte tokens, no end of turn
    assert seen == [False]
    _check_same_layout(r, ens)


@pytest.mark.parametrize("ended", [True, False])
def test_guarded_replies_pass_their_ended_flag_on(setup, ended: bool) -> None:
    guard, ens, seen = setup
    r = guard.guarded(PROMPT, "Blue", ended=ended)
    assert seen == [ended]
    _check_same_layout(r, ens)


def test_a_provider_without_ended_is_still_called(tmp_path: Path, llama, tokenizer) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(SO_POLICY)
    calls = []

    def legacy(prompt, response):
        calls.append(response)
        return ens_result

    ens_result = SVEnsemble.from_model(llama, tokenizer, members=2, sigma_init=0.0).second_opinion(PROMPT, "Blue")
    guard = Guard((llama, tokenizer), policy=policy, second_opinion=legacy)
    assert guard.guarded(PROMPT, "Blue", ended=False).decision.rule == "so/a" and calls == ["Blue"]
