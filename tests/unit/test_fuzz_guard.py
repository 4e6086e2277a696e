"""Fuzz the Guard's request methods on a tiny random model: any prompt, response, kwargs."""

from __future__ import annotations

import functools
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from guarduq import Guard
from guarduq.errors import GuardUQError
from guarduq.scoring.uncertainty import Scores
from tests.conftest import make_tokenizer, tiny_llama
from tests.unit.fuzz_support import MEGABYTE, clean, examples, junk, prompts, responses, texts

pytestmark = pytest.mark.fuzz

ALLOW_ALL = "name: fuzz\nversion: 1\naudit: {log_text: true}\nrules:\n  - name: ok\n    action: allow\n"


@functools.cache
def guard() -> Guard:
    return Guard((tiny_llama(), make_tokenizer()), max_new_tokens=4)


@functools.cache
def audited() -> Guard:
    """Guard with a policy and an audit log, so fuzzed text also reaches decide and audit."""
    d = Path(tempfile.mkdtemp(prefix="guarduq-fuzz-"))
    (d / "p.yaml").write_text(ALLOW_ALL)
    return Guard((tiny_llama(), make_tokenizer()), max_new_tokens=4, policy=d / "p.yaml",
                 audit=d / "audit.jsonl")


def _valid(scores: Scores) -> None:
    assert isinstance(scores, Scores)
    if scores.valid:
        assert 0.0 <= scores.mean_token_prob <= 1.0 and math.isfinite(scores.epistemic)
        assert scores.epistemic >= 0 and scores.n_tokens >= 1


def _audit_lines_whole(g: Guard) -> None:
    path = g.audit.path
    if path.exists():
        raw = path.read_bytes()
        assert raw.endswith(b"\n"), "audit log ends with a torn line"
        for line in raw.splitlines():
            json.loads(line)


gen_kwargs = st.dictionaries(
    st.sampled_from([
        "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
        "pad_token_id", "repetition_penalty", "stop_strings", "num_return_sequences",
        "return_dict_in_generate", "output_scores", "streamer", "stopping_criteria", "bogus",
    ]),
    st.one_of(st.integers(-3, 12), st.just(10**12), st.floats(), st.booleans(), st.none(), texts,
              st.lists(st.integers(-2, 300), max_size=3), junk),
    max_size=3,
)


@examples(120)
@given(prompt=prompts, kwargs=gen_kwargs)
@example(prompt=MEGABYTE, kwargs={})
@example(prompt="hi", kwargs={"max_new_tokens": 10**12})
@example(prompt="hi", kwargs={"return_dict_in_generate": True})
@example(prompt="0", kwargs={"eos_token_id": "0"})  # found by make fuzz: each raised inside guarduq
@example(prompt="0", kwargs={"eos_token_id": None})
@example(prompt="0", kwargs={"eos_token_id": 9.223372036854778e18})
@example(prompt="0", kwargs={"stopping_criteria": 10**12})
def test_generate(prompt: Any, kwargs: dict[str, Any]) -> None:
    r = clean("guard.generate", guard().generate, prompt, **kwargs)
    if not isinstance(r, GuardUQError):
        assert isinstance(r.text, str) and isinstance(r.ended, bool)
        _valid(r.scores)


@examples(250)
@given(prompt=prompts, response=responses, ended=st.one_of(st.booleans(), junk))
@example(prompt="hi", response=MEGABYTE, ended=True)
@example(prompt=[{"role": "user", "content": "\ud800"}], response="ok", ended=True)
def test_score(prompt: Any, response: Any, ended: Any) -> None:
    r = clean("guard.score", guard().score, prompt, response, ended=ended)
    if not isinstance(r, GuardUQError):
        _valid(r)
        assert r.valid


@examples(120)
@given(prompt=prompts, response=responses, ended=st.booleans())
def test_guarded_with_policy_and_audit(prompt: Any, response: Any, ended: bool) -> None:
    g = audited()
    r = clean("guard.guarded", g.guarded, prompt, response, ended=ended)
    if not isinstance(r, GuardUQError):
        assert r.decision is not None and r.decision.action == "allow"
        _valid(r.scores)
    _audit_lines_whole(g)


@examples(60)
@given(pairs=st.one_of(st.lists(st.tuples(prompts, responses), max_size=3),
                       st.lists(junk, max_size=3), junk))
def test_score_batch(pairs: Any) -> None:
    r = clean("guard.score_batch", guard().score_batch, pairs)
    if not isinstance(r, GuardUQError):
        assert isinstance(r, list) and all(isinstance(s, Scores) and s.valid for s in r)


@examples(120)
@given(prompt=prompts, options=st.one_of(st.lists(responses, max_size=4), junk))
def test_option_probs(prompt: Any, options: Any) -> None:
    r = clean("guard.option_probs", guard().option_probs, prompt, options)
    if not isinstance(r, GuardUQError):
        assert len(r) == len(options) and all(0.0 <= p <= 1.0 for p in r)
