"""``guarduq calibrate --dataset reviews --store URL``: the store's labelled reviews as a dataset.

What this module does is the CLI's part only: export the labels from the store to a file, and
read the store's counts. Which split gets which label, the weights and the size checks are
calibration's (``guarduq.calibration.reviews``).
"""

from __future__ import annotations

import hashlib
import io
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from guarduq._storage import private_file
from guarduq.calibration.reviews import REVIEWS
from guarduq.errors import InputError

__all__ = ["REVIEWS", "parse_since", "review_data_file", "review_progress"]


def review_data_file(store_url: str | None, since_text: str | None, runs_dir: str | os.PathLike[str]) -> Path:
    """The store's labelled reviews, exported once to ``WORK/reviews/`` (``--work``, default
    ``./runs``; named by content, so the scoring cache is reused while the labels are unchanged).
    The file holds prompt and reply text: it is written 0600 in a 0700 folder."""
    from guarduq.store import Store

    if not store_url:
        raise InputError("--dataset reviews reads reviewed replies from a store: give --store URL "
                         "(or --data a file exported from one)")
    since = parse_since(since_text)
    store = Store(store_url)
    try:
        buf = io.StringIO()
        n = store.export_jsonl(buf, since=since)
    finally:
        store.close()
    if n == 0:
        when = f" since {since.isoformat()}" if since else ""
        raise InputError(
            f"the store holds no reviewed replies labelled right or wrong{when} (with their text: "
            "the policy must set review.keep_text); label some with `guarduq review --store URL`"
        )
    text = buf.getvalue().encode()
    path = Path(runs_dir) / REVIEWS / f"reviews-{hashlib.sha256(text).hexdigest()[:16]}.jsonl"
    private_file(path)  # prompt and reply text: owner only (0600, in a 0700 folder)
    if path.stat().st_size != len(text):
        tmp = private_file(path.with_suffix(f".tmp{os.getpid()}"))
        tmp.write_bytes(text)
        os.replace(tmp, path)
    return path


def review_progress(store_url: str | None) -> dict[str, Any] | None:
    """The store's review counts (``Store.progress()``): how many were sampled, so calibration
    knows the labelled share of each stratum. None without a store (an exported ``--data`` file)."""
    if not store_url:
        return None
    from guarduq.store import Store

    store = Store(store_url)
    try:
        return store.progress()
    finally:
        store.close()


def parse_since(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InputError(f"--since takes an ISO 8601 date or time (2026-12-01, 2026-12-01T09:00), got {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)
