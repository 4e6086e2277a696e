"""Certificates per kind of traffic: one threshold per group where that group's labels support one.

A pooled certificate bounds the error rate among accepted answers over the *mix* of traffic it
was computed on. Inside one kind of traffic it says nothing: on the shipped SmolLM2 calibrator's
held-out items, the pooled α = 0.7 threshold keeps ARC's accepted answers at 62% wrong and lets
TruthfulQA-MC's through at 76% wrong (docs/results/groups.md). The fix is group-conditional
("Mondrian") certification: the same risk model, and for each group ``g`` the same fixed-sequence
test (:func:`~guarduq.calibration.thresholds.select_threshold`) run on ``g``'s own threshold-split
items only. Its guarantee is then per group: P(error among g's accepted answers > α) ≤ δ, for
every group that got a threshold, because each test uses only exchangeable items of that group.

A group whose labels cannot support a certificate (too few, or too many errors at every risk)
gets ``threshold=None`` with the test's message, and the policy decides what happens to its
traffic (``groups.fallback``: the pooled threshold, or escalate). A group that was never seen
in calibration has no entry at all, and falls back the same way (``guarduq.policy.context``
reads the table by attribute).

Lower layer: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from guarduq.calibration.thresholds import Threshold, select_threshold, start_threshold
from guarduq.errors import CalibrationError

MAX_GROUP_NAME = 64  # the store's column width


def certify_groups(
    risk: Sequence[float], wrong: Sequence[int], groups: Sequence[str | None],
    alphas: Sequence[float], delta: float, starts: Mapping[tuple[str, float], float | None] | None = None,
) -> dict[str, list[Threshold]]:
    """Per group (items whose group is None are pooled only): one ``Threshold`` per alpha,
    certified on that group's items alone. ``starts[(group, alpha)]``: where a second test
    sequence starts, learned on labels these never include (:func:`group_starts`), as the pooled
    certificate learns its start on the fit split."""
    r = np.asarray(risk, dtype=float)
    w = np.asarray(wrong, dtype=int)
    g = np.asarray([x if x is not None else "" for x in groups], dtype=object)
    if not r.shape == w.shape == g.shape:
        raise CalibrationError(f"risk, wrong and groups differ in length: {r.size}, {w.size}, {g.size}")
    out: dict[str, list[Threshold]] = {}
    for name in sorted({str(x) for x in g if x}):
        if len(name) > MAX_GROUP_NAME:
            raise CalibrationError(f"group name {name[:20]!r}... is longer than {MAX_GROUP_NAME} characters")
        m = (g == name) & np.isfinite(r)
        out[name] = [select_threshold(r[m], w[m], a, delta, start=(starts or {}).get((name, a)))
                     for a in sorted(set(alphas))]
    return out


def group_starts(
    risk: Sequence[float], wrong: Sequence[int], groups: Sequence[str | None], alphas: Sequence[float],
    delta: float,
) -> dict[tuple[str, float], float | None]:
    """Each group's start per alpha (:func:`~guarduq.calibration.thresholds.start_threshold`) on
    labelled items the certificate will not read (the fit split)."""
    r = np.asarray(risk, dtype=float)
    w = np.asarray(wrong, dtype=int)
    g = np.asarray([x if x is not None else "" for x in groups], dtype=object)
    out: dict[tuple[str, float], float | None] = {}
    for name in sorted({str(x) for x in g if x}):
        m = (g == name) & np.isfinite(r)
        for a in sorted(set(alphas)):
            out[(name, a)] = start_threshold(r[m], w[m], a, delta) if m.any() else None
    return out


def accepted_error(risk: Sequence[float], wrong: Sequence[int], threshold: float | None) -> dict[str, Any]:
    """Coverage and error rate among accepted answers at ``threshold`` (None: nothing accepted)."""
    r = np.asarray(risk, dtype=float)
    w = np.asarray(wrong, dtype=int)
    acc = r <= threshold if threshold is not None else np.zeros(r.size, dtype=bool)
    n_acc = int(acc.sum())
    return {"n": int(r.size), "accepted": n_acc, "coverage": n_acc / r.size if r.size else math.nan,
            "errors": int(w[acc].sum()), "error_rate": float(w[acc].mean()) if n_acc else None}
