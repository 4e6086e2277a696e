"""What reviewers read: the queue, one item, and the page's own script and style."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from guarduq.review import views
from guarduq.review.context import HERE, Page
from guarduq.review.forms import ItemPage, PageError, QueuePage, check_request_id, validated

STATIC = {"review.css": "text/css; charset=utf-8", "review.js": "text/javascript; charset=utf-8"}
NOT_KEPT = ("this reply's text was not kept (the policy's review.keep_text is off): "
            "it cannot be labelled for calibration")


def text_kept(reply: Any) -> bool:
    """Whether a label on ``reply`` could be used: calibration needs its prompt and answer."""
    return reply.prompt is not None and reply.response is not None


def add_page_routes(app: FastAPI, page: Page) -> None:
    store, s = page.store, page.settings
    static = {name: (HERE / "static" / name).read_bytes() for name in STATIC}

    @app.get("/")
    def queue_page(request: Request) -> HTMLResponse:
        q: QueuePage = validated(QueuePage, dict(request.query_params))
        filters = q.store_filters()
        total = store.count(**filters)
        pages = max(1, math.ceil(total / s.page_size))
        rows = store.queue(**filters, unlabelled_first=q.unlabelled_first, limit=s.page_size,
                           offset=(q.page - 1) * s.page_size)
        return page.render(request, "queue.html", title="Review queue", q=q, rows=rows, total=total,
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
        return page.render(request, "item.html", title=f"Item {request_id[:12]}", item=item, reply=reply,
                           q=q, filters=q.carried(), labellable=text_kept(reply), not_kept=NOT_KEPT,
                           messages=views.conversation(reply.prompt), tokens=views.answer_tokens(reply),
                           scores=views.score_rows(reply.scores),
                           opinion=views.opinion_rows(reply.second_opinion), next_id=nxt,
                           labels=list(reversed(item.labels)))

    @app.get("/static/{name}")
    def static_file(name: str) -> Response:
        if name not in static:
            raise PageError(404, "no such file")
        # the only responses a browser may keep (for an hour): code and style, no reviewed text
        return Response(static[name], media_type=STATIC[name],
                        headers={"Cache-Control": "private, max-age=3600"})
