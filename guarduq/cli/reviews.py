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

from guarduq._logging import get_logger
from guarduq._storage import private_file
from guarduq.calibration.datasets import Dataset
from guarduq.calibration.sizing import MIN_PER_CLASS, labels_needed
from guarduq.calibration.splits import split_of
from guarduq.errors import CalibrationError, InputError

log = get_logger("cli")

REVIEWS = "reviews"


def review_data_file(args: argparse.Namespace) -> Path:
    """The store's labelled reviews, exported once to ``WORK/reviews/`` (``--work``, default
    ``./runs``; named by content, so the scoring cache is reused while the labels are unchanged).
    The file holds prompt and reply text: it is written 0600 in a 0700 folder."""
    from guarduq.store import Store

    if not args.store:
        raise InputError("--dataset reviews reads reviewed replies from a store: give --store URL "
                         "(or --data a file exported from one)")
    since = parse_since(args.since)
    store = Store(args.store)
    try:
        buf = io.StringIO()
        n = store.export_jsonl(buf, since=since)
        args.review_progress = store.progress()  # how many were sampled: the labelled share
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
    private_file(path)  # prompt and reply text: owner only (0600, in a 0700 folder)
    if path.stat().st_size != len(text):
        tmp = private_file(path.with_suffix(f".tmp{os.getpid()}"))
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
    records: Sequence[Any], datasets: Sequence[Dataset], fractions: dict[str, float],
    progress: dict[str, Any] | None = None,
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
    rates = sorted({float(meta[r.id]["rate"]) for r in records if meta[r.id]["uniform"]})
    if len(rates) > 1:  # the uniform items are then not one simple random sample
        log.warning("review_rates_differ", rates=rates,
                    hint="the uniform draw ran at several rates (a policy change): pass --since "
                         "the last change so the certificate rests on one simple random sample")
    parts: dict[str, list[Any]] = {"fit": [], "threshold": [], "test": []}
    for r in records:
        s = meta[r.id]
        parts[split_of(r.id, **fractions) if s["uniform"] else "fit"].append(r)
    samples = [Sample(reasons=tuple(meta[r.id]["reasons"]), uniform=meta[r.id]["uniform"], rate=meta[r.id]["rate"],
                      extra_probability=meta[r.id]["extra_probability"],
                      inclusion_probability=meta[r.id]["inclusion_probability"]) for r in parts["fit"]]
    fit_fraction = 1 - fractions["test_fraction"] - fractions["threshold_fraction"]
    n_uniform = sum(bool(meta[r.id]["uniform"]) for r in records)
    shares = labelled_shares(progress, n_uniform, len(records) - n_uniform)
    weights = fit_weights(samples, [s.uniform for s in samples], fit_fraction, labelled_fraction=shares)
    return parts, np.asarray(weights, dtype=float), n_uniform


def labelled_shares(progress: dict[str, Any] | None, n_uniform: int, n_other: int) -> tuple[float, float]:
    """(λ_u, λ_o): the shares of uniform-drawn and of other sampled items that are labelled and
    usable here. A labelled uniform share below 1 is warned about: the certificate then assumes
    reviewers picked which uniform items to label without regard to them (queue order does)."""
    if not progress:
        return 1.0, 1.0
    sampled_u = int(progress["by_reason"].get("uniform", 0))
    sampled_o = int(progress["items"]) - sampled_u
    lam_u = min(1.0, n_uniform / sampled_u) if sampled_u else 1.0
    lam_o = min(1.0, n_other / sampled_o) if sampled_o else 1.0
    if lam_u < 1.0:
        log.warning("review_uniform_partly_labelled", labelled=n_uniform, sampled=sampled_u,
                    hint="the certificate treats the labelled uniform items as a random subset of "
                         "the uniform sample: label them in queue order, without filtering by risk")
    return max(lam_u, 1e-9), max(lam_o, 1e-9)


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
            f"both (at least 2 of each; {MIN_PER_CLASS} of each to fit well)"
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


def uniform_reference(cal: Any, records: Sequence[Any], datasets: Sequence[Dataset]) -> None:
    """Point the calibrator's drift reference at the uniform sample (a simple random sample of
    the traffic), not at its fit split, which escalations and bands over-represent."""
    from guarduq.calibration.drift import drift_features, reference_quantiles

    meta = {it.id: it.meta["sample"] for d in datasets for it in d.items}
    uniform = [r.scores for r in records if meta[r.id]["uniform"]]
    if uniform:
        cal.reference_ = reference_quantiles(uniform, drift_features(cal.features))


def uniform_only(records: Sequence[Any], datasets: Sequence[Dataset]) -> list[Any]:
    """The records the uniform draw picked: the only ones a reviews calibrator's test split holds."""
    meta = {it.id: it.meta.get("sample") for d in datasets for it in d.items}
    return [r for r in records if meta.get(r.id) and meta[r.id]["uniform"]]
