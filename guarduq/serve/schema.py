"""The wire format: OpenAI chat-completions requests in, guarduq-annotated responses out.

Unknown top-level fields are **ignored**, as most OpenAI-compatible servers do: clients
(LangChain, the ``openai`` SDK) add fields of their own (``store``, ``metadata``,
``service_tier``...). Fields that ask for a feature guarduq does not have (tools, ``n > 1``,
images, logprobs, penalties, JSON mode) are refused with a 400 naming the field, never dropped
silently: the client would otherwise get an answer to a different question.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from guarduq.errors import PolicyError
from guarduq.policy.context import check_group

ROLE_MAP = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An error with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, refusal, ... are accepted and unused
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=512)
    messages: list[Message]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = Field(None, max_length=512)
    metadata: dict[str, Any] | None = None  # metadata.group: the reply's traffic group (its certificate)
    # Features guarduq does not have; a value that asks for them is refused (see unsupported()).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Any = None
    logit_bias: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    audio: Any = None
    modalities: Any = None

    @field_validator("metadata")
    @classmethod
    def _group(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            check_group((v or {}).get("group"))
        except PolicyError as exc:
            raise ValueError(f"metadata.group: {exc}") from None
        return v

    def traffic_group(self) -> str | None:
        """``metadata.group``, stripped (None: not given)."""
        return check_group((self.metadata or {}).get("group"))

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or not all(stops)):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops or None


class ScoreRequest(BaseModel):
    """``POST /v1/guarduq/score``: a reply produced elsewhere, and whether it ended its turn."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, max_length=512)
    messages: list[Message]
    response: str
    ended: bool = True


def unsupported(req: ChatRequest) -> ApiError | None:
    """The first feature the request asks for that the server cannot honour."""
    checks: list[tuple[str, bool, str]] = [
        ("n", req.n != 1, "only n=1 is supported"),
        ("tools", bool(req.tools), "tools are not supported"),
        ("tool_choice", req.tool_choice not in (None, "none"), "tool_choice is not supported"),
        ("functions", bool(req.functions), "functions are not supported"),
        ("function_call", req.function_call not in (None, "none"), "function_call is not supported"),
        ("logprobs", bool(req.logprobs), "logprobs are not supported"),
        ("top_logprobs", bool(req.top_logprobs), "top_logprobs are not supported"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
        ("presence_penalty", bool(req.presence_penalty), "presence_penalty is not supported"),
        ("frequency_penalty", bool(req.frequency_penalty), "frequency_penalty is not supported"),
        ("audio", req.audio is not None, "audio output is not supported"),
        ("modalities", req.modalities not in (None, ["text"]), "only the text modality is supported"),
        ("response_format", not _text_format(req.response_format),
         "response_format other than {'type': 'text'} is not supported"),
    ]
    for param, bad, message in checks:
        if bad:
            return ApiError(400, message, param=param, code="unsupported_parameter")
    return None


def _text_format(fmt: Any) -> bool:
    return fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")


def to_prompt(messages: list[Message], *, field: str = "messages") -> list[dict[str, str]]:
    """guarduq chat messages from the request's, or an ``ApiError`` naming the bad part."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param=field, code="empty_messages")
    out = []
    for i, m in enumerate(messages):
        role = ROLE_MAP.get(m.role)
        if role is None:
            raise ApiError(400, f"role {m.role!r} is not supported (use system, developer, user or assistant)",
                           param=f"{field}[{i}].role", code="unsupported_role")
        extra = m.model_extra or {}
        for key in ("tool_calls", "function_call", "audio"):
            if extra.get(key):
                raise ApiError(400, f"{key} in messages is not supported", param=f"{field}[{i}].{key}",
                               code="unsupported_parameter")
        out.append({"role": role, "content": _text(m, f"{field}[{i}].content")})
    if not any(m["content"].strip() for m in out):
        raise ApiError(400, "messages have no text content", param=field, code="empty_messages")
    return out


def _text(m: Message, where: str) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content part of type {part.type!r} is not supported (text only)",
                           param=f"{where}[{j}]", code="unsupported_content")
        parts.append(part.text)
    return "".join(parts)


def validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the field (``messages[0].role``)."""
    first = exc.errors(include_url=False)[0]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    return ApiError(400, f"{param or 'body'}: {first['msg']}", param=param or None, code="invalid_value")


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "content_filter"]
