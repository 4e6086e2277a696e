"""Between the records (``records.py``) and table rows: values made storable, rows made records.

Everything stored must read back the same on SQLite and PostgreSQL, and must never fail a write
for a reason the caller cannot see coming. So, before a write:

- non-finite floats (NaN, ±inf: an invalid score, a missing risk) become None, as JSON has no
  NaN and PostgreSQL's JSONB refuses it;
- text loses what a database cannot hold: NUL characters (PostgreSQL text refuses them) and
  lone surrogates (no UTF-8 form) become U+FFFD, on both backends alike;
- numpy scalars become Python numbers; anything else that is not JSON is refused.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from guarduq.errors import StoreInputError
from guarduq.store.records import PREVIEW_CHARS, LabelRecord, QueueRow, ReplyRecord, Sample

_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def clean_text(s: str) -> str:
    """``s`` with NUL and lone surrogates replaced by U+FFFD (unchanged in the common case)."""
    if s.isascii() and "\x00" not in s:
        return s
    return _BAD_TEXT.sub(REPLACEMENT, s)


def clean_float(x: Any) -> float | None:
    """A finite float, or None for None, NaN and infinities."""
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        raise StoreInputError(f"expected a number, got {type(x).__name__}") from None
    return f if math.isfinite(f) else None


def clean(value: Any, what: str) -> Any:
    """A JSON-ready copy of ``value`` (see the module docstring); ``what`` names it in errors."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return clean_float(value)
    if isinstance(value, Mapping):
        return {clean_text(str(k)): clean(v, what) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v, what) for v in value]
    if hasattr(value, "item") and hasattr(value, "dtype"):  # a numpy scalar or 0-d array
        return clean(value.item(), what)
    raise StoreInputError(f"{what}: cannot store a {type(value).__name__} (not JSON)")


def clean_optional_text(value: str | None, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise StoreInputError(f"{what} must be a string, got {type(value).__name__}")
    return clean_text(value)


def utc(t: datetime) -> datetime:
    """``t`` in UTC; a naive datetime is taken to be UTC already."""
    if not isinstance(t, datetime):
        raise StoreInputError(f"expected a datetime, got {type(t).__name__}")
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def reply_values(r: ReplyRecord) -> dict[str, Any]:
    """The ``replies`` row of a record, cleaned."""
    if not isinstance(r.request_id, str) or not r.request_id or len(r.request_id) > 64:
        raise StoreInputError(f"request_id must be a non-empty string of at most 64 characters, got {r.request_id!r}")
    if clean_text(r.request_id) != r.request_id:
        raise StoreInputError(f"request_id {r.request_id!r} contains NUL or a lone surrogate")
    return {
        "request_id": r.request_id,
        "time": utc(r.time),
        "model_fingerprint": clean_optional_text(r.model_fingerprint, "model_fingerprint"),
        "policy": clean_optional_text(r.policy, "policy"),
        "policy_sha256": clean_optional_text(r.policy_sha256, "policy_sha256"),
        "calibrator_sha256": clean_optional_text(r.calibrator_sha256, "calibrator_sha256"),
        "parameter_set": clean_text(str(r.parameter_set)),
        "scores": clean(dict(r.scores or {}), "scores"),
        "risk": clean_float(r.risk),
        "action": clean_optional_text(r.action, "action"),
        "rule": clean_optional_text(r.rule, "rule"),
        "shown": bool(r.shown),
        "escalated": bool(r.escalated),
        "ended": bool(r.ended),
        "second_opinion": clean(r.second_opinion, "second_opinion"),
        "prompt": clean(r.prompt, "prompt"),
        "response": clean_optional_text(r.response, "response"),
        "tokens": clean(r.tokens, "tokens"),
        "token_probs": clean(r.token_probs, "token_probs"),
        "group_name": label_text(r.group, "group"),
        "drift_case": label_text(r.drift, "drift", 96),
    }


def item_values(request_id: str, s: Sample, created: datetime) -> dict[str, Any]:
    """The ``review_items`` row of a sample."""
    return {
        "request_id": request_id,
        "reasons": ",".join(s.reasons),
        "uniform": bool(s.uniform),
        "rate": float(s.rate),
        "extra_probability": float(s.extra_probability),
        "inclusion_probability": float(s.inclusion_probability),
        "created": created,
    }


def reply_of(row: Mapping[str, Any]) -> ReplyRecord:
    return ReplyRecord(
        request_id=row["request_id"],
        time=row["time"],
        model_fingerprint=row["model_fingerprint"],
        policy=row["policy"],
        policy_sha256=row["policy_sha256"],
        calibrator_sha256=row["calibrator_sha256"],
        parameter_set=row["parameter_set"],
        scores=dict(row["scores"] or {}),
        risk=row["risk"],
        action=row["action"],
        rule=row["rule"],
        shown=bool(row["shown"]),
        escalated=bool(row["escalated"]),
        second_opinion=row["second_opinion"],
        prompt=row["prompt"],
        response=row["response"],
        tokens=row["tokens"],
        token_probs=row["token_probs"],
        ended=bool(row["ended"]),
        group=row.get("group_name"),
        drift=row.get("drift_case"),
    )


def label_text(value: str | None, what: str, limit: int = 64) -> str | None:
    """A short name (a group, a drift case) fit for its column: at most ``limit`` characters."""
    text = clean_optional_text(value, what)
    if text is not None and len(text) > limit:
        raise StoreInputError(f"{what} must be at most {limit} characters, got {len(text)}")
    return text


def reasons_of(text: str) -> tuple[str, ...]:
    return tuple(r for r in text.split(",") if r)


def sample_of(row: Mapping[str, Any]) -> Sample:
    return Sample(
        reasons=reasons_of(row["reasons"]),
        uniform=bool(row["uniform"]),
        rate=float(row["rate"]),
        extra_probability=float(row["extra_probability"]),
        inclusion_probability=float(row["inclusion_probability"]),
    )


def label_of(row: Mapping[str, Any]) -> LabelRecord:
    return LabelRecord(
        id=int(row["id"]),
        request_id=row["request_id"],
        reviewer=row["reviewer"],
        label=row["label"],
        note=row["note"],
        corrected=row["corrected"],
        time=row["time"],
    )


# The queue reads this many characters of each reply (not the whole text), enough for a preview
# after whitespace collapses; one more tells whether the text goes on.
PREVIEW_READ = 4 * PREVIEW_CHARS


def preview(text: str | None) -> str | None:
    """At most ``PREVIEW_CHARS`` characters on one line, the last an ellipsis when cut."""
    if text is None:
        return None
    more = len(text) > PREVIEW_READ
    text = " ".join(text[:PREVIEW_READ].split())  # one line: newlines and runs of spaces collapse
    if len(text) <= PREVIEW_CHARS and not more:
        return text
    return text[: PREVIEW_CHARS - 1] + "…"


def queue_row_of(row: Mapping[str, Any]) -> QueueRow:
    return QueueRow(
        request_id=row["request_id"],
        time=row["time"],
        risk=row["risk"],
        action=row["action"],
        rule=row["rule"],
        reasons=reasons_of(row["reasons"]),
        inclusion_probability=float(row["inclusion_probability"]),
        label=row["label"],
        n_labels=int(row["n_labels"] or 0),
        preview=preview(row["preview"]),
        group=row.get("group_name"),
    )
