"""Safe file writes: checks that a file can be written (made when a run starts rather than when a
request is half done), append-only lines, and whole files replaced atomically."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from guarduq.errors import StorageError

MIN_FREE_BYTES = 1 << 20  # less than this on the device counts as a full disk


def check_writable(path: str | os.PathLike[str], what: str) -> Path:
    """Raise ``StorageError`` unless ``path`` can be appended to (made if missing) on a disk with room.

    A file that did not exist is removed again, so a check leaves nothing behind.
    """
    path = Path(path)
    try:
        if b"\x00" in os.fsencode(path):
            raise ValueError("the path contains a NUL character")
    except ValueError as exc:  # also UnicodeEncodeError: a lone surrogate has no file-system name
        raise StorageError(f"cannot write {what} {str(path)!r}: {exc}") from None
    try:
        if path.is_dir():
            raise StorageError(f"cannot write {what} {path}: it is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.close(fd)
        if not existed:
            path.unlink()
        st = os.statvfs(path.parent)
    except OSError as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        raise StorageError(f"cannot write {what} {path}: no space left on the device")
    return path


def append_line(path: Path, line: bytes, what: str) -> None:
    """Append one line and fsync; on failure cut the file back, so no torn line is left."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
    try:
        start = os.fstat(fd).st_size
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):  # if even this fails, readers drop a torn last line
            os.ftruncate(fd, start)
        raise StorageError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so readers see the old file or the complete new one.

    A temporary file beside it is written and fsynced, made world-readable (mkstemp makes 0600;
    artifacts are meant to be shared) and renamed over ``path``; on failure it is removed.
    Raises ``OSError``: callers say what they were writing.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def private_file(path: Path) -> Path:
    """Make ``path`` (empty if missing) readable by its owner only (0600), its folder 0700:
    for files that hold prompt and reply text. An existing file keeps its content."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path
