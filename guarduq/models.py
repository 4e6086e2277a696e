"""Load a causal LM from an alias, a local folder, a hub id or a GGUF file; fingerprint it.

GGUF files are dequantized by transformers (~15-30 s on CPU), so the result is cached as
safetensors + tokenizer files under ``$XDG_CACHE_HOME/guarduq/models/<gguf sha256>``. Writes go to a
temporary folder renamed into place, so an interrupted first load never leaves a half cache.

The fingerprint names *the weights*, not the path they came from: the same weights loaded from a
GGUF, from the cache or from a saved folder give the same fingerprint. Calibrators and SVE members
are bound to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from guarduq._logging import get_logger
from guarduq._storage import write_atomic
from guarduq.aliases import ALIASES, DEFAULT_MODEL, cache_root, resolve_alias  # noqa: F401  (re-exported)
from guarduq.errors import CacheCorruptError, InputError, ModelLoadError, ModelNotFoundError

log = get_logger("models")

MIN_TRANSFORMERS = "5.23"  # first release reading both shipped GGUF tokenizers right; pyproject pins it
_CACHE_FORMAT = 1


# Config keys that describe the architecture. Volatile keys (paths, dtype, library versions)
# are left out so that one set of weights has one fingerprint however it was loaded.
_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "n_embd",
    "intermediate_size",
    "n_inner",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "n_positions",
    "rope_theta",
    "rms_norm_eps",
    "layer_norm_epsilon",
    "hidden_act",
    "activation_function",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class ModelInfo:
    """What callers and artifacts need to know about a loaded model."""

    name: str
    fingerprint: str
    source: str
    n_params: int


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    info: ModelInfo


_FINGERPRINTS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def fingerprint(model: nn.Module) -> str:
    """Stable hex digest of the architecture config plus the weights (computed once per object).

    Tied parameters are hashed once (``named_parameters`` de-duplicates them). Weights are hashed
    as float32 so a fp32 copy of the same weights matches.
    """
    cached = _FINGERPRINTS.get(model)
    if cached is not None:
        return cached
    config = getattr(model, "config", None)
    cfg = config.to_dict() if config is not None else {}
    arch = {k: cfg[k] for k in _ARCH_KEYS if k in cfg}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    digest = h.hexdigest()[:32]
    _FINGERPRINTS[model] = digest
    return digest


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """float32 (default), bfloat16 or float16, by ``torch.dtype`` or name ("bf16", "float16", ...)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.strip().lower().removeprefix("torch.")]
    raise InputError(f"unknown dtype {dtype!r}; use float32, bfloat16 (bf16) or float16 (fp16)")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """"cpu" (default), "cuda" or "cuda:N" (or a ``torch.device``), checked against the machine."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(str(device).strip())
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InputError(f"unsupported device {device!r}; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise InputError(f"device {device!r} asked for, but torch sees no CUDA GPU on this machine")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InputError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX). Without it torch emulates
    bf16 matrix products, measured 20-60x slower than fp32 on an AVX2-only EPYC
    (docs/results/scale/), so bf16 saves memory there but never time."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def place_model(model: nn.Module, device: str | torch.device | None, dtype: str | torch.dtype | None) -> None:
    """Move/cast ``model`` in place. Fingerprint it first: the fingerprint names the fp32 weights."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    if dev.type == "cpu" and dt == torch.bfloat16 and not native_bf16():
        log.warning("bf16_emulated", hint="this CPU has no native bf16 (AVX512-BF16/AMX): expect scoring "
                    "many times slower than float32; bf16 only saves memory here")
    fingerprint(model)  # cached per object, so casting afterwards keeps the weights' name
    try:
        model.to(device=dev)
        with torch.no_grad():  # parameters only: float buffers (e.g. RoPE frequencies) stay fp32
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != dt:
                    p.data = p.data.to(dt)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        raise ModelLoadError(f"cannot place the model on {dev} as {dt}: {_first_line(exc)}") from exc


