"""Replies carry their traffic group and the drift case in force when they were decided.

Revision ID: 0002
Revises: 0001

``group_name``: the kind of traffic (request metadata, the API key's group, or a policy rule)
whose own certificate, if any, decided the reply; the review page filters and counts by it and
``calibrate --dataset reviews`` certifies per group. ``drift_case``: the live window's case
(``ok``, ``slice:<group>``, ``unseen``) in force, so a reply decided under a drift action says so.
Both NULL on replies written before this revision.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("replies") as batch:
        batch.add_column(sa.Column("group_name", sa.String(64)))
        batch.add_column(sa.Column("drift_case", sa.String(96)))
    op.create_index("ix_replies_group_name", "replies", ["group_name"])


def downgrade() -> None:
    op.drop_index("ix_replies_group_name", table_name="replies")
    with op.batch_alter_table("replies") as batch:
        batch.drop_column("drift_case")
        batch.drop_column("group_name")
