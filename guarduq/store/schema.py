"""The store's tables as SQLAlchemy 2 declarative models, the same on SQLite and PostgreSQL.

These models are what the code reads and writes; the database itself is created and upgraded
only by the Alembic revisions in ``guarduq/store/migrations/versions`` (a test checks that the
two agree). Change a table here and add a revision there, never one without the other.

Times are stored in UTC: on PostgreSQL as ``timestamptz``, on SQLite as naive ISO text in UTC
(fixed width, so text order is time order), and always read back timezone-aware.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, TypeEngine

# Alembic's bookkeeping table; named for guarduq so a database shared with an application that
# runs its own Alembic keeps the two histories apart.
VERSION_TABLE = "guarduq_alembic_version"


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (naive input is taken as UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        # SQLite has no timezone type: store naive UTC so text order stays time order
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def json_type() -> TypeEngine[Any]:
    """JSON on SQLite, JSONB on PostgreSQL; Python None is SQL NULL (so ``IS NULL`` finds it)."""
    return JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


class Base(DeclarativeBase):
    pass


class Reply(Base):
    """Every decided reply (``ReplyRecord``); text columns are NULL unless the policy kept text."""

    __tablename__ = "replies"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False)
    model_fingerprint: Mapped[str | None] = mapped_column(Text)
    policy: Mapped[str | None] = mapped_column(Text)  # "name@version"
    policy_sha256: Mapped[str | None] = mapped_column(String(64))
    calibrator_sha256: Mapped[str | None] = mapped_column(String(64))
    parameter_set: Mapped[str] = mapped_column(Text, nullable=False)
    scores: Mapped[Any] = mapped_column(json_type(), nullable=False)
    risk: Mapped[float | None] = mapped_column(Float)
    action: Mapped[str | None] = mapped_column(Text)
    rule: Mapped[str | None] = mapped_column(Text)
    shown: Mapped[bool] = mapped_column(Boolean, nullable=False)
    escalated: Mapped[bool] = mapped_column(Boolean, nullable=False)
    ended: Mapped[bool] = mapped_column(Boolean, nullable=False)
    second_opinion: Mapped[Any | None] = mapped_column(json_type())
    prompt: Mapped[Any | None] = mapped_column(json_type())  # a string or chat messages
    response: Mapped[str | None] = mapped_column(Text)
    tokens: Mapped[Any | None] = mapped_column(json_type())
    token_probs: Mapped[Any | None] = mapped_column(json_type())
    group_name: Mapped[str | None] = mapped_column(String(64))  # the traffic group (revision 0002)
    drift_case: Mapped[str | None] = mapped_column(String(96))  # ok / slice:<group> / unseen in force

    __table_args__ = (
        Index("ix_replies_time", "time"),
        Index("ix_replies_risk", "risk"),
        Index("ix_replies_group_name", "group_name"),
    )


class ReviewItemRow(Base):
    """A reply sampled for review, with the ``Sample`` that picked it."""

    __tablename__ = "review_items"

    request_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("replies.request_id", ondelete="CASCADE"), primary_key=True
    )
    reasons: Mapped[str] = mapped_column(String(64), nullable=False)  # "escalation,uniform,band"
    uniform: Mapped[bool] = mapped_column(Boolean, nullable=False)
    rate: Mapped[float] = mapped_column(Float, nullable=False)
    extra_probability: Mapped[float] = mapped_column(Float, nullable=False)
    inclusion_probability: Mapped[float] = mapped_column(Float, nullable=False)
    created: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False)

    __table_args__ = (Index("ix_review_items_created", "created"),)


class LabelRow(Base):
    """One reviewer's verdict; every verdict is kept, the highest id is the current one."""

    __tablename__ = "labels"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("review_items.request_id", ondelete="CASCADE"), nullable=False
    )
    reviewer: Mapped[str] = mapped_column(Text, nullable=False)
    label: Mapped[str] = mapped_column(String(16), nullable=False)
    note: Mapped[str | None] = mapped_column(Text)
    corrected: Mapped[str | None] = mapped_column(Text)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False)

    __table_args__ = (
        CheckConstraint("label IN ('right', 'wrong', 'unsure')", name="ck_labels_label"),
        Index("ix_labels_request_id", "request_id"),
    )


REPLIES = Reply.__table__
ITEMS = ReviewItemRow.__table__
LABEL_ROWS = LabelRow.__table__
