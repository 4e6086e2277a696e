"""What the server answers: chat completions, SSE chunks and the ``x-guarduq`` header, each
carrying the reply's ``guarduq`` object (scores, risk, decision, the pair that decided)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any

from guarduq._logging import get_logger
from guarduq.decider import Decider
from guarduq.errors import GuardUQError, InputError
from guarduq.guard import Guard, GuardedResponse
from guarduq.policy.audit import json_line
from guarduq.serve.context import pair_of
from guarduq.serve.engine import Job
from guarduq.serve.metrics import ServerMetrics
from guarduq.serve.schema import ApiError, ChatRequest, completion_id, now

log = get_logger("serve")


def guard_error(exc: GuardUQError) -> ApiError:
    if isinstance(exc, InputError):
        return ApiError(400, str(exc), code="invalid_value")
    log.error("serve_guard_error", error=type(exc).__name__, message=str(exc)[:300])
    return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error")


def _usage(guard: Guard, r: GuardedResponse, n_prompt: int) -> dict[str, int]:
    n_out = len(guard.tokenizer(r.text, add_special_tokens=False)["input_ids"]) + int(r.ended)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _finish_reason(req: ChatRequest, r: GuardedResponse, usage: dict[str, int], max_new: int) -> str:
    """content_filter: the policy withheld the reply; stop: the model ended it or a stop string
    did; length: max_tokens cut it (inferred from the token count, as Guard reports ``ended``)."""
    if r.decision is not None and not r.decision.shown:
        return "content_filter"
    if r.ended or (req.stop and usage["completion_tokens"] < max_new):
        return "stop"
    return "length"


def guarduq_object(r: GuardedResponse) -> dict[str, Any]:
    return r.metadata("model")  # NaN scores (an invalid reply) become null in _Json


def verdict_header(r: GuardedResponse) -> dict[str, str]:
    """``x-guarduq``: the verdict in one header, for clients that drop unknown body fields
    (LangChain's ChatOpenAI shows it with ``include_response_headers=True``)."""
    d = r.decision
    brief = {"request_id": r.request_id, "ended": r.ended, "epistemic": r.scores.epistemic,
             "aleatoric": r.scores.aleatoric, "risk": r.risk, "action": d.action if d else None,
             "rule": d.rule if d else None, "shown": d.shown if d else True}
    return {"x-guarduq": json.dumps(_finite_json(brief), ensure_ascii=True, separators=(",", ":"))}


def _finite_json(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def completion_body(req: ChatRequest, model: str, r: GuardedResponse, guard: Guard, n_prompt: int,
                max_new: int) -> dict[str, Any]:
    usage = _usage(guard, r, n_prompt)
    return {
        "id": completion_id(), "object": "chat.completion", "created": now(), "model": model,
        "system_fingerprint": guard.info.fingerprint,
        "choices": [{"index": 0, "finish_reason": _finish_reason(req, r, usage, max_new), "logprobs": None,
                     "message": {"role": "assistant", "content": r.shown_text, "refusal": None}}],
        "usage": usage,
        "guarduq": guarduq_object(r),
    }


async def sse_stream(req: ChatRequest, model: str, job: Job, items: asyncio.Queue[Any], guard: Guard,
               n_prompt: int, max_new: int, metrics: ServerMetrics) -> AsyncIterator[bytes]:
    """SSE chunks. Enforce mode holds the text back until the policy decided (a withheld answer
    never reaches the client); shadow mode or no policy streams it live."""
    cid, created = completion_id(), now()
    live: bool | None = None  # known once the worker started the job (its pair decides the reply)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": guard.info.fingerprint,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return b"data: " + json_line(body).rstrip(b"\n") + b"\n\n"

    finished = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            item = await items.get()
            if isinstance(item, str):
                if live is None:
                    policy = (job.decider if isinstance(job.decider, Decider) else pair_of(guard)).policy
                    live = policy is None or policy.shadow
                if live:
                    yield chunk({"content": item})
                continue
            if isinstance(item, BaseException):
                err = guard_error(item) if isinstance(item, GuardUQError) else \
                    ApiError(500, "generation failed", type="server_error")
                yield b"data: " + json_line(err.body()).rstrip(b"\n") + b"\n\n"
                break
            r: GuardedResponse = item
            usage = _usage(guard, r, n_prompt)
            if not live and r.shown_text:
                yield chunk({"content": r.shown_text})
            yield chunk({}, _finish_reason(req, r, usage, max_new), guarduq=guarduq_object(r))
            if req.stream_options is not None and req.stream_options.include_usage:
                body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": usage}
                yield b"data: " + json_line(body).rstrip(b"\n") + b"\n\n"
            break
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away mid-stream: stop the generation
            job.cancel()
            metrics.cancelled.inc()
