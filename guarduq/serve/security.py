"""Who may call the server: one key per door, and this machine only without a key.

Each door has its own keys, compared in constant time against every key: API keys open
``/v1/*`` and ``/metrics``, admin keys ``/admin/*``, and review keys (``guarduq serve
--review-key-env``) the review page, which checks its own. A key opens no other door.

Without API keys, :class:`LoopbackOnly` (one middleware, so every route, the mounted review page
included) answers only a loopback client that addressed the server by a loopback name:
``localhost``, ``127.0.0.0/8`` or ``[::1]``, with any port. A page on ``attacker.example`` that
re-resolves its name to 127.0.0.1 (DNS rebinding) sends ``Host: attacker.example`` and is refused.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from guarduq._http import not_local
from guarduq.serve.context import error_response
from guarduq.serve.schema import ApiError


def bearer_key(request: Request, keys: tuple[str, ...]) -> str | None:
    """The one of ``keys`` the request's bearer token is (None: none of them)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    found = None
    for key in keys:  # every key is compared, in constant time each
        if hmac.compare_digest(given, key.encode()):
            found = key
    return found


def bearer_ok(request: Request, keys: tuple[str, ...]) -> bool:
    return bearer_key(request, keys) is not None


def authorize(request: Request, keys: tuple[str, ...], metrics: Any,
              names: Mapping[str, str] | None = None) -> str | None:
    """A 401 unless the request carries one of the API ``keys`` (none configured: open, and
    :class:`LoopbackOnly` keeps it to this machine). Returns the name ``names`` gives the key that
    opened (None: an unnamed key, or no keys)."""
    if not keys:
        return None
    key = bearer_key(request, keys)
    if key is None:
        metrics.rejected.labels("auth").inc()
        raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                       type="invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return (names or {}).get(key)


def authorize_admin(request: Request, keys: tuple[str, ...], metrics: Any) -> None:
    """403 when the server has no admin key at all; 401 for a missing or wrong one."""
    if not keys:
        raise ApiError(403, "admin endpoints are disabled (no --admin-key-env)", type="permission_error",
                       code="admin_disabled")
    if not bearer_ok(request, keys):
        metrics.rejected.labels("admin_auth").inc()
        raise ApiError(401, "missing or invalid admin key (Authorization: Bearer <admin key>)",
                       type="invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


class LoopbackOnly:
    """Refuses (403) any request not from this machine under a loopback name (plain ASGI)."""

    def __init__(self, app: ASGIApp, metrics: Any = None) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), None)
        why = not_local(client[0] if client else None, host)
        if why is None:
            await self.app(scope, receive, send)
            return
        if self.metrics is not None:
            self.metrics.rejected.labels("not_local").inc()
        if why == "client":
            exc = ApiError(403, "this server has no API key, so it answers this machine only (loopback); "
                                "start it with --api-key-env VAR to open it to others",
                           type="permission_error", code="loopback_only")
        else:
            exc = ApiError(403, f"this server has no API key, so it answers only requests addressed to a "
                                f"loopback name (localhost, 127.0.0.1, [::1]); Host {(host or '(none)')[:100]!r} "
                                "is not one (a DNS-rebinding page looks like this)",
                           type="permission_error", code="loopback_host_only")
        await error_response(exc)(scope, receive, send)
