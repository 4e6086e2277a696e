"""What reviewers send and take away: a label, their name, and the labels' export."""

from __future__ import annotations

import io
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from guarduq._http import read_limited
from guarduq._logging import get_logger
from guarduq.review.context import Page, base
from guarduq.review.forms import (
    ExportQuery,
    Filters,
    LabelForm,
    PageError,
    ReviewerForm,
    check_request_id,
    parse_form,
    validated,
)
from guarduq.review.pages import NOT_KEPT, text_kept
from guarduq.review.security import CSRF_COOKIE, REVIEWER_COOKIE, check_fetch_site, cookie_path

log = get_logger("review")


def add_label_routes(app: FastAPI, page: Page) -> None:
    store, s, csrf = page.store, page.settings, page.csrf

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
        if not text_kept(item.reply):
            raise PageError(409, NOT_KEPT + "; no label was stored", param="request_id", code="text_not_kept")
        who = page.reviewer(request)
        await run_in_threadpool(lambda: store.add_label(request_id, reviewer=who, label=form.label,
                                                        note=form.note, corrected=form.corrected))
        log.info("review_label", request_id=request_id, reviewer=who, label=form.label)
        nxt = await run_in_threadpool(lambda: store.next_unlabelled(after=request_id, **form.next_filters()))
        prefix = base(request)
        if nxt is None:
            return RedirectResponse(f"{prefix}/{_query(form, done='true')}", status_code=303)
        return RedirectResponse(f"{prefix}/items/{quote(nxt, safe='')}{_query(form, prev=request_id)}",
                                status_code=303)

    @app.post("/reviewer")
    async def set_reviewer(request: Request) -> RedirectResponse:
        data = await _form(request, s.max_body_bytes)
        csrf.check(request.cookies.get(CSRF_COOKIE), data.get("csrf"))
        form: ReviewerForm = validated(ReviewerForm, data)
        resp = RedirectResponse(f"{base(request)}/", status_code=303)
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


def _query(form: Filters, **extra: Any) -> str:
    return form.carried().query(**extra)


async def _form(request: Request, limit: int) -> dict[str, str]:
    check_fetch_site(request)
    body = await read_limited(request, limit, lambda msg: PageError(413, msg, code="body_too_large"))
    return parse_form(body, request.headers.get("content-type", ""))
