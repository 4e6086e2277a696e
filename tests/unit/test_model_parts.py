"""Chunked models: parts assembled into the cache only when the whole file's sha256 is the pinned one."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from guarduq.errors import ModelLoadError, ModelNotFoundError
from guarduq.model_parts import ChunkedGGUF, assemble, assembled_path
from guarduq.models import ALIASES, cache_root, load_model, resolve_alias


def _fake_parts(root: Path, prefix: str, blobs: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """Packages ``{prefix}1..N`` shaped like the real ones: ``get_part_path()`` -> data/partNN.bin."""
    for i, blob in enumerate(blobs, start=1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n"
        )
    monkeypatch.syspath_prepend(str(root))
    for i in range(1, len(blobs) + 1):
        sys.modules.pop(f"{prefix}{i}", None)


BLOBS = [b"GGUF" + bytes(range(256)) * 3, b"middle part " * 50, b"tail"]


def test_assemble_concatenates_in_order_when_the_hash_matches(tmp_path, monkeypatch):
    _fake_parts(tmp_path / "site", "guq_fake_part", BLOBS, monkeypatch)
    whole = b"".join(BLOBS)
    chunks = ChunkedGGUF("guq_fake_part", 3, hashlib.sha256(whole).hexdigest(), len(whole))
    assert chunks.installed()
    out = assemble(chunks, tmp_path / "cache" / "m.gguf", chunk_bytes=7)
    assert out.read_bytes() == whole
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]  # no temporary left


def test_a_wrong_hash_names_both_and_leaves_nothing(tmp_path, monkeypatch):
    _fake_parts(tmp_path / "site", "guq_bad_part", BLOBS, monkeypatch)
    whole = b"".join(BLOBS)
    pinned = hashlib.sha256(b"the real model").hexdigest()
    chunks = ChunkedGGUF("guq_bad_part", 3, pinned, len(whole))
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelLoadError) as err:
        assemble(chunks, dest)
    assert pinned in str(err.value) and hashlib.sha256(whole).hexdigest() in str(err.value)
    assert list(dest.parent.iterdir()) == []


def test_a_missing_part_is_not_found(tmp_path, monkeypatch):
    _fake_parts(tmp_path / "site", "guq_short_part", BLOBS[:2], monkeypatch)
    chunks = ChunkedGGUF("guq_short_part", 3, "0" * 64, 1)
    assert not chunks.installed()
    with pytest.raises(ModelNotFoundError, match="guq_short_part3"):
        assemble(chunks, tmp_path / "m.gguf")


@pytest.mark.parametrize("alias,target", [("qwen2.5-coder-0.5b-instruct", "make model-qwen-0.5b"),
                                          ("qwen2.5-coder-1.5b-instruct", "make model-qwen-1.5b")])
def test_an_unprovisioned_alias_names_its_make_target(alias, target, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    prefix = ALIASES[alias].chunks.prefix
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(prefix) else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=target):
        load_model(alias)


def test_a_tampered_assembled_file_is_refused_before_loading(monkeypatch):
    alias = "qwen2.5-coder-0.5b-instruct"
    path = assembled_path(cache_root(), ALIASES[alias].gguf_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF not the pinned bytes")
    assert resolve_alias(alias) == path
    with pytest.raises(ModelLoadError, match=ALIASES[alias].chunks.sha256):
        load_model(alias)
