"""SVE's files: the per-model SVD cache and the member artifact (safetensors, written atomically)."""

from __future__ import annotations

import json
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
from guarduq.errors import ArtifactError, CacheCorruptError, FingerprintMismatchError
from guarduq.models import cache_root
from guarduq.sve.layers import SVELinear, _weight_as_linear

log = get_logger("sve")

FORMAT = "guarduq-sve"
FORMAT_VERSION = 2  # 2: the parametrisation is recorded; 1 (no record) is the raw one
READABLE_VERSIONS = ("1", "2")


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
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise ArtifactError(
            f"{path} has SVE format version {meta.get('format_version')}; this guarduq reads "
            f"{', '.join(READABLE_VERSIONS)}"
        )
    if "fingerprint" not in meta:
        raise ArtifactError(f"{path} has no base-model fingerprint")
    return meta, tensors


# --------------------------------------------------------------------------- member artifact


def parametrisation_of(meta: dict[str, str]) -> tuple[str, str]:
    """(parametrisation, bias mode) a file was saved with; version-1 files knew only the raw ones."""
    return meta.get("parametrisation", "raw"), meta.get("bias", "raw")


def member_tensors(layers: dict[str, SVELinear]) -> dict[str, torch.Tensor]:
    """``{layer}.{tensor}`` for every trained tensor (sigma/bias raw, delta/beta scale-free)."""
    return {f"{name}.{attr}": p.detach() for name, layer in layers.items() for attr, p in layer.named_parameters()}


def load_member_tensors(layers: dict[str, SVELinear], tensors: dict[str, torch.Tensor], path: Path) -> None:
    with torch.no_grad():
        for name, layer in layers.items():
            for attr, p in layer.named_parameters():
                t = tensors.get(f"{name}.{attr}")
                if t is None or t.shape != p.shape:
                    raise ArtifactError(f"{path}: {name}.{attr} is missing or has the wrong shape")
                p.copy_(t)


def check_compatible(
    meta: dict[str, str], path: Path, *, fingerprint: str, layers: list[str], members: int, kind: tuple[str, str]
) -> None:
    """Refuse a file saved for another model, other layers or members, or another parametrisation."""
    if meta.get("fingerprint") != fingerprint:
        raise FingerprintMismatchError(f"{path} belongs to model {meta.get('fingerprint')}, not {fingerprint}")
    if json.loads(meta.get("layers", "[]")) != layers or meta.get("members") != str(members):
        raise ArtifactError(f"{path} was saved for other SVE layers or member count")
    if parametrisation_of(meta) != kind:
        raise ArtifactError(
            f"{path} holds {'/'.join(parametrisation_of(meta))} members (parametrisation/bias), "
            f"this ensemble is {'/'.join(kind)}"
        )
