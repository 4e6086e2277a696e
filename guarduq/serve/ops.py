"""The operator's routes: ``/healthz``, ``/readyz``, ``/metrics`` (API keys) and
``POST /admin/reload`` (admin keys; ``?force=true`` takes a pair that certifies no threshold)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from guarduq.errors import ReloadError
from guarduq.serve.context import Json, Server
from guarduq.serve.reload import UncertifiedPairError
from guarduq.serve.schema import ApiError
from guarduq.serve.security import authorize, authorize_admin

_FLAGS = {"true": True, "1": True, "false": False, "0": False}


def add_ops_routes(app: FastAPI, srv: Server) -> None:
    s, engine, metrics, reloader = srv.settings, srv.engine, srv.metrics, srv.reloader

    @app.get("/healthz")
    async def healthz() -> Json:
        return Json({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Json:
        ready = engine.alive
        case = srv.drift.case() if srv.drift is not None else None
        return Json({"status": "ready" if ready else "not ready", "model": srv.model_ids[0],
                     "queue_depth": engine.depth(), **srv.pair().identity.to_dict(),
                     "drift_case": case.label if case is not None else None},
                    status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_text(request: Request) -> Response:
        authorize(request, s.api_keys, metrics)
        metrics.queue_depth.set(engine.depth())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/admin/reload")
    async def admin_reload(request: Request) -> Json:
        """Re-read the policy and calibrator files the server started with (the body is ignored:
        no path comes from the network) and swap them in between requests. A pair under which a
        threshold rule can never match is refused with a 422 unless ``?force=true``."""
        authorize_admin(request, s.admin_keys, metrics)
        force = _FLAGS.get(request.query_params.get("force", "false").lower())
        if force is None:
            raise ApiError(400, "force must be true or false", param="force", code="invalid_value")
        if not reloader.available:
            raise ApiError(501, "this Guard cannot reload", type="server_error", code="reload_unsupported")
        try:
            result = await reloader.areload("http", force=force)
        except UncertifiedPairError as exc:
            raise ApiError(422, str(exc), code="uncertified_pair") from None
        except ReloadError as exc:
            raise ApiError(422, str(exc), code="reload_failed") from None
        return Json(result.to_dict())
