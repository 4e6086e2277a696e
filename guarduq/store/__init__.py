"""The reply and review store: every decided reply, the sample drawn for human review, and the
reviewers' labels, in SQLite (embedded) or PostgreSQL, with the schema versioned by Alembic.

Needs the ``store`` extra (SQLAlchemy, Alembic, psycopg); ``import guarduq`` does not import
this package, so guarduq works without it. The records (``guarduq.store.records``) and the
sampler import no database code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from guarduq.store.sampling import ReviewSampler, fit_weights, inclusion_probability

if TYPE_CHECKING:
    from guarduq.store.database import Store

__all__ = [
    "LABELS",
    "REASONS",
    "Filters",
    "LabelRecord",
    "LabelledReview",
    "QueueRow",
    "ReplyRecord",
    "ReviewItem",
    "ReviewSampler",
    "Sample",
    "Store",
    "fit_weights",
    "inclusion_probability",
]


def __getattr__(name: str) -> Any:
    """``Store`` is imported on first use: SQLAlchemy loads only when a store is opened."""
    if name == "Store":
        try:
            from guarduq.store.database import Store
        except ModuleNotFoundError as exc:
            if exc.name not in ("sqlalchemy", "alembic"):
                raise
            from guarduq.errors import StoreError

            raise StoreError(
                f"the store needs the 'store' extra (missing module {exc.name!r}): "
                "pip install 'guarduq[store]'"
            ) from exc
        return Store
    raise AttributeError(f"module 'guarduq.store' has no attribute {name!r}")
