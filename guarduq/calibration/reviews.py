"""Calibration from reviewed traffic: which split gets which label, with what weight.

Reviewed replies are not a simple random sample of traffic: every escalation is reviewed, and
risk bands may be oversampled. So calibration uses them in two ways (docs/review/README.md):

- the **fit** split (the risk model) takes every labelled reply that is not held out, each
  weighted by the inverse of its probability of being in that split (Horvitz-Thompson; see
  ``guarduq.sampling.fit_weights``), so the weighted fit targets the traffic, not the sample;
- the **threshold** and **test** splits (the certificate and the report) take only replies the
  uniform draw picked, a simple random sample of traffic, split by id hash as every dataset is.
  A certificate computed on escalations would hold for the borderline band, not for traffic.

Each reviewed item's sampling record is a ``guarduq.sampling.Sample`` in ``Item.meta["sample"]``
(``Sample.from_json`` of the export line's ``guarduq_sample``). Lower layer: no CLI, no store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from guarduq._logging import get_logger
from guarduq.calibration.dataset_base import Dataset
from guarduq.calibration.sizing import MIN_PER_CLASS, labels_needed
from guarduq.calibration.splits import split_of
from guarduq.errors import CalibrationError
from guarduq.sampling import Sample, fit_weights

log = get_logger("calibration")

REVIEWS = "reviews"  # the dataset name of reviewed traffic


class ReviewParts(NamedTuple):
    """The three splits of reviewed replies, the fit split's weights, and how many replies the
    uniform draw picked (the only ones a certificate may rest on)."""

    parts: dict[str, list[Any]]
    weights: np.ndarray
    n_uniform: int


def samples_of(datasets: Sequence[Dataset]) -> dict[str, Sample]:
    """Item id -> its sampling record, for every reviewed item of ``datasets``."""
    return {it.id: it.meta["sample"] for d in datasets for it in d.items if "sample" in it.meta}


def review_parts(
    records: Sequence[Any], datasets: Sequence[Dataset], fractions: Mapping[str, float],
    progress: Mapping[str, Any] | None = None,
) -> ReviewParts:
    """Fit / threshold / test parts of reviewed replies and the fit part's weights.

    A uniformly drawn reply goes where its id hash sends it; a reply only another reason picked
    (an escalation, a band) goes to fit. Its weight is 1 / P(in fit) (``fit_weights``).
    ``progress``: the store's counts (``Store.progress()``), for the labelled shares.
    """
    meta = samples_of(datasets)
    rates = sorted({meta[r.id].rate for r in records if meta[r.id].uniform})
    if len(rates) > 1:  # the uniform items are then not one simple random sample
        log.warning("review_rates_differ", rates=rates,
                    hint="the uniform draw ran at several rates (a policy change): pass --since "
                         "the last change so the certificate rests on one simple random sample")
    parts: dict[str, list[Any]] = {"fit": [], "threshold": [], "test": []}
    for r in records:
        parts[split_of(r.id, **fractions) if meta[r.id].uniform else "fit"].append(r)
    samples = [meta[r.id] for r in parts["fit"]]
    fit_fraction = 1 - fractions["test_fraction"] - fractions["threshold_fraction"]
    n_uniform = sum(meta[r.id].uniform for r in records)
    shares = labelled_shares(progress, n_uniform, len(records) - n_uniform)
    weights = fit_weights(samples, [s.uniform for s in samples], fit_fraction, labelled_fraction=shares)
    return ReviewParts(parts, np.asarray(weights, dtype=float), n_uniform)


def labelled_shares(progress: Mapping[str, Any] | None, n_uniform: int, n_other: int) -> tuple[float, float]:
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
    parts: Mapping[str, list[Any]], n_uniform: int, alphas: Sequence[float], delta: float,
    fractions: Mapping[str, float],
) -> None:
    """Refuse, saying how many more labels are needed, when no alpha asked for could be
    certified from the uniform sample, when the fit split lacks right or wrong answers
    (fewer than ``MIN_PER_CLASS`` of either is only warned about, as for any dataset), or when
    the hash split left the threshold or test split of a small uniform sample empty."""
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
    empty = [name for name in ("threshold", "test") if not parts[name]]
    if empty and n_uniform:
        problems.append(_empty_split_problem(empty, n_uniform, fractions))
    if problems:
        raise CalibrationError("too few reviewed labels to calibrate: " + "; ".join(problems))


def _empty_split_problem(empty: Sequence[str], n_uniform: int, fractions: Mapping[str, float]) -> str:
    """Each uniform label lands in a split by its id hash, with the split's share f as its
    probability, so k more labels leave it empty with probability (1 - f)^k: the count given
    makes that at most 5% for the smallest share among the empty splits."""
    share = min(fractions[f"{name}_fraction"] for name in empty)
    more = math.ceil(math.log(0.05) / math.log(1 - share))
    names = " and ".join(f"'{name}'" for name in empty)
    return (f"none of the {n_uniform} labels of the uniform sample fell in the {names} split "
            f"(each lands there with probability {share:g}): label about {more} more replies the "
            "uniform draw picked (95% likely to fill it)")


def weights_summary(weights: np.ndarray) -> dict[str, float]:
    """How uneven the weights are: Kish's effective sample size says how many unweighted items
    the weighted fit is worth."""
    w = np.asarray(weights, float)
    ess = float(w.sum() ** 2 / (w**2).sum()) if w.size else 0.0
    return {"n": int(w.size), "effective_n": round(ess, 1), "max_over_min": float(w.max() / w.min()) if w.size else math.nan}


def uniform_only(records: Sequence[Any], datasets: Sequence[Dataset]) -> list[Any]:
    """The records the uniform draw picked: the only ones a reviews calibrator's test split holds,
    and the simple random sample of traffic a drift reference should describe."""
    meta = samples_of(datasets)
    return [r for r in records if r.id in meta and meta[r.id].uniform]


def uniform_reference(cal: Any, records: Sequence[Any], datasets: Sequence[Dataset]) -> None:
    """Point the calibrator's drift references at the uniform sample (a simple random sample of
    the traffic), not at its fit split, which escalations and bands over-represent: the PSI
    quantiles, and the per-item ``drift_reference`` the ok/slice/unseen case reads, with each
    item under its traffic group (ungrouped ones under ``reviews``). Under the dataset name alone
    every item would be one group, and the case needs two (``drift_groups.MIN_GROUP`` items each),
    so a reloaded reviews calibrator would never read ``unseen`` and ``on_drift`` never act."""
    from guarduq.calibration.drift import drift_features, reference_quantiles
    from guarduq.calibration.drift_groups import reference_data

    uniform = uniform_only(records, datasets)
    if uniform:
        cal.reference_ = reference_quantiles([r.scores for r in uniform], drift_features(cal.features))
        group = {it.id: it.meta.get("group") for d in datasets for it in d.items}
        cal.drift_reference_ = reference_data([r.scores for r in uniform],
                                              [group.get(r.id) or r.dataset for r in uniform])


def group_certificates(cal: Any, parts: Mapping[str, Sequence[Any]], datasets: Sequence[Dataset],
                       alphas: Sequence[float], delta: float) -> dict[str, list[Any]]:
    """Each traffic group's own thresholds (``guarduq.calibration.groups``), certified on the
    group's share of the threshold split (uniform items only, as the pooled certificate), each
    test's second start learned on the group's fit-split items (labels the test never reads)."""
    from guarduq.calibration.groups import certify_groups, group_starts

    group = {it.id: it.meta.get("group") for d in datasets for it in d.items}
    held, fit = parts["threshold"], parts["fit"]
    names = [group.get(r.id) for r in held]
    if not any(names):
        return {}
    fit_names = [group.get(r.id) for r in fit]
    starts = group_starts(cal.predict_risk([r.scores for r in fit], fit_names), [1 - int(r.label) for r in fit],
                          fit_names, alphas, delta) if fit else None
    risk = cal.predict_risk([r.scores for r in held], names)
    table = certify_groups(risk, [1 - int(r.label) for r in held], names, alphas, delta, starts)
    for g, ts in table.items():
        log.info("group_certificates", group=g, n=ts[0].n if ts else 0,
                 certified={t.alpha: t.threshold for t in ts})
    return table
