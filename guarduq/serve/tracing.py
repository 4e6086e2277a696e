"""Optional OpenTelemetry spans: ``guarduq.request`` with children generate, score, decide.

Active only when ``opentelemetry-api`` is installed (the ``otel`` extra) and an ``OTEL_*``
environment variable is set; a no-op otherwise. The SDK is configured by the host (e.g. run
under ``opentelemetry-instrument``); with ``OTEL_TRACES_EXPORTER=console`` and the SDK present
and nothing configured, spans are printed to stdout. The Guard does generate -> score -> decide
in one call, so the child spans are laid out afterwards from its measured timings.
"""

from __future__ import annotations

import os
import time
from typing import Any

_STEPS = (("generate", "generate_s"), ("score", "score_s"), ("decide", "decide_s"))


def make_tracer() -> Any | None:
    if not any(k.startswith("OTEL_") for k in os.environ):
        return None
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER") == "console":
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

            if not isinstance(trace.get_tracer_provider(), TracerProvider):
                provider = TracerProvider()
                provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
                trace.set_tracer_provider(provider)
        except ImportError:
            pass
    return trace.get_tracer("guarduq.serve")


def record(tracer: Any | None, endpoint: str, start_ns: int, r: Any) -> None:
    """One request span with a child per step the response's timings report (no text)."""
    if tracer is None:
        return
    from opentelemetry import trace

    attrs = {"guarduq.request_id": r.request_id, "guarduq.endpoint": endpoint,
             "guarduq.model_fingerprint": r.model.fingerprint}
    if r.decision is not None:
        attrs.update({"guarduq.action": r.decision.action, "guarduq.rule": r.decision.rule or ""})
    parent = tracer.start_span("guarduq.request", start_time=start_ns, attributes=attrs)
    ctx = trace.set_span_in_context(parent)
    t = start_ns
    for name, key in _STEPS:
        if key in r.timings:
            end = t + int(r.timings[key] * 1e9)
            tracer.start_span(name, context=ctx, start_time=t).end(end_time=end)
            t = end
    parent.end(end_time=max(t, time.time_ns()))
