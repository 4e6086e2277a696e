"""``guarduq calibrate --dataset reviews --store URL``: a calibrator fitted on reviewed traffic.

Reviewed replies are not a simple random sample of traffic: every escalation is reviewed, and
risk bands may be oversampled. So calibration uses them in two ways (docs/review/README.md):

- the **fit** split (the risk model) takes every labelled reply that is not held out, each
  weighted by the inverse of its probability of being in that split (Horvitz-Thompson; see
  ``guarduq.store.fit_weights``), so the weighted fit targets the traffic, not the sample;
- the **threshold** and **test** splits (the certificate and the report) take only replies the
  uniform draw picked, a simple random sample of traffic, split by id hash as every dataset is.
  A certificate computed on escalations would hold for the borderline band, not for traffic.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from guarduq.calibration.datasets import Dataset, split_of
from guarduq.calibration.sizing import MIN_PER_CLASS, labels_needed
from guarduq.errors import CalibrationError, InputError

REVIEWS = "reviews"


def review_data_file(args: argparse.Namespace) -> Path:
    """The store's labelled reviews, exported once to ``runs/reviews/`` (named by content, so
    the scoring cache is reused while the labels are unchanged)."""
    from guarduq.store import Store

    if not args.store:
        raise InputError("--dataset reviews reads reviewed replies from a store: give --store URL")
    since = parse_since(args.since)
    store = Store(args.store)
    try:
        buf = io.StringIO()
        n = store.export_jsonl(buf, since=since)
    finally:
        store.close()
    if n == 0:
        when = f" since {since.isoformat()}" if since else ""
        raise InputError(
            f"the store holds no reviewed replies labelled right or wrong{when} (with their text: "
            "the policy must set review.keep_text); label some with `guarduq review --store URL`"
        )
    text = buf.getvalue().encode()
    path = Path(args.runs_dir) / REVIEWS / f"reviews-{hashlib.sha256(text).hexdigest()[:16]}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(text)
        os.replace(tmp, path)
    return path


def parse_since(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InputError(f"--since takes an ISO 8601 date or time (2026-12-01, 2026-12-01T09:00), got {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def review_parts(
    records: Sequence[Any], datasets: Sequence[Dataset], fractions: dict[str, float]
) -> tuple[dict[str, list[Any]], np.ndarray, int]:
    """Fit / threshold / test parts of reviewed replies, the fit part's weights, and how many
    replies the uniform draw picked.

    A uniformly drawn reply goes where its id hash sends it; a reply only another reason picked
    (an escalation, a band) goes to fit. Its weight is 1 / P(in fit), computed by
    ``guarduq.store.fit_weights`` from its sampling record.
    """
    from guarduq.store import fit_weights
    from guarduq.store.records import Sample

    meta = {it.id: it.meta["sample"] for d in datasets for it in d.items}
    parts: dict[str, list[Any]] = {"fit": [], "threshold": [], "test": []}
    for r in records:
        s = meta[r.id]
        parts[split_of(r.id, **fractions) if s["uniform"] else "fit"].append(r)
    samples = [Sample(reasons=tuple(meta[r.id]["reasons"]), uniform=meta[r.id]["uniform"], rate=meta[r.id]["rate"],
                      extra_probability=meta[r.id]["extra_probability"],
                      inclusion_probability=meta[r.id]["inclusion_probability"]) for r in parts["fit"]]
    fit_fraction = 1 - fractions["test_fraction"] - fractions["threshold_fraction"]
    weights = fit_weights(samples, [s.uniform for s in samples], fit_fraction)
    n_uniform = sum(bool(meta[r.id]["uniform"]) for r in records)
    return parts, np.asarray(weights, dtype=float), n_uniform


def check_review_size(
    parts: dict[str, list[Any]], n_uniform: int, alphas: Sequence[float], delta: float,
    fractions: dict[str, float],
) -> None:
    """Refuse, saying how many more labels are needed, when no alpha asked for could be
    certified from the uniform sample, or when the fit split lacks right or wrong answers
    (fewer than ``MIN_PER_CLASS`` of either is only warned about, as for any dataset)."""
    fit_wrong = sum(r.label == 0 for r in parts["fit"])
    fit_right = len(parts["fit"]) - fit_wrong
    problems = []
    if min(fit_wrong, fit_right) < 2:
        problems.append(
            f"the fit split holds {fit_right} right and {fit_wrong} wrong answers; the risk model needs "
            f"at least {MIN_PER_CLASS} of each"
        )
    tf = fractions["threshold_fraction"]
    rate = sum(r.label == 0 for r in parts["threshold"]) / len(parts["threshold"]) if parts["threshold"] else 0.0
    need = {a: labels_needed(a, delta, tf, 0.0) for a in alphas}
    if all(n is not None and n_uniform < n for n in need.values()):
        loosest = max(alphas)
        n = need[loosest]
        assert n is not None
        problems.append(
            f"{n_uniform} labels come from the uniform sample, the only ones a certificate may rest "
            f"on; certifying alpha={loosest:g} at delta={delta:g} needs at least {n} of them even "
            f"with no errors (observed error rate {rate:.2f}): label about {n - n_uniform} more "
            "replies the uniform draw picked (or raise review.rate)"
        )
    if problems:
        raise CalibrationError("too few reviewed labels to calibrate: " + "; ".join(problems))


def weights_summary(weights: np.ndarray) -> dict[str, float]:
    """How uneven the weights are: Kish's effective sample size says how many unweighted items
    the weighted fit is worth."""
    w = np.asarray(weights, float)
    ess = float(w.sum() ** 2 / (w**2).sum()) if w.size else 0.0
    return {"n": int(w.size), "effective_n": round(ess, 1), "max_over_min": float(w.max() / w.min()) if w.size else math.nan}
