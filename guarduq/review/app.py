"""The review page: a queue of sampled replies, an item page to label them, and the export.

``create_review_app(store, ReviewPageSettings(...))`` builds a FastAPI app with server-rendered Jinja
templates (autoescaped; no JavaScript build step, and the page works without JavaScript: one
small static script adds the keyboard). ``guarduq review`` runs it alone on a store;
``mount_review`` puts it under ``/review`` inside another app (``guarduq serve --review``).

Security follows ``guarduq serve`` (see ``security``): an API key on every request, or loopback
clients under a loopback Host only without one; a CSRF token on every form; security headers on
every response. A reply whose text was not kept cannot be labelled (no calibration could use it).
Errors are an HTML page for a browser and serve's JSON shape
``{"error": {"message", "type", "param", "code"}}`` otherwise; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, unquote

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from guarduq._http import read_limited
from guarduq._logging import get_logger
from guarduq.errors import InputError, StoreError, StoreInputError, UnknownItemError
from guarduq.review import views
from guarduq.review.forms import (
    ExportQuery,
    Filters,
    ItemPage,
    LabelForm,
    PageError,
    QueuePage,
    ReviewerForm,
    check_request_id,
    parse_form,
    reviewer_name,
    validated,
)
from guarduq.review.progress import Progress, progress
from guarduq.review.security import (
    CSRF_COOKIE,
    REVIEWER_COOKIE,
    Caller,
    Csrf,
    SecurityHeaders,
    authenticate,
    check_fetch_site,
    cookie_path,
    csrf_secret_from_keys,
)

log = get_logger("review")

_HERE = Path(__file__).parent
_STATIC = {"review.css": "text/css; charset=utf-8", "review.js": "text/javascript; charset=utf-8"}


@dataclass(frozen=True)
class ReviewPageSettings:
    """Switches of one review page. ``alpha``/``delta``: the target the progress line counts
    towards (the policy's α; None: no count). ``threshold_fraction``: the share of labels that
    ``guarduq calibrate`` puts in its threshold split (its ``--threshold-fraction``)."""

    api_keys: tuple[str, ...] = ()
    alpha: float | None = None
    delta: float = 0.1
    threshold_fraction: float = 0.3
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
                      alpha_of: Callable[[], float | None] | None = None) -> FastAPI:
    """The review page over ``store`` (which the caller owns and closes). ``alpha_of``: asked for
    the current α on every page instead of ``settings.alpha`` (a server that hot-reloads its
    policy passes ``lambda: guard.policy.alpha``)."""
    s = settings or ReviewPageSettings()
    csrf = Csrf(s.csrf_secret if s.csrf_secret is not None
                else csrf_secret_from_keys(s.api_keys) if s.api_keys else None)
    env = Environment(loader=FileSystemLoader(_HERE / "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.globals.update(fmt=views.fmt, when=views.when, quote=lambda v: quote(str(v), safe=""))
    static = {name: (_HERE / "static" / name).read_bytes() for name in _STATIC}

    def auth(request: Request) -> None:
        request.state.caller = authenticate(request, s.api_keys, allow_remote=s.allow_unauthenticated_remote)

    app = FastAPI(title="guarduq review", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(auth)])
    app.add_middleware(SecurityHeaders)
    app.state.store, app.state.settings = store, s

    # -- errors: an HTML page for browsers, serve's JSON shape for everyone else

    def error_response(request: Request, exc: PageError) -> Response:
        if "text/html" in request.headers.get("accept", ""):
            html = env.get_template("error.html").render(base=_base(request), status=exc.status,
                                                         message=exc.message)
            return HTMLResponse(html, status_code=exc.status, headers=exc.headers)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(PageError)
    async def _page_error(request: Request, exc: PageError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request, PageError(400, str(exc.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = "no such page" if exc.status_code == 404 else str(exc.detail)
        return error_response(request, PageError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> Response:
        if isinstance(exc, UnknownItemError):
            return error_response(request, PageError(404, "no such review item in this store",
                                                     param="request_id", code="not_found"))
        if isinstance(exc, StoreInputError):
            return error_response(request, PageError(400, str(exc)[:300], code="invalid_value"))
        log.error("review_store_error", path=request.url.path, error=str(exc)[:300])
        return error_response(request, PageError(503, "the store is unavailable (logged on the server); "
                                                      "try again shortly", code="store_unavailable"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("review_unexpected_error", path=request.url.path, error=type(exc).__name__)
        return error_response(request, PageError(500, "internal error (logged on the server)"))

    # -- rendering

    def reviewer(request: Request) -> str:
        caller: Caller = request.state.caller
        if caller.user:
            try:
                return reviewer_name(caller.user)
            except ValueError:
                pass
        try:
            return reviewer_name(unquote(request.cookies.get(REVIEWER_COOKIE) or ""))
        except ValueError:
            return s.reviewer_default

    def page(request: Request, template: str, *, title: str, **ctx: Any) -> HTMLResponse:
        token = request.cookies.get(CSRF_COOKIE)
        fresh = not csrf.valid(token)
        if fresh:
            token = csrf.mint()
        html = env.get_template(template).render(
            base=_base(request), csrf=token, reviewer=reviewer(request), title=title,
            progress=current_progress(getattr(ctx.get("q"), "group", None)),
            named_by_login=bool(request.state.caller.user), **ctx)
        resp = HTMLResponse(html)
        if fresh:
            resp.set_cookie(CSRF_COOKIE, str(token), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path=cookie_path(request))
        return resp

    def current_progress(group: str | None = None) -> Progress:
        """The progress line, of one traffic group's labels when the queue is filtered by group
        (each group's own certificate counts its own uniform labels)."""
        alpha = alpha_of() if alpha_of is not None else s.alpha
        if alpha is not None and not 0 < alpha < 1:
            alpha = None
        counts = store.progress(group=group) if group is not None else store.progress()
        return progress(counts, alpha=alpha, delta=s.delta, threshold_fraction=s.threshold_fraction)

    # -- pages

    @app.get("/")
    def queue_page(request: Request) -> HTMLResponse:
        q: QueuePage = validated(QueuePage, dict(request.query_params))
        filters = q.store_filters()
        total = store.count(**filters)
        pages = max(1, math.ceil(total / s.page_size))
        rows = store.queue(**filters, unlabelled_first=q.unlabelled_first, limit=s.page_size,
                           offset=(q.page - 1) * s.page_size)
        return page(request, "queue.html", title="Review queue", q=q, rows=rows, total=total,
                    pages=pages, item_query=q.query(), groups=store.groups())

    @app.get("/items/{request_id}")
    def item_page(request: Request, request_id: str) -> HTMLResponse:
        check_request_id(request_id)
        q: ItemPage = validated(ItemPage, dict(request.query_params))
        item = store.item(request_id)
        if item is None:
            raise PageError(404, f"no review item {request_id[:80]!r} in this store", param="request_id",
                            code="not_found")
        nxt = store.next_unlabelled(after=request_id, **q.next_filters())
        reply = item.reply
        return page(request, "item.html", title=f"Item {request_id[:12]}", item=item, reply=reply,
                    q=q, filters=q.carried(), labellable=_text_kept(reply), not_kept=NOT_KEPT,
                    messages=views.conversation(reply.prompt), tokens=views.answer_tokens(reply),
                    scores=views.score_rows(reply.scores),
                    opinion=views.opinion_rows(reply.second_opinion), next_id=nxt,
                    labels=list(reversed(item.labels)))

    @app.post("/items/{request_id}/label")
    async def label(request: Request, request_id: str) -> RedirectResponse:
        check_request_id(request_id)
        data = await _form(request, s.max_body_bytes)
        csrf.check(request.cookies.get(CSRF_COOKIE), data.get("csrf"))
        form: LabelForm = validated(LabelForm, data)
        item = await run_in_threadpool(lambda: store.item(request_id))
        if item is None:
            raise PageError(404, f"no review item {request_id[:80]!r} in this store", param="request_id",
                            code="not_found")
        if not _text_kept(item.reply):
            raise PageError(409, NOT_KEPT + "; no label was stored", param="request_id", code="text_not_kept")
        who = reviewer(request)
        await run_in_threadpool(lambda: store.add_label(request_id, reviewer=who, label=form.label,
                                                        note=form.note, corrected=form.corrected))
        log.info("review_label", request_id=request_id, reviewer=who, label=form.label)
        nxt = await run_in_threadpool(lambda: store.next_unlabelled(after=request_id, **form.next_filters()))
        base = _base(request)
        if nxt is None:
            return RedirectResponse(f"{base}/{_query(form, done='true')}", status_code=303)
        return RedirectResponse(f"{base}/items/{quote(nxt, safe='')}{_query(form, prev=request_id)}",
                                status_code=303)

    @app.post("/reviewer")
    async def set_reviewer(request: Request) -> RedirectResponse:
        data = await _form(request, s.max_body_bytes)
        csrf.check(request.cookies.get(CSRF_COOKIE), data.get("csrf"))
        form: ReviewerForm = validated(ReviewerForm, data)
        resp = RedirectResponse(f"{_base(request)}/", status_code=303)
        resp.set_cookie(REVIEWER_COOKIE, quote(form.reviewer, safe=""), httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path=cookie_path(request),
                        max_age=365 * 86400)
        return resp

    @app.get("/export.jsonl")
    def export(request: Request) -> Response:
        q: ExportQuery = validated(ExportQuery, dict(request.query_params))
        buf = io.StringIO()
        n = store.export_jsonl(buf, since=q.since)
        log.info("review_export", rows=n)
        return Response(buf.getvalue().encode("utf-8"), media_type="application/jsonl",
                        headers={"Content-Disposition": 'attachment; filename="guarduq-labels.jsonl"',
                                 "X-Guarduq-Rows": str(n)})

    @app.get("/static/{name}")
    def static_file(name: str) -> Response:
        if name not in static:
            raise PageError(404, "no such file")
        # the only responses a browser may keep (for an hour): code and style, no reviewed text
        return Response(static[name], media_type=_STATIC[name],
                        headers={"Cache-Control": "private, max-age=3600"})

    return app


def mount_review(app: FastAPI, store: ReviewStore, settings: ReviewPageSettings | None = None,
                 prefix: str = "/review", *, alpha_of: Callable[[], float | None] | None = None) -> FastAPI:
    """Mount the review page under ``prefix`` in ``app`` (e.g. the serve app); returns it."""
    if not prefix.startswith("/") or prefix.endswith("/") or len(prefix) < 2:
        raise InputError(f"prefix must look like '/review', got {prefix!r}")
    review = create_review_app(store, settings, alpha_of=alpha_of)
    app.mount(prefix, review)
    return review


NOT_KEPT = ("this reply's text was not kept (the policy's review.keep_text is off): "
            "it cannot be labelled for calibration")


def _text_kept(reply: Any) -> bool:
    """Whether a label on ``reply`` could be used: calibration needs its prompt and answer."""
    return reply.prompt is not None and reply.response is not None


def _base(request: Request) -> str:
    """The page's URL prefix: '' standalone, '/review' when mounted."""
    return (request.scope.get("root_path") or "").rstrip("/")


def _query(form: Filters, **extra: Any) -> str:
    return form.carried().query(**extra)


async def _form(request: Request, limit: int) -> dict[str, str]:
    check_fetch_site(request)
    body = await read_limited(request, limit, lambda msg: PageError(413, msg, code="body_too_large"))
    return parse_form(body, request.headers.get("content-type", ""))
