"""Small HTTP helpers shared by the two web faces (``serve`` and ``review``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any


def is_loopback(host: str | None) -> bool:
    """True for ``localhost`` and loopback addresses (IPv4 or IPv6, bracketed or not)."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def read_limited(request: Any, limit: int, too_large: Callable[[str], Exception]) -> bytes:
    """The request body, refused with ``too_large(message)`` as soon as it is known to exceed
    ``limit`` bytes (from its declared length, else while reading: a client may lie)."""
    message = f"the request body is larger than {limit} bytes"
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(message)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(message)
        chunks.append(chunk)
    return b"".join(chunks)
