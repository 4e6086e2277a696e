"""Prometheus metrics of one server (its own registry, so apps in one process never collide).

Labels carry decisions, rules, endpoints and status codes only: never prompt or reply text.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from guarduq.calibration.drift import LEVELS, FeatureDrift
from guarduq.calibration.drift_groups import CASES, Case

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
LOG_EPISTEMIC_BUCKETS = tuple(float(x) for x in range(-6, 13))
UNIT_BUCKETS = tuple(i / 20 for i in range(1, 21))
ALEATORIC_BUCKETS = tuple(i / 40 for i in range(1, 11))  # p(1-p) <= 0.25


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("guarduq_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.decisions = Counter("guarduq_decisions", "policy decisions by action and rule",
                                 ["endpoint", "action", "rule", "shadow"], registry=r)
        self.request_seconds = Histogram("guarduq_request_seconds", "request latency, end to end",
                                         ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.generate_seconds = Histogram("guarduq_generation_seconds", "generation time per reply",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.score_seconds = Histogram("guarduq_scoring_seconds", "scoring time per reply",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait_seconds = Histogram("guarduq_queue_wait_seconds", "time queued before the model",
                                            buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("guarduq_queue_depth", "requests waiting for the model", registry=r)
        self.batch_size = Histogram("guarduq_batch_size", "requests per model call",
                                    buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.rejected = Counter("guarduq_rejected", "requests refused before the model, by reason",
                                ["reason"], registry=r)
        self.cancelled = Counter("guarduq_cancelled", "generations cancelled by a client disconnect",
                                 registry=r)
        self.reloads = Counter("guarduq_reloads", "policy/calibrator reloads by outcome (ok, failed)",
                               ["outcome"], registry=r)
        for outcome in ("ok", "failed"):
            self.reloads.labels(outcome)
        self.log_epistemic = Histogram("guarduq_score_log_epistemic", "ln(epistemic) of scored replies",
                                       buckets=LOG_EPISTEMIC_BUCKETS, registry=r)
        self.aleatoric = Histogram("guarduq_score_aleatoric", "aleatoric score of scored replies",
                                   buckets=ALEATORIC_BUCKETS, registry=r)
        self.risk = Histogram("guarduq_score_risk", "calibrated risk of scored replies",
                              buckets=UNIT_BUCKETS, registry=r)
        self.invalid = Counter("guarduq_scores_invalid", "replies whose scores are invalid", registry=r)
        self.drift_psi = Gauge("guarduq_drift_psi", "PSI of the live window vs the calibrator's data",
                               ["feature"], registry=r)
        self.drift_ks = Gauge("guarduq_drift_ks", "KS statistic of the live window vs the reference",
                              ["feature"], registry=r)
        self.drift_level = Gauge("guarduq_drift_level", "0 ok, 1 watch (PSI >= 0.1), 2 alarm (>= 0.25)",
                                 ["feature"], registry=r)
        self.drift_window = Gauge("guarduq_drift_window", "live values in the drift window",
                                  ["feature"], registry=r)
        self.drift_case = Gauge("guarduq_drift_case", "1 for the drift window's case (ok, slice, unseen)",
                                ["case"], registry=r)
        self.drift_group_ratio = Gauge("guarduq_drift_group_ratio",
                                       "window distance / threshold per calibration group (<= 1: close)",
                                       ["group"], registry=r)

    def observe_response(self, endpoint: str, r: Any) -> None:
        """Timings, scores and decision of one GuardedResponse."""
        t = {**r.scores.timings, **r.timings}
        if "generate_s" in t:
            self.generate_seconds.observe(t["generate_s"])
        if "score_s" in t:
            self.score_seconds.observe(t["score_s"])
        if r.scores.valid:
            if r.scores.epistemic > 0:
                self.log_epistemic.observe(math.log(r.scores.epistemic))
            self.aleatoric.observe(r.scores.aleatoric)
        else:
            self.invalid.inc()
        if r.risk is not None and math.isfinite(r.risk):
            self.risk.observe(r.risk)
        d = r.decision
        action, rule, shadow = ("none", "none", "false") if d is None else (
            d.action, d.rule or "none", str(bool(d.shadow)).lower())
        self.decisions.labels(endpoint, action, rule, shadow).inc()

    def observe_drift(self, state: list[FeatureDrift], case: Case | None = None) -> None:
        for d in state:
            self.drift_psi.labels(d.feature).set(d.psi)
            self.drift_ks.labels(d.feature).set(d.ks)
            self.drift_level.labels(d.feature).set(LEVELS.index(d.level))
            self.drift_window.labels(d.feature).set(d.n)
        if case is not None:
            for c in CASES:
                self.drift_case.labels(c).set(1.0 if c == case.case else 0.0)
            thresholds = case.group_thresholds
            for g, dist in case.group_distances.items():
                if g in thresholds:
                    self.drift_group_ratio.labels(g).set(dist / thresholds[g])

    def render(self) -> bytes:
        return generate_latest(self.registry)
