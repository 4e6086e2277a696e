"""Every input the review page accepts, as pydantic models: query strings and form fields.

Nothing from a request reaches the store unvalidated. A browser sends an empty string for an
untouched ``<select>`` or number box, so empty strings mean "not given" here. A failure becomes
a ``PageError`` (400) whose message names the field and what it accepts, never a 500.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from guarduq.policy.schema import ACTIONS
from guarduq.store.records import LABELS, REASONS, Label, Reason
from guarduq.store.records import Filters as Selection

MAX_NOTE = 4_000
MAX_CORRECTED = 10_000  # the store's limit on a note or corrected reply
MAX_ID = 200
MAX_REVIEWER = 64


class PageError(Exception):
    """An error the page shows (HTML for a browser, serve's JSON error shape otherwise)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
        return {"error": {"message": self.message, "type": kind.get(self.status, "invalid_request_error")
                          if self.status < 500 else "server_error",
                          "param": self.param, "code": self.code}}


def _blank_is_none(value: Any) -> Any:
    return None if isinstance(value, str) and not value.strip() else value


class Filters(BaseModel):
    """What narrows the queue; carried from the queue to items and back, so a reviewer working
    through "escalations above 0.8" stays inside that slice after each label."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    reason: Reason | None = None
    action: Literal[ACTIONS] | None = None  # the choices are policy.schema.ACTIONS
    risk_min: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    risk_max: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    labelled: bool | None = None
    current: Label | None = None  # the current label is this
    group: str | None = Field(None, min_length=1, max_length=64)  # the replies' traffic group
    unlabelled_first: bool = True

    _blanks = field_validator("reason", "action", "risk_min", "risk_max", "labelled", "current", "group",
                              mode="before")(_blank_is_none)

    @field_validator("unlabelled_first", mode="before")
    @classmethod
    def _default_order(cls, value: Any) -> Any:
        return True if _blank_is_none(value) is None else value

    @model_validator(mode="after")
    def _ordered(self) -> Filters:
        if self.risk_min is not None and self.risk_max is not None and self.risk_min > self.risk_max:
            raise ValueError(f"risk_min {self.risk_min} is above risk_max {self.risk_max}")
        return self

    def selection(self) -> Selection:
        """The store's ``Filters`` these select (``Store.queue``/``count``/``next_unlabelled``)."""
        return Selection(reason=self.reason, action=self.action, risk_min=self.risk_min,
                         risk_max=self.risk_max, labelled=self.labelled, label=self.current,
                         group=self.group)

    def store_filters(self) -> dict[str, Any]:
        """``selection()`` as keyword arguments for ``Store.queue``/``count``."""
        return asdict(self.selection())

    def next_filters(self) -> dict[str, Any]:
        """Keyword arguments for ``Store.next_unlabelled`` (which is unlabelled by definition)."""
        return {k: v for k, v in self.store_filters().items() if k not in ("labelled", "label")}

    def carried(self) -> Filters:
        """Just the filters (a form or page model carries more fields)."""
        return Filters(reason=self.reason, action=self.action, risk_min=self.risk_min,
                       risk_max=self.risk_max, labelled=self.labelled, current=self.current,
                       group=self.group, unlabelled_first=self.unlabelled_first)

    def params(self) -> dict[str, str]:
        """The non-default filters as query parameters (for links and hidden form fields)."""
        out: dict[str, str] = {}
        for k in ("reason", "action", "risk_min", "risk_max", "current", "group"):
            v = getattr(self, k)
            if v is not None:
                out[k] = f"{v:g}" if isinstance(v, float) else str(v)
        if self.labelled is not None:
            out["labelled"] = "true" if self.labelled else "false"
        if not self.unlabelled_first:
            out["unlabelled_first"] = "false"
        return out

    def query(self, **extra: Any) -> str:
        """``?...`` for a link carrying these filters (empty when there are none)."""
        params = {**self.params(), **{k: str(v) for k, v in extra.items() if v is not None}}
        return "?" + urlencode(params) if params else ""


class QueuePage(Filters):
    page: int = Field(1, ge=1, le=1_000_000)
    done: bool = False

    @field_validator("page", mode="before")
    @classmethod
    def _page_default(cls, value: Any) -> Any:
        return 1 if _blank_is_none(value) is None else value

    @field_validator("done", mode="before")
    @classmethod
    def _done_default(cls, value: Any) -> Any:
        return False if _blank_is_none(value) is None else value


class ItemPage(Filters):
    prev: str | None = Field(None, max_length=MAX_ID)

    _prev_blank = field_validator("prev", mode="before")(_blank_is_none)


class LabelForm(Filters):
    """The label form, carrying the queue's filters. ``csrf`` is checked before anything else
    (see ``security``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: Label
    note: str | None = Field(None, max_length=MAX_NOTE)
    corrected: str | None = Field(None, max_length=MAX_CORRECTED)
    csrf: str = Field(max_length=200)

    _text_blank = field_validator("note", "corrected", mode="before")(_blank_is_none)


class ReviewerForm(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reviewer: str = Field(min_length=1, max_length=MAX_REVIEWER)
    csrf: str = Field(max_length=200)

    @field_validator("reviewer", mode="before")
    @classmethod
    def _name(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value

    @field_validator("reviewer")
    @classmethod
    def _printable(cls, value: str) -> str:
        return reviewer_name(value)


class ExportQuery(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    since: datetime | None = None

    _since_blank = field_validator("since", mode="before")(_blank_is_none)


def reviewer_name(value: str) -> str:
    """A reviewer name as stored with every label: printable, one line, at most 64 characters."""
    value = value.strip()
    if not value or len(value) > MAX_REVIEWER or not value.isprintable():
        raise ValueError(f"a reviewer name is 1 to {MAX_REVIEWER} printable characters on one line")
    return value


def check_request_id(request_id: str) -> str:
    if not request_id or len(request_id) > MAX_ID or not request_id.isprintable():
        raise PageError(400, f"request id must be 1 to {MAX_ID} printable characters", param="request_id",
                        code="invalid_value")
    return request_id


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``model`` from ``data``, or a 400 that names the first bad field and what it accepts."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err.get("loc", ())) or None
        given = err.get("input")
        shown = f" (got {str(given)[:60]!r})" if isinstance(given, str | int | float) else ""
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "literal_error":
            choices = {"label": LABELS, "current": LABELS, "reason": REASONS,
                       "action": ACTIONS}.get(field or "")
            if choices:
                msg = f"must be one of {', '.join(choices)}"
        if err.get("type") == "extra_forbidden":
            msg = "is not a field of this form"
        raise PageError(400, f"{field}: {msg}{shown}" if field else f"{msg}{shown}", param=field,
                        code="invalid_value") from None


def parse_form(body: bytes, content_type: str) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body as a dict; a field given twice is refused
    (which value would count is a guess an attacker could steer)."""
    if content_type.split(";")[0].strip().lower() != "application/x-www-form-urlencoded":
        raise PageError(415, "forms are accepted as application/x-www-form-urlencoded only",
                        code="unsupported_media_type")
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False,
                          max_num_fields=64)
    except UnicodeDecodeError:
        raise PageError(400, "the form is not UTF-8", code="invalid_value") from None
    except ValueError:
        raise PageError(400, "the form has too many fields", code="invalid_value") from None
    out: dict[str, str] = {}
    for key, value in pairs:
        if key in out:
            raise PageError(400, f"{key}: given more than once", param=key, code="invalid_value")
        out[key] = value
    return out