def load_model(
    spec: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    use_cache: bool = True,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """Load ``spec`` in eval mode: an alias, a ``.gguf`` path, a local HF folder or a hub id.

    Weights load in float32 on the CPU and are fingerprinted there, then moved to ``device``
    ("cpu", "cuda", "cuda:N") and cast to ``dtype`` (float32, bfloat16/"bf16", float16/"fp16"):
    the same weights have one fingerprint whatever the device and dtype.
    """
    resolve_device(device), resolve_dtype(dtype)  # bad values fail before the slow part
    if not isinstance(spec, str | os.PathLike) or not str(spec).strip():
        raise InputError(f"model spec must be a non-empty string or path, got {spec!r}")
    text = str(spec).strip()
    t0 = time.perf_counter()
    if text in ALIASES:
        chunks = ALIASES[text].chunks
        model, tok = _load_gguf(resolve_alias(text), use_cache, chunks.sha256 if chunks else None)
        name, source = text, text
    elif text.lower().endswith(".gguf"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        model, tok = _load_gguf(path, use_cache)
        name, source = path.stem, str(path.resolve())  # absolute: a calibrator finds it again from anywhere
    elif Path(text).expanduser().is_dir():
        path = Path(text).expanduser()
        model, tok = _load_pretrained(path, local_only=True)
        name, source = path.name, str(path.resolve())
    elif _looks_like_hub_id(text):
        model, tok = _load_hub(text)
        name, source = text, text  # a hub id loads again as itself
    else:
        known = ", ".join(sorted(ALIASES))
        raise ModelNotFoundError(
            f"unknown model spec '{text}': not an alias ({known}), a .gguf file, a folder or a hub id"
        )
    model.eval()
    info = ModelInfo(
        name=name,
        fingerprint=fingerprint(model),
        source=source,
        n_params=sum(p.numel() for p in model.parameters()),
    )
    place_model(model, device, dtype)
    log.info("model_loaded", model=name, fingerprint=info.fingerprint, seconds=round(time.perf_counter() - t0, 2))
    return LoadedModel(model=model, tokenizer=tok, info=info)


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _load_pretrained(path: Path | str, *, local_only: bool) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=local_only
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path}: {_first_line(exc)}") from exc
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"model at {path} is unreadable: {_first_line(exc)}") from exc
    return model, tok


def _load_hub(hub_id: str) -> tuple[nn.Module, Any]:
    """A hub id loads from the local HF cache first; online only where the user has a network."""
    try:
        return _load_pretrained(hub_id, local_only=True)
    except ModelLoadError:
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelNotFoundError(f"hub model '{hub_id}' is not in the local HF cache (HF_HUB_OFFLINE=1)")
    try:
        return _load_pretrained(hub_id, local_only=False)
    except ModelLoadError as exc:
        raise ModelNotFoundError(f"hub model '{hub_id}' could not be found or downloaded: {exc}") from exc


def _load_gguf(path: Path, use_cache: bool, expect_sha256: str | None = None) -> tuple[nn.Module, Any]:
    digest = sha256_file(path)
    if expect_sha256 is not None and digest != expect_sha256:
        raise ModelLoadError(
            f"{path} has sha256 {digest}, expected {expect_sha256}: refusing it; delete the file "
            "and provision the model again"
        )
    entry = cache_root() / "models" / digest[:32]
    if use_cache and entry.is_dir():
        return _load_cache_entry(entry)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("gguf_dequantize", path=str(path), note="first load only; cached afterwards")
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    except Exception as exc:  # gguf raises bare ValueError/struct.error/IndexError on bad bytes
        raise ModelLoadError(f"corrupt or unsupported GGUF file {path}: {_first_line(exc)}") from exc
    check_gguf_tokenizer(tok, gguf_tokenizer_facts(path), path)
    _forget_gguf_quantization(model)
    if use_cache:
        _write_cache_entry(entry, model, tok, {"gguf": str(path), "gguf_sha256": digest, "tokenizer_checked": True})
    return model, tok


@dataclass(frozen=True)
class GGUFTokenizerFacts:
    """What a GGUF file itself says about its tokenizer (llama.cpp's reference reading)."""

    eos_id: int | None
    bos_id: int | None
    add_bos: bool | None
    words: tuple[tuple[int, str], ...]  # (id, token) of whole-word vocabulary entries, a fixed sample


