"""The review queue's SQL: items joined to their reply and their current label, filtered.

The current label of every item comes from one grouped subquery (``max(labels.id)`` and the
label count per item) joined back to ``labels``, so a page of the queue is one query however
many items it lists, never one query per item.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, and_, case, func, or_, select
from sqlalchemy.sql import FromClause

from guarduq.errors import StoreInputError
from guarduq.store.convert import PREVIEW_READ
from guarduq.store.records import Filters  # noqa: F401 - re-exported: its home was here
from guarduq.store.schema import ITEMS, LABEL_ROWS, REPLIES

MAX_LIMIT = 10_000


def check_page(limit: int, offset: int) -> None:
    for name, v in (("limit", limit), ("offset", offset)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise StoreInputError(f"{name} must be a non-negative integer, got {v!r}")
    if limit > MAX_LIMIT:
        raise StoreInputError(f"limit must be at most {MAX_LIMIT}, got {limit}")


class Joined:
    """review_items ⋈ replies ⟕ (label count, last label id per item) ⟕ the current label."""

    def __init__(self) -> None:
        self.agg = (
            select(
                LABEL_ROWS.c.request_id.label("request_id"),
                func.max(LABEL_ROWS.c.id).label("last_id"),
                func.count(LABEL_ROWS.c.id).label("n_labels"),
            )
            .group_by(LABEL_ROWS.c.request_id)
            .subquery("agg")
        )
        self.cur = LABEL_ROWS.alias("cur")
        self.source: FromClause = (
            ITEMS.join(REPLIES, REPLIES.c.request_id == ITEMS.c.request_id)
            .outerjoin(self.agg, self.agg.c.request_id == ITEMS.c.request_id)
            .outerjoin(self.cur, self.cur.c.id == self.agg.c.last_id)
        )

    @property
    def unlabelled(self) -> ColumnElement[bool]:
        return self.agg.c.last_id.is_(None)

    def where(self, f: Filters) -> list[ColumnElement[bool]]:
        conds: list[ColumnElement[bool]] = []
        if f.reason == "uniform":
            conds.append(ITEMS.c.uniform.is_(True))
        elif f.reason is not None:  # reason names are not substrings of one another
            conds.append(ITEMS.c.reasons.like(f"%{f.reason}%"))
        if f.action is not None:
            conds.append(REPLIES.c.action == f.action)
        if f.risk_min is not None:
            conds.append(REPLIES.c.risk >= float(f.risk_min))
        if f.risk_max is not None:
            conds.append(REPLIES.c.risk <= float(f.risk_max))
        if f.labelled is True:
            conds.append(self.agg.c.last_id.is_not(None))
        elif f.labelled is False:
            conds.append(self.unlabelled)
        if f.label is not None:
            conds.append(self.cur.c.label == f.label)
        if f.group is not None:
            conds.append(REPLIES.c.group_name == f.group)
        return conds

    def rows(self, f: Filters) -> Select[Any]:
        """The queue's columns (no ordering, no paging)."""
        return (
            select(
                ITEMS.c.request_id,
                REPLIES.c.time,
                REPLIES.c.risk,
                REPLIES.c.action,
                REPLIES.c.rule,
                ITEMS.c.reasons,
                ITEMS.c.inclusion_probability,
                self.cur.c.label,
                self.agg.c.n_labels,
                func.substr(REPLIES.c.response, 1, PREVIEW_READ + 1).label("preview"),
                REPLIES.c.group_name,
            )
            .select_from(self.source)
            .where(*self.where(f))
        )

    def count(self, f: Filters) -> Select[Any]:
        return select(func.count()).select_from(self.source).where(*self.where(f))

    def order(self, q: Select[Any], unlabelled_first: bool) -> Select[Any]:
        keys: list[Any] = []
        if unlabelled_first:
            keys.append(case((self.unlabelled, 0), else_=1))
        keys += [REPLIES.c.time.desc(), ITEMS.c.request_id.desc()]
        return q.order_by(*keys)

    @staticmethod
    def before(time: Any, request_id: str) -> ColumnElement[bool]:
        """Rows after (time, request_id) in newest-first order."""
        return or_(
            REPLIES.c.time < time,
            and_(REPLIES.c.time == time, ITEMS.c.request_id < request_id),
        )


def progress_query(j: Joined, group: str | None = None) -> Select[Any]:
    """Counts over all review items (of one traffic ``group``) in one pass (see ``Store.progress``)."""
    label = j.cur.c.label
    decided = label.in_(("right", "wrong"))
    uniform = ITEMS.c.uniform.is_(True)

    def n(cond: ColumnElement[bool]) -> Any:
        return func.coalesce(func.sum(case((cond, 1), else_=0)), 0)

    return select(
        func.count().label("items"),
        n(j.unlabelled).label("unlabelled"),
        n(decided).label("labelled"),
        n(label == "right").label("right"),
        n(label == "wrong").label("wrong"),
        n(label == "unsure").label("unsure"),
        n(and_(uniform, decided)).label("labelled_uniform"),
        n(and_(uniform, label == "wrong")).label("wrong_uniform"),
        n(ITEMS.c.reasons.like("%escalation%")).label("escalation"),
        n(uniform).label("uniform"),
        n(ITEMS.c.reasons.like("%band%")).label("band"),
        n(ITEMS.c.reasons.like("%drift%")).label("drift"),
    ).select_from(j.source).where(*j.where(Filters(group=group)))
