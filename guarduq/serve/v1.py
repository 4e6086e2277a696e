"""The OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/guarduq/score`` and
``GET /v1/models`` (API keys), and the checks a request passes before it reaches the queue."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from guarduq import layout
from guarduq._http import read_limited
from guarduq.errors import GuardUQError, InputError
from guarduq.guard import Guard, GuardedResponse
from guarduq.policy.context import group_of
from guarduq.serve.context import Json, Server, Settings
from guarduq.serve.engine import Cancelled, Engine, Job, QueueFull
from guarduq.serve.metrics import ServerMetrics
from guarduq.serve.replies import (
    completion_body,
    guard_error,
    guarduq_object,
    sse_stream,
    verdict_header,
)
from guarduq.serve.schema import (
    ApiError,
    ChatRequest,
    ScoreRequest,
    now,
    to_prompt,
    unsupported,
    validation_error,
)
from guarduq.serve.security import authorize


def add_openai_routes(app: FastAPI, srv: Server) -> None:
    """The /v1 routes of ``srv``; every one takes an API key when the server has any."""
    s, guard, engine, metrics, model_ids = srv.settings, srv.guard, srv.engine, srv.metrics, srv.model_ids

    @app.get("/v1/models")
    async def models(request: Request) -> Json:
        authorize(request, s.api_keys, metrics)
        pair = srv.pair()
        return Json({"object": "list", "data": [{
            "id": model_ids[0], "object": "model", "created": now(), "owned_by": "guarduq",
            "guarduq": {"model_fingerprint": guard.info.fingerprint, **pair.identity.to_dict(),
                        "policy_mode": pair.policy.config.mode if pair.policy is not None else None},
        }]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        key_name = authorize(request, s.api_keys, metrics, s.api_key_names)
        req = _parse(ChatRequest, await _read_body(request, s.max_body_bytes))
        _check_model(req.model, model_ids)
        if (bad := unsupported(req)) is not None:
            raise bad
        prompt = _checked_prompt(req.messages, s, guard)
        gen, max_new = _generation(req, s, guard)
        n_prompt = _check_tokens(guard, prompt, max_new, s)
        kind = "stream" if req.stream else "generate"
        job = Job(kind, prompt, gen=gen, stop=req.stop, seed=req.seed,
                  group=group_of(srv.pair().policy, req.traffic_group(), key_name=key_name))
        if not req.stream:
            r = await _wait(request, _submit(engine, job, s, metrics), metrics)
            return Json(completion_body(req, model_ids[0], r, guard, n_prompt, max_new), headers=verdict_header(r))
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        job.push = lambda item: loop.call_soon_threadsafe(items.put_nowait, item)
        _submit(engine, job, s, metrics)
        return StreamingResponse(sse_stream(req, model_ids[0], job, items, guard, n_prompt, max_new, metrics),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/guarduq/score")
    async def score(request: Request) -> Json:
        key_name = authorize(request, s.api_keys, metrics, s.api_key_names)
        req = _parse(ScoreRequest, await _read_body(request, s.max_body_bytes))
        if req.model is not None:
            _check_model(req.model, model_ids)
        prompt = _checked_prompt(req.messages, s, guard)
        if not req.response.strip():
            raise ApiError(400, "response must not be empty", param="response", code="invalid_value")
        if len(req.response) > s.max_prompt_chars:
            raise ApiError(400, f"response is longer than {s.max_prompt_chars} characters",
                           param="response", code="response_too_long")
        _check_tokens(guard, prompt, 0, s)
        job = Job("score", prompt, response=req.response, ended=req.ended,
                  group=group_of(srv.pair().policy, key_name=key_name))
        r = await _wait(request, _submit(engine, job, s, metrics), metrics)
        return Json({"object": "guarduq.score", "model": model_ids[0], "shown_text": r.shown_text,
                     "guarduq": guarduq_object(r)}, headers=verdict_header(r))


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    return await read_limited(request, limit, lambda msg: ApiError(413, msg, code="body_too_large"))


def _parse(model: Any, body: bytes) -> Any:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _check_model(name: str, model_ids: tuple[str, ...]) -> None:
    if name not in model_ids:
        raise ApiError(404, f"model {name[:100]!r} is not served here (served: {', '.join(model_ids)})",
                       param="model", code="model_not_found", type="not_found_error")


def _checked_prompt(messages: Any, s: Settings, guard: Guard) -> list[dict[str, str]]:
    if len(messages) > s.max_messages:
        raise ApiError(400, f"{len(messages)} messages; at most {s.max_messages} are accepted",
                       param="messages", code="too_many_messages")
    prompt = to_prompt(messages)
    chars = sum(len(m["content"]) for m in prompt)
    if chars > s.max_prompt_chars:
        raise ApiError(400, f"the messages hold {chars} characters; at most {s.max_prompt_chars}",
                       param="messages", code="prompt_too_long")
    return prompt


def _generation(req: ChatRequest, s: Settings, guard: Guard) -> tuple[dict[str, Any], int]:
    """Guard generation kwargs: temperature 0 or omitted -> greedy (the Guard's default, not
    OpenAI's 1.0); > 0 -> sampling at that temperature with ``top_p`` (no top-k cut)."""
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree", param="max_tokens",
                       code="invalid_value")
    asked = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_new = asked or min(s.default_max_tokens or guard.max_new_tokens, s.max_tokens)
    if max_new > s.max_tokens:
        raise ApiError(400, f"{param} is {max_new}; this server allows at most {s.max_tokens}",
                       param=param, code="max_tokens_too_large")
    gen: dict[str, Any] = {**s.generation_defaults, "max_new_tokens": max_new}
    if req.temperature:
        gen.update(do_sample=True, temperature=float(req.temperature), top_k=0)
        if req.top_p is not None and req.top_p < 1.0:
            gen["top_p"] = float(req.top_p)
    return gen, max_new


