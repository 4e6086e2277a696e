"""``Store``: decided replies, the review sample and its labels, in SQLite or PostgreSQL.

One Engine per store and one short connection per call, so a store is shared freely between
threads (the Guard's request threads, the review page's handlers). Every write is one
transaction, committed before the call returns: a label that ``add_label`` returned is on disk.
Writes of the same request id are idempotent (a retried ``record`` keeps the first), so a caller
may retry after an error without knowing whether the first try landed.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TextIO

from sqlalchemy import Connection, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from guarduq._logging import get_logger
from guarduq.errors import GuardUQError, StoreError, StoreInputError, UnknownItemError
from guarduq.store.convert import (
    clean_optional_text,
    item_values,
    label_of,
    queue_row_of,
    reply_of,
    reply_values,
    sample_of,
    utc,
)
from guarduq.store.engine import Target, make_engine, parse_url
from guarduq.store.migrate import ensure_schema
from guarduq.store.queries import Joined, check_page, progress_query
from guarduq.store.records import (
    LABELS,
    REASONS,
    Filters,
    LabelledReview,
    LabelRecord,
    QueueRow,
    ReplyRecord,
    ReviewItem,
    Sample,
)
from guarduq.store.schema import ITEMS, LABEL_ROWS, REPLIES

log = get_logger("store")

MAX_NOTE_CHARS = 10_000  # a reviewer's note or corrected reply
MAX_REVIEWER_CHARS = 200


class Store:
    """The store at ``url``: ``sqlite:///path.db`` (or a bare file path) or ``postgresql://...``.

    The schema is created or upgraded when the store opens (see ``guarduq.store.migrate``).
    """

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self._target: Target = parse_url(url)
        self.where = self._target.where
        self.backend = self._target.backend
        # an in-memory SQLite database is one shared connection: calls take turns
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self._target.memory else contextlib.nullcontext()
        )
        self._closed = False
        with self._errors("open"):
            self._engine = make_engine(self._target, echo=echo)
            try:
                migrated = ensure_schema(self._engine, self.where)
            except BaseException:
                self._engine.dispose()
                raise
        log.info("store_opened", where=self.where, migrated=migrated)

    # ------------------------------------------------------------------ plumbing

    def __repr__(self) -> str:
        return f"Store({self.where!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every pooled connection; the store cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            self._engine.dispose()

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Database failures as ``StoreError`` naming the store; guarduq's own errors pass."""
        try:
            yield
        except GuardUQError:
            raise
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            msg = " ".join(str(orig).split())[:500]
            raise StoreError(f"store {self.where}: {what} failed: {type(orig).__name__}: {msg}") from exc

    @contextlib.contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        if self._closed:
            raise StoreError(f"store {self.where} is closed")
        with self._errors(what), self._lock, self._engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def _write(self, what: str) -> Iterator[Connection]:
        """One transaction, committed on exit; on SQLite it holds the write lock from the start."""
        if self._closed:
            raise StoreError(f"store {self.where} is closed")
        with self._errors(what), self._lock, self._engine.connect() as conn:
            if self.backend == "sqlite":
                conn.execution_options(guarduq_begin="BEGIN IMMEDIATE")
            with conn.begin():
                yield conn

    def _insert(self, table: Any) -> Any:
        """An INSERT that skips a row whose primary key exists (the idempotent write)."""
        dialect = postgresql if self.backend == "postgresql" else sqlite
        return dialect.insert(table).on_conflict_do_nothing()

    # ------------------------------------------------------------------ writes

    def record(self, reply: ReplyRecord, sample: Sample | None) -> None:
        """Keep ``reply``, and make it a review item when ``sample`` picked it.

        A second call with the same request id changes nothing (the first record stands).
        """
        self.record_many([(reply, sample)])

    def record_many(self, pairs: Iterable[tuple[ReplyRecord, Sample | None]]) -> int:
        """``record`` for many replies in one transaction; returns how many were new."""
        rows = [(reply_values(r), s) for r, s in pairs]  # validated before the transaction
        if not rows:
            return 0
        new = 0
        with self._write("record") as conn:
            for values, sample in rows:
                stmt = self._insert(REPLIES).values(**values).returning(REPLIES.c.request_id)
                if conn.execute(stmt).first() is None:  # the id was there already
                    log.debug("store_duplicate_reply", request_id=values["request_id"])
                    continue
                new += 1
                if sample is not None and sample.sampled:
                    conn.execute(
                        self._insert(ITEMS).values(**item_values(values["request_id"], sample, values["time"]))
                    )
        return new

    def add_label(
        self,
        request_id: str,
        *,
        reviewer: str,
        label: str,
        note: str | None = None,
        corrected: str | None = None,
    ) -> LabelRecord:
        """Add one reviewer's verdict to an item's history; committed when this returns."""
        if label not in LABELS:
            raise StoreInputError(f"unknown label {label!r}; choose one of {list(LABELS)}")
        if not isinstance(reviewer, str) or not reviewer.strip():
            raise StoreInputError("a label needs a reviewer (a non-empty name)")
        reviewer = clean_optional_text(reviewer.strip(), "reviewer") or ""
        if len(reviewer) > MAX_REVIEWER_CHARS:
            raise StoreInputError(f"reviewer name is {len(reviewer)} characters; at most {MAX_REVIEWER_CHARS}")
        texts: dict[str, str | None] = {}
        for name, value in (("note", note), ("corrected", corrected)):
            text = clean_optional_text(value, name)
            if text is not None and len(text) > MAX_NOTE_CHARS:
                raise StoreInputError(f"{name} is {len(text):,} characters; at most {MAX_NOTE_CHARS:,}")
            texts[name] = text or None  # an empty note is no note
        if not isinstance(request_id, str) or not request_id:
            raise StoreInputError(f"request_id must be a non-empty string, got {request_id!r}")
        now = datetime.now(UTC)
        with self._write("add_label") as conn:
            found = conn.execute(select(ITEMS.c.request_id).where(ITEMS.c.request_id == request_id)).first()
            if found is None:
                raise UnknownItemError(f"no review item {request_id!r} in store {self.where}")
            values = {"request_id": request_id, "reviewer": reviewer, "label": label, "time": now, **texts}
            new_id = conn.execute(insert(LABEL_ROWS).values(**values).returning(LABEL_ROWS.c.id)).scalar_one()
        log.info("store_label", request_id=request_id, label=label, id=new_id)
        return LabelRecord(id=int(new_id), **values)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ reads

    def item(self, request_id: str) -> ReviewItem | None:
        """The review item ``request_id`` with its label history (oldest first), or None."""
        with self._read("item") as conn:
            row = conn.execute(
                select(REPLIES, ITEMS.c.reasons, ITEMS.c.uniform, ITEMS.c.rate, ITEMS.c.extra_probability,
                       ITEMS.c.inclusion_probability)
                .select_from(ITEMS.join(REPLIES, REPLIES.c.request_id == ITEMS.c.request_id))
                .where(ITEMS.c.request_id == request_id)
            ).mappings().first()
            if row is None:
                return None
            labels = conn.execute(
                select(LABEL_ROWS).where(LABEL_ROWS.c.request_id == request_id).order_by(LABEL_ROWS.c.id)
            ).mappings().all()
        return ReviewItem(reply=reply_of(row), sample=sample_of(row), labels=[label_of(r) for r in labels])

    def reply(self, request_id: str) -> ReplyRecord | None:
        """Any recorded reply, sampled or not."""
        with self._read("reply") as conn:
            row = conn.execute(select(REPLIES).where(REPLIES.c.request_id == request_id)).mappings().first()
        return reply_of(row) if row is not None else None

    def queue(
        self,
        filters: Filters | None = None,
        *,
        unlabelled_first: bool = True,
        limit: int = 50,
        offset: int = 0,
        **conditions: Any,
    ) -> list[QueueRow]:
        """A page of review items: unlabelled first (unless told otherwise), then newest first.
        ``filters``, or its fields as keywords (``reason="band", risk_min=0.4``)."""
        f = Filters.of(filters, conditions)
        check_page(limit, offset)
        j = Joined()
        q = j.order(j.rows(f), unlabelled_first).limit(limit).offset(offset)
        with self._read("queue") as conn:
            rows = conn.execute(q).mappings().all()
        return [queue_row_of(r) for r in rows]

    def count(self, filters: Filters | None = None, **conditions: Any) -> int:
        """How many items ``queue`` would list with these filters (for paging)."""
        f = Filters.of(filters, conditions)
        with self._read("count") as conn:
            return int(conn.execute(Joined().count(f)).scalar_one())

    def next_unlabelled(self, after: str | None = None, filters: Filters | None = None, **conditions: Any) -> str | None:
        """The next unlabelled item after ``after`` in queue order (newest first), else the first
        unlabelled one other than ``after`` from the top (items skipped or newly arrived); None
        when every item matching the filters is labelled. ``filters``/``conditions``: as for
        ``queue``; an unlabelled item has no label, so ``labelled`` and ``label`` do not apply.

        ``after`` keeps its place in the order whether or not it has been labelled since, so a
        reviewer who labels an item and asks for the next one moves down the list.
        """
        f = Filters.of(filters, conditions)
        if f.labelled or f.label is not None:
            raise StoreInputError("next_unlabelled looks for unlabelled items: give no labelled or label filter")
        j = Joined()
        q = j.order(j.rows(replace(f, labelled=False)), False).limit(1)
        with self._read("next_unlabelled") as conn:
            if after is None:
                return conn.execute(q).scalar()
            pos = conn.execute(
                select(REPLIES.c.time)
                .select_from(ITEMS.join(REPLIES, REPLIES.c.request_id == ITEMS.c.request_id))
                .where(ITEMS.c.request_id == after)
            ).first()
            if pos is None:
                raise UnknownItemError(f"no review item {after!r} in store {self.where}")
            nxt = conn.execute(q.where(j.before(pos.time, after))).scalar()
            if nxt is None:
                nxt = conn.execute(q.where(ITEMS.c.request_id != after)).scalar()
            return nxt

    def progress(self, group: str | None = None) -> dict[str, Any]:
        """Counts for the review page and for deciding when there are enough labels.

        ``labelled``: items whose current label is right or wrong (usable for calibration);
        ``unsure``: current label unsure; ``labelled_uniform`` / ``wrong_uniform``: the same
        among items the uniform draw picked (the simple random sample a certificate rests on);
        ``by_reason``: items per reason (an item picked for two reasons counts under both).
        ``group``: count one traffic group's replies and items only (its own certificate's count).
        """
        replies_q = select(func.count()).select_from(REPLIES)
        if group is not None:
            replies_q = replies_q.where(REPLIES.c.group_name == group)
        with self._read("progress") as conn:
            replies = int(conn.execute(replies_q).scalar_one())
            row = conn.execute(progress_query(Joined(), group)).mappings().one()
        out: dict[str, Any] = {"replies": replies}
        for key in ("items", "unlabelled", "labelled", "right", "wrong", "unsure", "labelled_uniform", "wrong_uniform"):
            out[key] = int(row[key] or 0)
        out["by_reason"] = {r: int(row[r] or 0) for r in REASONS}
        return out

    def labelled(
        self, *, since: datetime | None = None, model_fingerprint: str | None = None
    ) -> list[LabelledReview]:
        """Reviewed replies ready for calibration, oldest first: text kept and a current label of
        right or wrong. ``since``: replies at or after this time."""
        j = Joined()
        q = (
            select(REPLIES, ITEMS.c.reasons, ITEMS.c.uniform, ITEMS.c.rate, ITEMS.c.extra_probability,
                   ITEMS.c.inclusion_probability, j.cur.c.label.label("current_label"))
            .select_from(j.source)
            .where(
                j.cur.c.label.in_(("right", "wrong")),
                REPLIES.c.prompt.is_not(None),
                REPLIES.c.response.is_not(None),
            )
            .order_by(REPLIES.c.time, REPLIES.c.request_id)
        )
        if since is not None:
            q = q.where(REPLIES.c.time >= utc(since))
        if model_fingerprint is not None:
            q = q.where(REPLIES.c.model_fingerprint == model_fingerprint)
        with self._read("labelled") as conn:
            rows = conn.execute(q).mappings().all()
        return [
            LabelledReview(
                request_id=r["request_id"],
                time=r["time"],
                prompt=r["prompt"],
                response=r["response"],
                correct=1 if r["current_label"] == "right" else 0,
                ended=bool(r["ended"]),
                sample=sample_of(r),
                model_fingerprint=r["model_fingerprint"],
                scores=dict(r["scores"] or {}),
                group=r["group_name"],
            )
            for r in rows
        ]

    def groups(self) -> dict[str, int]:
        """Traffic group -> review items of that group (replies without a group are left out)."""
        q = (select(REPLIES.c.group_name, func.count())
             .select_from(ITEMS.join(REPLIES, REPLIES.c.request_id == ITEMS.c.request_id))
             .where(REPLIES.c.group_name.is_not(None)).group_by(REPLIES.c.group_name)
             .order_by(REPLIES.c.group_name))
        with self._read("groups") as conn:
            return {str(g): int(n) for g, n in conn.execute(q).all()}

    def export_jsonl(
        self, out: TextIO, *, since: datetime | None = None
    ) -> int:
        """Write the labelled reviews as ``jsonl`` dataset lines (``guarduq calibrate --dataset
        jsonl``): ``id``, ``prompt``, ``response``, ``label`` (1 = right, 0 = wrong), ``ended`` and
        ``guarduq_sample`` (the sampling record calibration reweights with), and ``group`` where the
        reply has a traffic group (calibration certifies per group). Returns the lines written.

        Chat-message prompts are written as message lists (the ``jsonl`` and ``reviews`` loaders
        read both).
        """
        n = 0
        for r in self.labelled(since=since):
            line = {
                "id": r.request_id,
                "prompt": r.prompt,
                "response": r.response,
                "label": r.correct,
                "ended": r.ended,
                "guarduq_sample": r.sample.to_json(),
                **({"group": r.group} if r.group is not None else {}),
            }
            out.write(json.dumps(line, ensure_ascii=False, allow_nan=False) + "\n")
            n += 1
        return n
