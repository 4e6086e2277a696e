"""The core on the real SmolLM2: sensible scores, CLI contract, stable fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from guarduq import load_model

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"


def test_correct_answer_more_confident_than_nonsense(real_guard):
    good = real_guard.score(QUESTION, "The capital of France is Paris.")
    bad = real_guard.score(QUESTION, "Purple elephants sing loudly under the frozen toaster.")
    assert good.valid and bad.valid
    assert good.mean_token_prob > bad.mean_token_prob
    assert good.epistemic > 0 and bad.epistemic > 0


def test_generate_then_score_reproduces(real_guard):
    r = real_guard.generate(QUESTION, max_new_tokens=16)
    assert "Paris" in r.text
    again = real_guard.score(QUESTION, r.text, ended=r.ended)
    assert again.epistemic == r.scores.epistemic
    assert again.token_probs == r.scores.token_probs


def test_cli_score_json_contract(real_guard):
    proc = subprocess.run(
        [sys.executable, "-m", "guarduq", "score", "--model", "smollm2-135m-instruct",
         "--prompt", QUESTION, "--response", "Paris.", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["model_fingerprint"] == real_guard.info.fingerprint
    direct = real_guard.score(QUESTION, "Paris.")
    # batched vs sequential scorer in fp32 on a 30-layer model: both sit ~1e-4 from an fp64 copy
    # (benchmarks/throughput.py --fp64-check); 1e-6 exactness is tested on tiny models (test_batched.py)
    assert row["epistemic"] == pytest.approx(direct.epistemic, rel=1e-3)
    assert row["n_tokens"] == direct.n_tokens and row["valid"] is True


@pytest.mark.long
def test_fingerprint_stable_across_gguf_and_cached_loads(tmp_path, monkeypatch, real_guard):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cold = load_model("smollm2-135m-instruct")  # dequantizes the GGUF, writes the cache
    entries = list((tmp_path / "guarduq" / "models").iterdir())
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file()
    assert not [p for p in entries[0].parent.iterdir() if p.name.startswith(".tmp-")]
    warm = load_model("smollm2-135m-instruct")  # reads the safetensors cache
    assert cold.info.fingerprint == warm.info.fingerprint == real_guard.info.fingerprint


def test_the_real_gguf_tokenizer_matches_its_file(real_guard) -> None:
    """SmolLM2's file says EOS = <|im_end|> (2) and no BOS; the loaded tokenizer agrees, and the
    reading transformers 5.17 gave (EOS <|im_start|>) is refused."""
    import copy

    from guarduq.errors import ModelLoadError
    from guarduq.models import check_gguf_tokenizer, gguf_tokenizer_facts, resolve_alias

    path = resolve_alias("smollm2-135m-instruct")
    facts = gguf_tokenizer_facts(path)
    tok = real_guard.tokenizer
    assert facts.eos_id == tok.convert_tokens_to_ids("<|im_end|>") and facts.add_bos is False
    assert len(facts.words) == 32
    check_gguf_tokenizer(tok, facts, path)
    misread = copy.deepcopy(tok)
    misread.eos_token = "<|im_start|>"
    with pytest.raises(ModelLoadError, match="EOS id 1 where the file says 2"):
        check_gguf_tokenizer(misread, facts, path)