def _check_tokens(guard: Guard, prompt: list[dict[str, str]], max_new: int, s: Settings) -> int:
    try:
        n = len(layout.prompt_ids(guard.tokenizer, prompt))
    except InputError as exc:
        raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
    if n > s.max_prompt_tokens:
        raise ApiError(400, f"the prompt is {n} tokens; at most {s.max_prompt_tokens}",
                       param="messages", code="context_length_exceeded")
    limit = layout.context_length(guard.model)
    if limit is not None and n + max(max_new, 1) > limit:
        raise ApiError(400, f"prompt ({n} tokens) + max_tokens ({max_new}) exceed the model's context "
                       f"of {limit}", param="messages", code="context_length_exceeded")
    return n


def _submit(engine: Engine, job: Job, s: Settings, metrics: ServerMetrics) -> Job:
    try:
        return engine.submit(job)
    except QueueFull as exc:
        metrics.rejected.labels("queue_full").inc()
        raise ApiError(429, f"server busy: {exc}; retry later", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": str(s.retry_after_s)}) from None


async def _wait(request: Request, job: Job, metrics: ServerMetrics) -> GuardedResponse:
    """The job's response; a client that disconnects meanwhile cancels it (event-driven: no
    polling, which would take the GIL from the generating thread many times a second)."""
    fut = asyncio.wrap_future(job.future)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
        if fut not in done:
            job.cancel()
            metrics.cancelled.inc()
            raise ApiError(499, "client closed the request", code="client_closed")
        return fut.result()
    except Cancelled:
        raise ApiError(499, "client closed the request", code="client_closed") from None
    except asyncio.CancelledError:
        job.cancel()
        raise
    except GuardUQError as exc:
        raise guard_error(exc) from None
    finally:
        gone.cancel()


async def _disconnect(request: Request) -> None:
    """Returns when the server reports the client gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
