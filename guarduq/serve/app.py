"""The FastAPI app: OpenAI chat completions, guarded, plus scoring, health and metrics.

``create_app(guard, settings=Settings(...))`` builds it around a loaded ``Guard``; the CLI
(``guarduq serve``) runs it under uvicorn. Every error is a JSON body
``{"error": {"message", "type", "param", "code"}}``; bad input is a 4xx, never a 500.
Prompts and replies reach no log line and no metric label; the audit log stores them only when
the policy says ``audit: {log_text: true}``. ``POST /admin/reload`` (and SIGHUP, ``--watch``: see
``serve/reload.py``) swaps the policy and calibrator between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from guarduq import layout
from guarduq._http import read_limited
from guarduq._logging import get_logger
from guarduq.calibration import Calibrator
from guarduq.calibration.drift import DriftMonitor, Reference
from guarduq.decider import Decider
from guarduq.errors import GuardUQError, InputError, ReloadError
from guarduq.guard import Guard, GuardedResponse
from guarduq.policy.audit import json_line
from guarduq.policy.context import group_of
from guarduq.serve import tracing
from guarduq.serve.engine import Cancelled, Engine, Job, QueueFull
from guarduq.serve.metrics import ServerMetrics
from guarduq.serve.reload import Reloader, install_sighup
from guarduq.serve.schema import (
    ApiError,
    ChatRequest,
    ScoreRequest,
    completion_id,
    now,
    to_prompt,
    unsupported,
    validation_error,
)

log = get_logger("serve")


@dataclass(frozen=True)
class Settings:
    """Limits and switches of one server. ``model_ids``: names accepted in ``model`` (the first
    is listed by /v1/models; default: the Guard's model name)."""

    model_ids: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()  # /admin/*; none: those answer 403
    reload_on_sighup: bool = False  # installed only where the loop runs on the main thread
    watch_s: float | None = None  # poll the policy/calibrator files this often; reload on change
    max_queue: int = 64
    retry_after_s: int = 1
    max_body_bytes: int = 1_000_000
    max_messages: int = 64
    max_prompt_chars: int = 32_000
    max_prompt_tokens: int = 4096
    max_tokens: int = 512
    default_max_tokens: int | None = None  # None: the Guard's max_new_tokens
    batching: bool = True
    max_batch: int = 8
    batch_wait_s: float = 0.005
    drift_reference: Reference | None = None
    drift_window: int = 500
    drift_min_n: int = 50
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # under the request's


class _Json(JSONResponse):
    """Strict JSON with NaN/inf as null (an invalid score is NaN; JSON cannot spell it)."""

    def render(self, content: Any) -> bytes:
        return json_line(content).rstrip(b"\n")


def _error(exc: ApiError) -> _Json:
    return _Json(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(guard: Guard, *, settings: Settings | None = None) -> FastAPI:
    """The server around ``guard`` (already loaded: /readyz is true once the worker runs)."""
    s = settings or Settings()
    model_ids = s.model_ids or (guard.info.name,)
    metrics = ServerMetrics()
    tracer = tracing.make_tracer()
    live = _Live(_drift_monitor(guard.calibrator, s))  # the worker swaps it with the calibrator
    guard.drift = live.drift  # the case the policy's on_drift acts on

    def on_done(job: Job, r: GuardedResponse) -> None:
        metrics.observe_response(job.kind if job.kind == "score" else "chat", r)
        tracing.record(tracer, job.kind, job.started_ns, r)
        drift = live.drift
        if drift is not None and r.scores.valid:
            drift.observe(r.scores.to_dict(with_token_probs=False))
            metrics.observe_drift(drift.snapshot(), drift.case())

    def on_start(jobs: list[Job]) -> None:
        metrics.batch_size.observe(len(jobs))
        t = time.perf_counter()
        for j in jobs:
            metrics.queue_wait_seconds.observe(t - j.enqueued)

    engine = Engine(guard, max_queue=s.max_queue, batching=s.batching, max_batch=s.max_batch,
                    batch_wait_s=s.batch_wait_s, on_done=on_done, on_depth=metrics.queue_depth.set,
                    on_start=on_start)

    def new_drift(old: Decider, new: Decider) -> Callable[[], None] | None:
        """A new calibrator brings its own drift reference (unless --reference was given)."""
        if s.drift_reference is not None or old.identity.calibrator_sha256 == new.identity.calibrator_sha256:
            return None
        monitor = _drift_monitor(new.calibrator, s)

        def apply() -> None:
            live.drift = app.state.drift = guard.drift = monitor
            if monitor is not None:
                metrics.observe_drift(monitor.snapshot(), monitor.case())
        return apply

    reloader = Reloader(guard, engine, metrics, prepare=new_drift)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        on = reloader.available
        remove = install_sighup(reloader) if on and s.reload_on_sighup else None
        watcher = asyncio.ensure_future(reloader.watch(s.watch_s)) if on and s.watch_s else None
        try:
            yield
        finally:
            if remove is not None:
                remove()
            if watcher is not None:
                watcher.cancel()
            engine.close()
            traffic = getattr(guard, "traffic", None)
            if traffic is not None:  # the store's writer catches up before the process ends
                traffic.flush(10.0)

    app = FastAPI(title="guarduq", version=_version(), docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.guard, app.state.engine, app.state.metrics, app.state.drift = guard, engine, metrics, live.drift
    app.state.settings, app.state.reloader = s, reloader
    if live.drift is not None:
        metrics.observe_drift(live.drift.snapshot(), live.drift.case())

    # -- errors: one body shape for all of them

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> _Json:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> _Json:
        return _error(ApiError(400, str(exc.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> _Json:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(exc.status_code, str(exc.detail), type=kind,
                               headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> _Json:
        log.error("serve_unexpected_error", path=request.url.path, error=type(exc).__name__)
        return _error(ApiError(500, "internal server error", type="server_error"))

    app.add_middleware(_Count, metrics=metrics)

    def authorize(request: Request) -> None:
        if s.api_keys and not _bearer_ok(request, s.api_keys):
            metrics.rejected.labels("auth").inc()
            raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                           type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def authorize_admin(request: Request) -> None:
        if not s.admin_keys:
            raise ApiError(403, "admin endpoints are disabled (no --admin-key-env)", type="permission_error",
                           code="admin_disabled")
        if not _bearer_ok(request, s.admin_keys):
            metrics.rejected.labels("admin_auth").inc()
            raise ApiError(401, "missing or invalid admin key (Authorization: Bearer <admin key>)",
                           type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    # -- endpoints

    @app.get("/healthz")
    async def healthz() -> _Json:
        return _Json({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> _Json:
        ready = engine.alive
        case = live.drift.case() if live.drift is not None else None
        return _Json({"status": "ready" if ready else "not ready", "model": model_ids[0],
                      "queue_depth": engine.depth(), **_pair(guard).identity.to_dict(),
                      "drift_case": case.label if case is not None else None},
                     status_code=200 if ready else 503)

    @app.post("/admin/reload")
    async def admin_reload(request: Request) -> _Json:
        """Re-read the policy and calibrator files the server started with (the body is ignored:
        no path comes from the network) and swap them in between requests."""
        authorize_admin(request)
        if not reloader.available:
            raise ApiError(501, "this Guard cannot reload", type="server_error", code="reload_unsupported")
        try:
            result = await reloader.areload("http")
        except ReloadError as exc:
            raise ApiError(422, str(exc), code="reload_failed") from None
        return _Json(result.to_dict())

    @app.get("/metrics")
    async def metrics_text(request: Request) -> Response:
        authorize(request)
        metrics.queue_depth.set(engine.depth())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> _Json:
        authorize(request)
        pair = _pair(guard)
        return _Json({"object": "list", "data": [{
            "id": model_ids[0], "object": "model", "created": now(), "owned_by": "guarduq",
            "guarduq": {"model_fingerprint": guard.info.fingerprint, **pair.identity.to_dict(),
                        "policy_mode": pair.policy.config.mode if pair.policy is not None else None},
        }]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        req = _parse(ChatRequest, await _read_body(request, s.max_body_bytes))
        _check_model(req.model, model_ids)
        if (bad := unsupported(req)) is not None:
            raise bad
        prompt = _checked_prompt(req.messages, s, guard)
        gen, max_new = _generation(req, s, guard)
        n_prompt = _check_tokens(guard, prompt, max_new, s)
        kind = "stream" if req.stream else "generate"
        job = Job(kind, prompt, gen=gen, stop=req.stop, seed=req.seed,
                  group=group_of(guard.policy, req.traffic_group()))
        if not req.stream:
            r = await _wait(request, _submit(engine, job, s, metrics), metrics)
            return _Json(_completion(req, model_ids[0], r, guard, n_prompt, max_new), headers=_header(r))
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        job.push = lambda item: loop.call_soon_threadsafe(items.put_nowait, item)
        _submit(engine, job, s, metrics)
        return StreamingResponse(_sse(req, model_ids[0], job, items, guard, n_prompt, max_new, metrics),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/guarduq/score")
    async def score(request: Request) -> _Json:
        authorize(request)
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
        job = Job("score", prompt, response=req.response, ended=req.ended)
        r = await _wait(request, _submit(engine, job, s, metrics), metrics)
        return _Json({"object": "guarduq.score", "model": model_ids[0], "shown_text": r.shown_text,
                      "guarduq": _guarduq(r)}, headers=_header(r))

    return app


# --------------------------------------------------------------------------- request handling


@dataclass
class _Live:
    """What a reload swaps besides the Guard's pair (on the worker thread, with it)."""

    drift: DriftMonitor | None


def _pair(guard: Any) -> Decider:
    """The Guard's policy/calibrator pair in force (a stand-in Guard: built from its attributes)."""
    pair = getattr(guard, "decider", None)
    return pair if isinstance(pair, Decider) else Decider(guard.policy, guard.calibrator)


def _bearer_ok(request: Request, keys: tuple[str, ...]) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    ok = False
    for key in keys:  # every key is compared, in constant time each
        ok |= hmac.compare_digest(given, key.encode())
    return ok


class _Count:
    """Requests by route and status, and their latency (plain ASGI: streaming stays intact)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [500]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)


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
        raise _guard_error(exc) from None
    finally:
        gone.cancel()


async def _disconnect(request: Request) -> None:
    """Returns when the server reports the client gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _guard_error(exc: GuardUQError) -> ApiError:
    if isinstance(exc, InputError):
        return ApiError(400, str(exc), code="invalid_value")
    log.error("serve_guard_error", error=type(exc).__name__, message=str(exc)[:300])
    return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error")


# --------------------------------------------------------------------------- responses


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


def _guarduq(r: GuardedResponse) -> dict[str, Any]:
    return r.metadata("model")  # NaN scores (an invalid reply) become null in _Json


def _header(r: GuardedResponse) -> dict[str, str]:
    """``x-guarduq``: the verdict in one header, for clients that drop unknown body fields
    (LangChain's ChatOpenAI shows it with ``include_response_headers=True``)."""
    d = r.decision
    brief = {"request_id": r.request_id, "ended": r.ended, "epistemic": r.scores.epistemic,
             "aleatoric": r.scores.aleatoric, "risk": r.risk, "action": d.action if d else None,
             "rule": d.rule if d else None, "shown": d.shown if d else True}
    return {"x-guarduq": json.dumps(_finite_json(brief), ensure_ascii=True, separators=(",", ":"))}


def _finite_json(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _completion(req: ChatRequest, model: str, r: GuardedResponse, guard: Guard, n_prompt: int,
                max_new: int) -> dict[str, Any]:
    usage = _usage(guard, r, n_prompt)
    return {
        "id": completion_id(), "object": "chat.completion", "created": now(), "model": model,
        "system_fingerprint": guard.info.fingerprint,
        "choices": [{"index": 0, "finish_reason": _finish_reason(req, r, usage, max_new), "logprobs": None,
                     "message": {"role": "assistant", "content": r.shown_text, "refusal": None}}],
        "usage": usage,
        "guarduq": _guarduq(r),
    }


async def _sse(req: ChatRequest, model: str, job: Job, items: asyncio.Queue[Any], guard: Guard,
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
                    policy = (job.decider if isinstance(job.decider, Decider) else _pair(guard)).policy
                    live = policy is None or policy.shadow
                if live:
                    yield chunk({"content": item})
                continue
            if isinstance(item, BaseException):
                err = _guard_error(item) if isinstance(item, GuardUQError) else \
                    ApiError(500, "generation failed", type="server_error")
                yield b"data: " + json_line(err.body()).rstrip(b"\n") + b"\n\n"
                break
            r: GuardedResponse = item
            usage = _usage(guard, r, n_prompt)
            if not live and r.shown_text:
                yield chunk({"content": r.shown_text})
            yield chunk({}, _finish_reason(req, r, usage, max_new), guarduq=_guarduq(r))
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


def _drift_monitor(calibrator: Calibrator | None, s: Settings) -> DriftMonitor | None:
    from guarduq.calibration.drift import reference_from_artifact
    from guarduq.errors import CalibrationError

    ref = s.drift_reference
    if ref is None and calibrator is not None:
        try:
            ref = reference_from_artifact(calibrator.to_dict(), "calibrator")
        except CalibrationError as exc:
            log.warning("drift_disabled", reason=str(exc))
    if ref is None:
        return None
    return DriftMonitor(ref, window=s.drift_window, min_n=s.drift_min_n)


def _version() -> str:
    import guarduq

    return guarduq.__version__
