"""The first schema: replies, review items, labels.

Revision ID: 0001
Revises: (none)

Self-contained on purpose: a revision describes the schema as it was when written, so it must
not import the models (which change with later revisions).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _json() -> sa.types.TypeEngine:  # type: ignore[type-arg]
    return sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def _time() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "replies",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("time", _time(), nullable=False),
        sa.Column("model_fingerprint", sa.Text()),
        sa.Column("policy", sa.Text()),
        sa.Column("policy_sha256", sa.String(64)),
        sa.Column("calibrator_sha256", sa.String(64)),
        sa.Column("parameter_set", sa.Text(), nullable=False),
        sa.Column("scores", _json(), nullable=False),
        sa.Column("risk", sa.Float()),
        sa.Column("action", sa.Text()),
        sa.Column("rule", sa.Text()),
        sa.Column("shown", sa.Boolean(), nullable=False),
        sa.Column("escalated", sa.Boolean(), nullable=False),
        sa.Column("ended", sa.Boolean(), nullable=False),
        sa.Column("second_opinion", _json()),
        sa.Column("prompt", _json()),
        sa.Column("response", sa.Text()),
        sa.Column("tokens", _json()),
        sa.Column("token_probs", _json()),
    )
    op.create_index("ix_replies_time", "replies", ["time"])
    op.create_index("ix_replies_risk", "replies", ["risk"])

    op.create_table(
        "review_items",
        sa.Column(
            "request_id",
            sa.String(64),
            sa.ForeignKey("replies.request_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("reasons", sa.String(64), nullable=False),
        sa.Column("uniform", sa.Boolean(), nullable=False),
        sa.Column("rate", sa.Float(), nullable=False),
        sa.Column("extra_probability", sa.Float(), nullable=False),
        sa.Column("inclusion_probability", sa.Float(), nullable=False),
        sa.Column("created", _time(), nullable=False),
    )
    op.create_index("ix_review_items_created", "review_items", ["created"])

    op.create_table(
        "labels",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "request_id",
            sa.String(64),
            sa.ForeignKey("review_items.request_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("reviewer", sa.Text(), nullable=False),
        sa.Column("label", sa.String(16), nullable=False),
        sa.Column("note", sa.Text()),
        sa.Column("corrected", sa.Text()),
        sa.Column("time", _time(), nullable=False),
        sa.CheckConstraint("label IN ('right', 'wrong', 'unsure')", name="ck_labels_label"),
    )
    op.create_index("ix_labels_request_id", "labels", ["request_id"])


def downgrade() -> None:
    op.drop_table("labels")
    op.drop_table("review_items")
    op.drop_table("replies")
