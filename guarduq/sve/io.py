"""SVE's files: the per-model SVD cache and the member artifact (safetensors, written atomically)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from guarduq._logging import get_logger
from guarduq.errors import ArtifactError, CacheCorruptError
from guarduq.models import cache_root
from guarduq.sve.layers import _weight_as_linear

log = get_logger("sve")

FORMAT = "guarduq-sve"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- SVD cache


def _svd_cache_path(fp: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else cache_root() / "sve"
    return base / f"{fp}.safetensors"


def _load_svd_cache(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        return {}
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on bad bytes
        raise CacheCorruptError(
            f"SVD cache {path} is unreadable ({exc}); delete it to recompute"
        ) from exc


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file so readers see the old file or the complete new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _svds(
    modules: dict[str, nn.Module], fp: str, cache_dir: str | os.PathLike[str] | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(U, S, V) per module name; computed in float64 once per model fingerprint, then cached."""
    path = _svd_cache_path(fp, cache_dir)
    cached = _load_svd_cache(path)
    missing = [n for n in modules if f"{n}.S" not in cached]
    if missing:
        t0 = time.perf_counter()
        for name in tqdm(missing, desc="SVD", unit="matrix", disable=len(missing) < 8):
            u, s, vh = torch.linalg.svd(_weight_as_linear(modules[name]).double(), full_matrices=False)
            cached[f"{name}.U"], cached[f"{name}.S"], cached[f"{name}.V"] = (
                u.float(), s.float(), vh.T.float()
            )
        try:
            _atomic_save(cached, path, {"format": "guarduq-sve-svd", "fingerprint": fp})
        except OSError as exc:  # a read-only cache only costs time next run
            log.warning("svd_cache_write_failed", path=str(path), error=str(exc))
        log.info("svd_computed", n=len(missing), seconds=round(time.perf_counter() - t0, 2), path=str(path))
    out = {}
    for name, module in modules.items():
        u, s, v = cached[f"{name}.U"], cached[f"{name}.S"], cached[f"{name}.V"]
        w = _weight_as_linear(module)
        if u.shape[0] != w.shape[0] or v.shape[0] != w.shape[1]:
            raise CacheCorruptError(f"SVD cache {path} does not match layer {name}; delete it to recompute")
        dtype = w.dtype
        out[name] = (u.to(dtype), s.to(dtype), v.to(dtype))
    return out


def _read_artifact(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    if not path.is_file():
        raise ArtifactError(f"SVE file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on bad bytes
        raise ArtifactError(f"{path} is not a readable safetensors file: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a guarduq SVE file (format {meta.get('format')!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise ArtifactError(
            f"{path} has SVE format version {meta.get('format_version')}; this guarduq reads {FORMAT_VERSION}"
        )
    if "fingerprint" not in meta:
        raise ArtifactError(f"{path} has no base-model fingerprint")
    return meta, tensors
