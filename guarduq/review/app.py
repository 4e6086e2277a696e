"""The review page: a queue of sampled replies, an item page to label them, and the export.

``create_review_app(store, ReviewPageSettings(...))`` builds a FastAPI app with server-rendered Jinja
templates (autoescaped; no JavaScript build step, and the page works without JavaScript: one
small static script adds the keyboard). ``guarduq review`` runs it alone on a store;
``mount_review`` puts it under ``/review`` inside another app (``guarduq serve --review``).

Security follows ``guarduq serve`` (see ``security``): a review key on every request (never an
API key: ``guarduq serve --review-key-env``), or loopback clients under a loopback Host only
without one; a CSRF token on every form; security headers on
every response. A reply whose text was not kept cannot be labelled (no calibration could use it).
Errors are an HTML page for a browser and serve's JSON shape
``{"error": {"message", "type", "param", "code"}}`` otherwise; bad input is a 4xx, never a 500.
The routes live by what they serve: ``pages.py`` (queue, item, static files), ``labels.py``
(label, reviewer name, export); ``context.py`` renders them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from guarduq._logging import get_logger
from guarduq.calibration.splits import THRESHOLD_FRACTION
from guarduq.errors import InputError, StoreError, StoreInputError, UnknownItemError
from guarduq.review.context import Page, templates
from guarduq.review.forms import PageError, reviewer_name
from guarduq.review.labels import add_label_routes
from guarduq.review.pages import NOT_KEPT, add_page_routes, text_kept
from guarduq.review.security import Csrf, SecurityHeaders, authenticate, csrf_secret_from_keys

__all__ = ["NOT_KEPT", "ReviewPageSettings", "ReviewStore", "create_review_app", "mount_review", "text_kept"]

log = get_logger("review")


@dataclass(frozen=True)
class ReviewPageSettings:
    """Switches of one review page. ``alpha``/``delta``: the target the progress line counts
    towards (the policy's α; None: no count). ``threshold_fraction``: the share of labels that
    ``guarduq calibrate`` puts in its threshold split (its ``--threshold-fraction``)."""

    api_keys: tuple[str, ...] = ()
    alpha: float | None = None
    delta: float = 0.1
    threshold_fraction: float = THRESHOLD_FRACTION
    reviewer_default: str = "reviewer"
    allow_unauthenticated_remote: bool = False  # answer non-loopback clients without a key
    page_size: int = 50
    max_body_bytes: int = 200_000
    # None: derived from api_keys when there are keys (replicas sharing keys accept each other's
    # tokens), else random per app (loopback, one process: tokens die with it)
    csrf_secret: bytes | None = None

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0 < self.alpha < 1:
            raise InputError(f"alpha must be in (0, 1), got {self.alpha}")
        if not 0 < self.delta < 1:
            raise InputError(f"delta must be in (0, 1), got {self.delta}")
        if not 0 < self.threshold_fraction < 1:
            raise InputError(f"threshold_fraction must be in (0, 1), got {self.threshold_fraction}")
        if self.csrf_secret is not None and len(self.csrf_secret) < 16:
            raise InputError("csrf_secret must be at least 16 bytes")
        if not 1 <= self.page_size <= 500:
            raise InputError(f"page_size must be 1 to 500, got {self.page_size}")
        try:
            reviewer_name(self.reviewer_default)
        except ValueError as exc:
            raise InputError(f"reviewer_default: {exc}") from None


class ReviewStore(Protocol):
    """What the page needs of ``guarduq.store.Store``."""

    def item(self, request_id: str) -> Any: ...
    def add_label(self, request_id: str, *, reviewer: str, label: str, note: str | None = None,
                  corrected: str | None = None) -> Any: ...
    def queue(self, **kw: Any) -> list[Any]: ...
    def count(self, **kw: Any) -> int: ...
    def next_unlabelled(self, after: str | None = None, **kw: Any) -> str | None: ...
    def progress(self, group: str | None = None) -> dict[str, Any]: ...
    def groups(self) -> dict[str, int]: ...
    def export_jsonl(self, out: Any, *, since: Any = None) -> int: ...


def create_review_app(store: ReviewStore, settings: ReviewPageSettings | None = None, *,
                      alpha_of: Callable[[], float | None] | None = None,
                      fraction_of: Callable[[], float] | None = None) -> FastAPI:
    """The review page over ``store`` (which the caller owns and closes). ``alpha_of`` and
    ``fraction_of``: asked for the α and the threshold fraction on every page instead of
    ``settings.alpha`` / ``settings.threshold_fraction`` (a server that hot-reloads its policy
    passes ``lambda: guard.policy.alpha`` and the policy's ``review.threshold_fraction``)."""
    s = settings or ReviewPageSettings()
    csrf = Csrf(s.csrf_secret if s.csrf_secret is not None
                else csrf_secret_from_keys(s.api_keys) if s.api_keys else None)
    page = Page(store, s, csrf, templates(), alpha_of, fraction_of)

    def auth(request: Request) -> None:
        request.state.caller = authenticate(request, s.api_keys, allow_remote=s.allow_unauthenticated_remote)

    app = FastAPI(title="guarduq review", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(auth)])
    app.add_middleware(SecurityHeaders)
    app.state.store, app.state.settings = store, s
    _add_error_handlers(app, page)
    add_page_routes(app, page)
    add_label_routes(app, page)
    return app


def _add_error_handlers(app: FastAPI, page: Page) -> None:
    """An HTML page for browsers, serve's JSON shape for everyone else; never a 500 for bad input."""

    @app.exception_handler(PageError)
    async def _page_error(request: Request, exc: PageError) -> Response:
        return page.error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return page.error(request, PageError(400, str(exc.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = "no such page" if exc.status_code == 404 else str(exc.detail)
        return page.error(request, PageError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> Response:
        if isinstance(exc, UnknownItemError):
            return page.error(request, PageError(404, "no such review item in this store",
                                                 param="request_id", code="not_found"))
        if isinstance(exc, StoreInputError):
            return page.error(request, PageError(400, str(exc)[:300], code="invalid_value"))
        log.error("review_store_error", path=request.url.path, error=str(exc)[:300])
        return page.error(request, PageError(503, "the store is unavailable (logged on the server); "
                                                  "try again shortly", code="store_unavailable"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("review_unexpected_error", path=request.url.path, error=type(exc).__name__)
        return page.error(request, PageError(500, "internal error (logged on the server)"))


def mount_review(app: FastAPI, store: ReviewStore, settings: ReviewPageSettings | None = None,
                 prefix: str = "/review", *, alpha_of: Callable[[], float | None] | None = None,
                 fraction_of: Callable[[], float] | None = None) -> FastAPI:
    """Mount the review page under ``prefix`` in ``app`` (e.g. the serve app); returns it."""
    if not prefix.startswith("/") or prefix.endswith("/") or len(prefix) < 2:
        raise InputError(f"prefix must look like '/review', got {prefix!r}")
    review = create_review_app(store, settings, alpha_of=alpha_of, fraction_of=fraction_of)
    app.mount(prefix, review)
    return review