def gguf_tokenizer_facts(path: Path, n_words: int = 32) -> GGUFTokenizerFacts:
    """Read the tokenizer metadata of a GGUF file (no tensors are read)."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
    except Exception as exc:  # same bare errors as the loader on bad bytes
        raise ModelLoadError(f"corrupt or unsupported GGUF file {path}: {_first_line(exc)}") from exc

    def value(key: str) -> Any:
        field = fields.get(key)
        if field is None:
            return None
        return field.contents()  # gguf >= 0.16

    tokens = value("tokenizer.ggml.tokens") or []
    prefix = "Ġ" if value("tokenizer.ggml.model") == "gpt2" else "▁"
    words = [(i, t) for i, t in enumerate(tokens)
             if t.startswith(prefix) and t[1:].isascii() and t[1:].isalpha() and len(t) >= 6]
    step = max(1, len(words) // n_words)
    return GGUFTokenizerFacts(
        eos_id=value("tokenizer.ggml.eos_token_id"),
        bos_id=value("tokenizer.ggml.bos_token_id"),
        add_bos=value("tokenizer.ggml.add_bos_token"),
        words=tuple(words[::step][:n_words]),
    )


def check_gguf_tokenizer(tok: Any, facts: GGUFTokenizerFacts, path: Path | str) -> None:
    """Refuse a tokenizer that transformers read from a GGUF file differently from the file.

    Why: the GGUF tokenizer converter differs between transformers releases, and a wrong reading
    is silent. Seen with transformers 5.17: SmolLM2's EOS became ``<|im_start|>`` (so replies
    ran past their end and every score appended the wrong end token), and Gemma-3 lost its BOS
    and split words into many pieces. Three checks catch both: EOS and BOS ids as the file
    states them; a BOS first when the file says to add one; and whole-word vocabulary entries
    (``Ġword``/``▁word``) encoding back to their single id (at least 90% of a fixed sample: a
    tokenizer that lost its merges fails nearly all).
    """
    import transformers

    problems = []
    if facts.eos_id is not None and tok.eos_token_id != facts.eos_id:
        problems.append(f"EOS id {tok.eos_token_id} where the file says {facts.eos_id}")
    if facts.bos_id is not None and facts.add_bos and tok.bos_token_id != facts.bos_id:
        problems.append(f"BOS id {tok.bos_token_id} where the file says {facts.bos_id}")
    if facts.add_bos and facts.bos_id is not None:
        first = tok("a", add_special_tokens=True)["input_ids"][:1]
        if first != [facts.bos_id]:
            problems.append("no BOS token at the start, though the file says to add one")
    if facts.words:
        wrong = [t for i, t in facts.words
                 if tok(tok.convert_tokens_to_string([t]), add_special_tokens=False)["input_ids"] != [i]]
        if len(wrong) > 0.1 * len(facts.words):
            problems.append(f"{len(wrong)} of {len(facts.words)} vocabulary words do not encode to "
                            f"their own id (e.g. {wrong[0]!r})")
    if problems:
        raise ModelLoadError(
            f"transformers {transformers.__version__} reads the tokenizer of {path} differently from "
            f"the file: {'; '.join(problems)}. Scores would be silently wrong; install "
            f"transformers>={MIN_TRANSFORMERS}"
        )


def _forget_gguf_quantization(model: nn.Module) -> None:
    """The weights are already dequantized to fp32: drop the GGUF marker so the model is a plain
    fp32 model (serializable, and identical to one loaded from the cached safetensors)."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _write_cache_entry(entry: Path, model: nn.Module, tok: Any, meta: dict[str, Any]) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        meta = {**meta, "format": _CACHE_FORMAT, "fingerprint": fingerprint(model)}
        (tmp / "guarduq.json").write_text(json.dumps(meta, indent=2))
        os.replace(tmp, entry)  # atomic: readers see no entry or a complete one
    except OSError as exc:
        log.warning("model_cache_write_failed", entry=str(entry), error=str(exc))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_cache_entry(entry: Path) -> tuple[nn.Module, Any]:
    meta_path = entry / "guarduq.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != _CACHE_FORMAT:
            raise ValueError(f"cache format {meta.get('format')!r} != {_CACHE_FORMAT}")
        model, tok = _load_pretrained(entry, local_only=True)
    except (OSError, ValueError, ModelLoadError) as exc:
        raise CacheCorruptError(
            f"model cache entry {entry} is corrupt ({_first_line(exc)}); delete that folder and "
            "load again to rebuild it"
        ) from exc
    if not meta.get("tokenizer_checked"):
        _check_cached_tokenizer(entry, meta, tok)
    return model, tok


def _check_cached_tokenizer(entry: Path, meta: dict[str, Any], tok: Any) -> None:
    """Entries written before the tokenizer check: check once against their GGUF, then mark."""
    gguf = Path(str(meta.get("gguf", "")))
    if not gguf.is_file():
        log.warning("model_cache_tokenizer_unchecked", entry=str(entry), reason="its GGUF file is gone")
        return
    try:
        check_gguf_tokenizer(tok, gguf_tokenizer_facts(gguf), gguf)
    except ModelLoadError as exc:
        raise CacheCorruptError(f"model cache entry {entry}: {exc}; delete that folder and load again") from exc
    try:
        write_atomic(entry / "guarduq.json", json.dumps({**meta, "tokenizer_checked": True}, indent=2).encode())
    except OSError as exc:  # a read-only cache still loads; the check simply runs again next time
        log.warning("model_cache_write_failed", entry=str(entry), error=str(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
