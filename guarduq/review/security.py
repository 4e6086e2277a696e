"""Who may open the review page, and proof that a form was sent by it.

The page shows prompts and replies, so it follows ``guarduq serve``: with API keys, every request
carries one (HTTP Basic with the key as the password, which a browser asks for by itself, or a
Bearer header), compared in constant time against every key; without keys, only this machine
(loopback) is answered, and only under a loopback name: the request's Host header must be
``localhost`` or a loopback address too, else a DNS-rebinding page (``attacker.example`` made
to resolve to 127.0.0.1) could read and post from the reviewer's own browser. Forms carry a
double-submit CSRF token bound to a server secret: the same ``nonce.HMAC(secret, nonce)`` sits
in a SameSite=Strict, HttpOnly cookie and in a hidden field, so another site can neither read it
nor mint one that verifies. With API keys and no explicit secret, the secret is derived from the
keys (``csrf_secret_from_keys``), so replicas sharing keys accept each other's tokens.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guarduq._http import host_name, not_local  # noqa: F401 - host_name: its old import path
from guarduq.review.forms import PageError

CSRF_COOKIE = "guarduq_review_csrf"
REVIEWER_COOKIE = "guarduq_reviewer"
REALM = "guarduq review"
CSRF_KEY_LABEL = b"guarduq review csrf secret v1"
KEY_HINT = ("give reviewers keys to open it to others (guarduq review --api-key-env VAR; "
            "guarduq serve --api-key-env VAR --review-key-env VAR2)")  # domain separation for csrf_secret_from_keys

# Scripts and styles come from the page's own origin only (no inline code), so an answer that
# smuggled markup past the escaping still could not run; nothing may frame the page.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),  # prompts and replies stay out of caches; Back reloads
    (b"cross-origin-opener-policy", b"same-origin"),
]


@dataclass(frozen=True)
class Caller:
    """Who is asking: ``user`` is the HTTP Basic user name when one was given."""

    user: str | None = None


def authenticate(request: Request, api_keys: tuple[str, ...], *, allow_remote: bool) -> Caller:
    """The caller, or a 401 (keys configured, none valid) / 403 (no keys, and either the client
    is not loopback or the Host header does not name this machine)."""
    if not api_keys:
        if allow_remote:
            return Caller()
        why = not_local(request.client.host if request.client else None, request.headers.get("host"))
        if why == "client":
            raise PageError(403, "this review page has no key, so it answers this machine only "
                                 f"(loopback); {KEY_HINT}", code="loopback_only")
        if why == "host":
            shown = (request.headers.get("host") or "(none)")[:100]
            raise PageError(403, f"this review page has no key, so it answers this machine only, "
                                 f"under a loopback name; the request's Host {shown!r} is not one "
                                 "(a DNS-rebinding page looks like this): open it as "
                                 f"http://127.0.0.1:PORT/ or http://localhost:PORT/, or {KEY_HINT}",
                            code="loopback_host_only")
        return Caller()
    scheme, _, cred = request.headers.get("authorization", "").partition(" ")
    user, given = "", b""
    if scheme.lower() == "bearer":
        given = cred.strip().encode()
    elif scheme.lower() == "basic":
        try:
            user, _, password = base64.b64decode(cred.strip(), validate=True).decode("utf-8").partition(":")
            given = password.encode()
        except (binascii.Error, UnicodeDecodeError):
            user, given = "", b""
    ok = False
    for key in api_keys:  # every key is compared, in constant time each
        ok |= hmac.compare_digest(given, key.encode())
    if not ok:
        raise PageError(401, "a review key is needed: sign in with any user name (your reviewer name) "
                             "and the key as the password, or send Authorization: Bearer <key>",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'})
    return Caller(user=user.strip() or None)


def csrf_secret_from_keys(api_keys: tuple[str, ...]) -> bytes:
    """A CSRF secret every replica with the same keys computes alike: HMAC-SHA256 keyed with a
    fixed label over the sorted, distinct keys (each length-prefixed, so no two key sets give
    the same input). One-way: the secret does not reveal a key."""
    if not api_keys:
        raise ValueError("csrf_secret_from_keys needs at least one key")
    msg = b"".join(len(k).to_bytes(4, "big") + k for k in sorted({k.encode() for k in api_keys}))
    return hmac.new(CSRF_KEY_LABEL, msg, hashlib.sha256).digest()


class Csrf:
    """Double-submit tokens ``nonce.mac`` with mac = HMAC-SHA256(secret, nonce)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    def mint(self) -> str:
        nonce = secrets.token_urlsafe(24)
        return f"{nonce}.{self._mac(nonce)}"

    def valid(self, token: str | None) -> bool:
        if not token or len(token) > 200 or token.count(".") != 1:
            return False
        nonce, mac = token.split(".")
        return hmac.compare_digest(mac.encode(), self._mac(nonce).encode())

    def check(self, cookie: str | None, field: str | None) -> None:
        """A 403 unless the form's token equals the cookie's and both verify."""
        if not cookie or not field:
            raise PageError(403, "the form's security token is missing: reload the page and try again",
                            code="csrf_missing")
        if not (hmac.compare_digest(cookie.encode(), field.encode()) and self.valid(field)):
            raise PageError(403, "the form's security token does not match: reload the page and try again",
                            code="csrf_invalid")

    def _mac(self, nonce: str) -> str:
        return hmac.new(self._secret, nonce.encode(), hashlib.sha256).hexdigest()


def check_fetch_site(request: Request) -> None:
    """Refuse a form that the browser says came from another site (defence in depth)."""
    if request.headers.get("sec-fetch-site", "same-origin") == "cross-site":
        raise PageError(403, "forms from other sites are refused", code="cross_site")


class SecurityHeaders:
    """Adds the security headers to every response (plain ASGI, so errors get them too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []),
                                      *((k, v) for k, v in HEADERS if k not in have)]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def cookie_path(request: Request) -> str:
    """Cookies are scoped to the page's prefix (``/review`` inside ``guarduq serve``)."""
    return (request.scope.get("root_path") or "").rstrip("/") or "/"
