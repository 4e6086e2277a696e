"""What the review page's routes share: the store, the settings, the CSRF signer, the templates,
and how a page, an error or the progress line is made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from guarduq.review import views
from guarduq.review.forms import PageError, reviewer_name
from guarduq.review.progress import Progress, progress
from guarduq.review.security import CSRF_COOKIE, REVIEWER_COOKIE, Caller, Csrf, cookie_path

HERE = Path(__file__).parent


def templates() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.globals.update(fmt=views.fmt, when=views.when, quote=lambda v: quote(str(v), safe=""))
    return env


@dataclass
class Page:
    """One review page's parts. ``alpha_of``/``fraction_of``: asked on every page for the α and
    the threshold fraction the progress line counts with (None: the settings')."""

    store: Any
    settings: Any  # ReviewPageSettings
    csrf: Csrf
    env: Environment
    alpha_of: Callable[[], float | None] | None = None
    fraction_of: Callable[[], float] | None = None

    def reviewer(self, request: Request) -> str:
        caller: Caller = request.state.caller
        if caller.user:
            try:
                return reviewer_name(caller.user)
            except ValueError:
                pass
        try:
            return reviewer_name(unquote(request.cookies.get(REVIEWER_COOKIE) or ""))
        except ValueError:
            return self.settings.reviewer_default

    def render(self, request: Request, template: str, *, title: str, **ctx: Any) -> HTMLResponse:
        token = request.cookies.get(CSRF_COOKIE)
        fresh = not self.csrf.valid(token)
        if fresh:
            token = self.csrf.mint()
        html = self.env.get_template(template).render(
            base=base(request), csrf=token, reviewer=self.reviewer(request), title=title,
            progress=self.progress(getattr(ctx.get("q"), "group", None)), named_by_login=bool(request.state.caller.user), **ctx)
        resp = HTMLResponse(html)
        if fresh:
            resp.set_cookie(CSRF_COOKIE, str(token), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path=cookie_path(request))
        return resp

    def error(self, request: Request, exc: PageError) -> Response:
        """An HTML page for a browser, serve's JSON shape for everyone else."""
        if "text/html" in request.headers.get("accept", ""):
            html = self.env.get_template("error.html").render(base=base(request), status=exc.status,
                                                              message=exc.message)
            return HTMLResponse(html, status_code=exc.status, headers=exc.headers)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def progress(self, group: str | None = None) -> Progress:
        """The progress line, of one traffic group's labels when the queue is filtered by group
        (each group's own certificate counts its own uniform labels)."""
        s = self.settings
        alpha = self.alpha_of() if self.alpha_of is not None else s.alpha
        if alpha is not None and not 0 < alpha < 1:
            alpha = None
        fraction = self.fraction_of() if self.fraction_of is not None else s.threshold_fraction
        counts = self.store.progress(group=group) if group is not None else self.store.progress()
        return progress(counts, alpha=alpha, delta=s.delta, threshold_fraction=fraction)


def base(request: Request) -> str:
    """The page's URL prefix: '' standalone, '/review' when mounted."""
    return (request.scope.get("root_path") or "").rstrip("/")
