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


def host_name(header: str | None) -> str | None:
    """The host of a Host header, lower-cased, without its port, brackets or a trailing dot
    (``[::1]:8100`` -> ``::1``, ``LocalHost.:80`` -> ``localhost``); None when malformed."""
    if not header:
        return None
    h = header.strip().lower()
    if h.startswith("["):  # an IPv6 literal: [addr] or [addr]:port
        end = h.find("]")
        rest = h[end + 1:] if end > 0 else "?"
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return h[1:end]
    if h.count(":") > 1:  # a bare IPv6 address: no port can be told apart
        return h
    name, sep, port = h.partition(":")
    if sep and not port.isdigit():
        return None
    name = name[:-1] if name.endswith(".") else name
    return name or None


def not_local(client: str | None, host_header: str | None) -> str | None:
    """Why a request is not from this machine under a loopback name: ``"client"`` (the peer is
    not loopback), ``"host"`` (its Host header names no loopback host: a DNS-rebinding page,
    ``attacker.example`` made to resolve to 127.0.0.1, looks like this), or None (it is)."""
    if not is_loopback(client):
        return "client"
    name = host_name(host_header)
    return None if name is not None and is_loopback(name) else "host"


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
