"""The FastAPI app: OpenAI chat completions, guarded, plus scoring, health and metrics.

``create_app(guard, settings=Settings(...))`` builds it around a loaded ``Guard``; the CLI
(``guarduq serve``) runs it under uvicorn. Every error is a JSON body
``{"error": {"message", "type", "param", "code"}}``; bad input is a 4xx, never a 500.
Prompts and replies reach no log line and no metric label; the audit log stores them only when
the policy says ``audit: {log_text: true}``. ``POST /admin/reload`` (and SIGHUP, ``--watch``: see
``serve/reload.py``) swaps the policy and calibrator between requests.

This module wires the parts together; the routes live by what they serve: ``v1.py`` (/v1),
``ops.py`` (health, readiness, metrics, reload), ``replies.py`` (completion bodies and SSE),
``security.py`` (keys per door, this machine only without a key), ``context.py`` (``Settings``
and what every route shares).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from guarduq._logging import get_logger
from guarduq.calibration import Calibrator
from guarduq.calibration.drift import DriftMonitor
from guarduq.decider import Decider
from guarduq.guard import Guard, GuardedResponse
from guarduq.serve import tracing
from guarduq.serve.context import Json, Server, Settings, error_response
from guarduq.serve.engine import Engine, Job
from guarduq.serve.metrics import ServerMetrics
from guarduq.serve.ops import add_ops_routes
from guarduq.serve.reload import Reloader, install_sighup
from guarduq.serve.schema import ApiError
from guarduq.serve.security import LoopbackOnly
from guarduq.serve.v1 import add_openai_routes

__all__ = ["Settings", "create_app"]

log = get_logger("serve")


def create_app(guard: Guard, *, settings: Settings | None = None) -> FastAPI:
    """The server around ``guard`` (already loaded: /readyz is true once the worker runs)."""
    s = settings or Settings()
    metrics = ServerMetrics()
    tracer = tracing.make_tracer()
    srv = Server(guard, s, s.model_ids or (guard.info.name,), None, metrics, None,
                 _drift_monitor(guard.calibrator, s))  # the worker swaps drift with the calibrator
    guard.drift = srv.drift  # the case the policy's on_drift acts on

    def on_done(job: Job, r: GuardedResponse) -> None:
        metrics.observe_response(job.kind if job.kind == "score" else "chat", r)
        tracing.record(tracer, job.kind, job.started_ns, r)
        drift = srv.drift
        if drift is not None and r.scores.valid:
            drift.observe(r.scores.to_dict(with_token_probs=False))
            metrics.observe_drift(drift.snapshot(), drift.case())

    def on_start(jobs: list[Job]) -> None:
        metrics.batch_size.observe(len(jobs))
        t = time.perf_counter()
        for j in jobs:
            metrics.queue_wait_seconds.observe(t - j.enqueued)

    srv.engine = engine = Engine(guard, max_queue=s.max_queue, batching=s.batching, max_batch=s.max_batch,
                                 batch_wait_s=s.batch_wait_s, on_done=on_done, on_depth=metrics.queue_depth.set,
                                 on_start=on_start)

    def new_drift(old: Decider, new: Decider) -> Callable[[], None] | None:
        """A new calibrator brings its own drift reference (unless --reference was given)."""
        if s.drift_reference is not None or old.identity.calibrator_sha256 == new.identity.calibrator_sha256:
            return None
        monitor = _drift_monitor(new.calibrator, s)

        def apply() -> None:
            srv.drift = app.state.drift = guard.drift = monitor
            if monitor is not None:
                metrics.observe_drift(monitor.snapshot(), monitor.case())
        return apply

    srv.reloader = reloader = Reloader(guard, engine, metrics, prepare=new_drift)

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
    app.state.guard, app.state.engine, app.state.metrics, app.state.drift = guard, engine, metrics, srv.drift
    app.state.settings, app.state.reloader, app.state.server = s, reloader, srv
    if srv.drift is not None:
        metrics.observe_drift(srv.drift.snapshot(), srv.drift.case())
    _add_error_handlers(app)
    if not s.api_keys and not s.allow_unauthenticated_remote:
        app.add_middleware(LoopbackOnly, metrics=metrics)  # every route, a mounted review page too
    app.add_middleware(_Count, metrics=metrics)
    add_ops_routes(app, srv)
    add_openai_routes(app, srv)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """One body shape for every error: ``{"error": {"message", "type", "param", "code"}}``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Json:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Json:
        return error_response(ApiError(400, str(exc.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Json:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), type=kind,
                                       headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Json:
        log.error("serve_unexpected_error", path=request.url.path, error=type(exc).__name__)
        return error_response(ApiError(500, "internal server error", type="server_error"))


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
    # a window shorter than min_n (--drift-window 20) reads once it is full, rather than refusing to start
    return DriftMonitor(ref, window=s.drift_window, min_n=min(s.drift_min_n, s.drift_window))


def _version() -> str:
    import guarduq

    return guarduq.__version__
