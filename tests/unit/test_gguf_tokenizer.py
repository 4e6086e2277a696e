"""The GGUF tokenizer check: a tokenizer read differently from its file is refused, not used.

The metadata comes from real (tiny, tensor-less) GGUF files written with the gguf package, so the
reading side is the one the loader uses.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from guarduq import load_model
from guarduq.errors import CacheCorruptError, ModelLoadError
from guarduq.models import cache_root, check_gguf_tokenizer, gguf_tokenizer_facts
from tests.conftest import SPECIALS, tiny_llama

WORDS = ["Ġcapital", "Ġfrance", "Ġpariss"]


def word_tokenizer(merged: bool = True) -> PreTrainedTokenizerFast:
    """Byte-level BPE whose merges spell WORDS (merged=False: the merges were lost)."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = []
    for word in WORDS:
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                vocab[word[:k]] = len(vocab)
                merges.append((word[: k - 1], word[k - 1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges if merged else []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def write_gguf(path: Path, tok: PreTrainedTokenizerFast, *, eos: int, add_bos: bool = False) -> Path:
    """A GGUF holding only tokenizer metadata, as llama.cpp's converter writes it."""
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])])
    w.add_eos_token_id(eos)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_facts_come_from_the_file(tmp_path):
    tok = word_tokenizer()
    facts = gguf_tokenizer_facts(write_gguf(tmp_path / "t.gguf", tok, eos=7, add_bos=True))
    assert (facts.eos_id, facts.bos_id, facts.add_bos) == (7, tok.bos_token_id, True)
    # whole-word entries of 5+ letters (the merge chain's longer prefixes are vocabulary words too)
    assert set(WORDS) <= {t for _, t in facts.words}
    assert all(t[0] == "Ġ" and t[1:].isalpha() and len(t) >= 6 for _, t in facts.words)
    assert all(tok.convert_ids_to_tokens(i) == t for i, t in facts.words)


def test_a_tokenizer_that_matches_its_file_passes(tmp_path):
    tok = word_tokenizer()
    check_gguf_tokenizer(tok, gguf_tokenizer_facts(write_gguf(tmp_path / "t.gguf", tok, eos=tok.eos_token_id)), "t")


def test_a_wrong_eos_is_refused(tmp_path):
    tok = word_tokenizer()
    facts = gguf_tokenizer_facts(write_gguf(tmp_path / "t.gguf", tok, eos=tok.convert_tokens_to_ids("<|im_end|>")))
    with pytest.raises(ModelLoadError, match=r"EOS id 2 where the file says 4.*transformers>="):
        check_gguf_tokenizer(tok, facts, "t")


def test_a_missing_bos_is_refused(tmp_path):
    tok = word_tokenizer()  # no post-processor: adds no BOS
    facts = gguf_tokenizer_facts(write_gguf(tmp_path / "t.gguf", tok, eos=tok.eos_token_id, add_bos=True))
    with pytest.raises(ModelLoadError, match="no BOS token"):
        check_gguf_tokenizer(tok, facts, "t")


def test_a_tokenizer_that_lost_its_merges_is_refused(tmp_path):
    good = word_tokenizer()
    facts = gguf_tokenizer_facts(write_gguf(tmp_path / "t.gguf", good, eos=good.eos_token_id))
    n = len(facts.words)
    with pytest.raises(ModelLoadError, match=f"{n} of {n} vocabulary words"):
        check_gguf_tokenizer(word_tokenizer(merged=False), facts, "t")


def _cache_entry_for(gguf: Path, tok: PreTrainedTokenizerFast) -> Path:
    """A model cache entry as an older guarduq wrote it: no tokenizer_checked mark."""
    entry = cache_root() / "models" / hashlib.sha256(gguf.read_bytes()).hexdigest()[:32]
    tiny_llama().save_pretrained(entry)
    tok.save_pretrained(entry)
    (entry / "guarduq.json").write_text(json.dumps({"format": 1, "gguf": str(gguf)}))
    return entry


def test_an_old_cache_entry_is_checked_once_against_its_gguf(tmp_path):
    tok = word_tokenizer()
    gguf = write_gguf(tmp_path / "m.gguf", tok, eos=tok.eos_token_id)
    entry = _cache_entry_for(gguf, tok)
    load_model(gguf)
    assert json.loads((entry / "guarduq.json").read_text())["tokenizer_checked"] is True


def test_an_old_cache_entry_read_wrongly_is_refused(tmp_path):
    tok = word_tokenizer()
    gguf = write_gguf(tmp_path / "m.gguf", tok, eos=tok.convert_tokens_to_ids("<|im_end|>"))
    entry = _cache_entry_for(gguf, tok)
    with pytest.raises(CacheCorruptError, match=f"{entry}.*EOS id"):
        load_model(gguf)
    assert "tokenizer_checked" not in json.loads((entry / "guarduq.json").read_text())
