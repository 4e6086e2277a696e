"""Which drift is it? A window of live scores against the calibration mix *and* each of its groups.

A PSI alarm alone cannot tell "the traffic is one slice of what the calibrator was fitted on"
(e.g. only ARC questions: the calibrator saw them, its risk is still meaningful) from "the
traffic is something it never saw" (its risk may rank wrong answers below chance). Both move
the scores far from the *mix*. What separates them is whether the window is close to one
calibration *group* (the artifact's ``drift_reference`` has a ``dataset`` column). So a window is
classified as

* ``ok``: close to the mix;
* ``slice``: far from the mix, close to at least one group (the nearest is named);
* ``unseen``: far from the mix and from every group.

**The statistic.** Per watched feature, the two-sample KS statistic ``D`` scaled by
``sqrt(n m / (n + m))`` (``n`` window values, ``m`` reference values), then the maximum over the
features. Scaled so, KS has a null distribution that hardly depends on ``n`` and ``m`` (the
Kolmogorov limit), so one threshold per reference serves a window that is still filling as well
as a full one; the maximum over features makes "close" mean close in every feature.

**The thresholds** (:func:`calibrate`) bound the false-alarm rate *given the stored reference*,
the rate a server sees: every window it reads is compared with the same stored items, so the
reference's own sampling error is shared by all of them. With ``F`` the population, the
reference's empirical CDF ``R`` and a window's ``W``, ``sup|W - R| <= sup|W - F| + sup|R - F|``;
so the threshold (in KS units, then scaled) is the ``1 - false_alarm`` quantile of the window's
own deviation plus the ``1 - false_alarm`` quantile of the reference's, each estimated by drawing
from the reference (``draws`` bootstrap windows of ``window`` items, and bootstrap references of
``m`` items, each against the stored reference). Then, except for a ``false_alarm`` share of
reference draws, at most ``false_alarm`` of in-distribution windows leave ``ok``/their slice.
Whole items are drawn, so the features' correlation is kept; measured on synthetic references
in ``tests/unit/test_drift_cases.py`` and on fresh items in ``docs/results/drift.md``.

**The reference** is every calibration item with its group (the artifact's ``drift_reference``,
:func:`reference_data`), not only the held-out test share (``evaluation_data``, which older
artifacts fall back to): 3.3 times the items per group, so the reference's term of the threshold
is ~1.8 times smaller and an unlucky draw of it is rarer. Why (issue 35): fresh BoolQ windows read
``unseen``. Traced in ``benchmarks/drift_trace.py``: today's code reproduces the 308 stored BoolQ
items (scores and labels, in other batches), the same loader, file, prompt and ``--limit`` order
pick the fresh items, and nothing but an id hash picks the test share. The 150 fresh items sit at
a scaled KS of 2.02 (``mean_logprob``) from the 308; 140 BoolQ calibration items *outside* the
test share sit with the fresh ones (1.04), and the 308 apart from all 320 (permutation p ~0.001).
So the held-out share was an unlucky draw, and every server window shares its reference's draw
(every benchmark window of a slice, likewise, its one fresh pool's).

Lower layer: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guarduq.calibration.features import FEATURES
from guarduq.errors import CalibrationError

CASES = ("ok", "slice", "unseen")
FALSE_ALARM = 0.05
DRAWS = 400
MIN_GROUP = 30  # a group with fewer scored items is too small a reference to call a window close to
GROUP_KEY = "dataset"
# what a drift reference stores per item: the raw signals the watched features are computed from
REFERENCE_FIELDS = ("epistemic", "aleatoric", "mean_logprob", "mean_token_prob")


def ks_d(ref_sorted: np.ndarray, live: np.ndarray) -> float:
    """``sup |F_ref - F_live|`` (``ref_sorted`` sorted, NaN-free; NaN when a side is empty)."""
    b = np.sort(live[np.isfinite(live)])
    m, n = ref_sorted.size, b.size
    if m == 0 or n == 0:
        return math.nan
    x = np.concatenate([ref_sorted, b])
    return float(np.max(np.abs(np.searchsorted(ref_sorted, x, side="right") / m
                               - np.searchsorted(b, x, side="right") / n)))


def scaled_ks(ref_sorted: np.ndarray, live: np.ndarray) -> float:
    """``sqrt(n m / (n + m)) * sup |F_ref - F_live|`` (``ref_sorted`` sorted, NaN-free)."""
    m, n = ref_sorted.size, int(np.isfinite(live).sum())
    return ks_d(ref_sorted, live) * math.sqrt(n * m / (n + m)) if m and n else math.nan


def distance(ref: Mapping[str, np.ndarray], window: Mapping[str, Sequence[float]]) -> float:
    """The case statistic: the largest scaled KS over the features both sides have (NaN if none).
    ``ref`` values must be sorted (``GroupReference`` keeps them so)."""
    ds = [scaled_ks(ref[f], np.asarray(window[f], dtype=float)) for f in ref if f in window and len(window[f])]
    ds = [d for d in ds if math.isfinite(d)]
    return max(ds) if ds else math.nan


@dataclass(frozen=True)
class GroupReference:
    """Item-level reference scores: every item's features (rows aligned), and its group."""

    features: tuple[str, ...]
    matrix: np.ndarray  # (items, features); NaN where an item lacks a feature
    group: np.ndarray  # (items,) group name per item
    source: str

    @property
    def groups(self) -> tuple[str, ...]:
        names, counts = np.unique(self.group, return_counts=True)
        return tuple(str(g) for g, c in zip(names, counts, strict=True) if c >= MIN_GROUP)

    def sample(self, group: str | None = None) -> dict[str, np.ndarray]:
        """Sorted finite values per feature of the mix (``None``) or of one group."""
        rows = self.matrix if group is None else self.matrix[self.group == group]
        out = {}
        for j, f in enumerate(self.features):
            v = rows[:, j]
            out[f] = np.sort(v[np.isfinite(v)])
        return out

    @property
    def n(self) -> int:
        return int(self.matrix.shape[0])


def group_reference(records: Sequence[Mapping[str, Any]], features: Sequence[str], source: str,
                    group_key: str = GROUP_KEY) -> GroupReference:
    """From score records that carry their group (``dataset``). Raises ``CalibrationError`` when no
    feature has values or fewer than two groups have ``MIN_GROUP`` items (nothing to tell apart)."""
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise CalibrationError(f"unknown features {unknown}")
    rows, groups = [], []
    for rec in records:
        g = rec.get(group_key)
        if g is None or not rec.get("valid", True):
            continue
        rows.append([_feature(rec, f) for f in features])
        groups.append(str(g))
    matrix = np.asarray(rows, dtype=float).reshape(len(rows), len(features))
    keep = [j for j in range(len(features)) if np.isfinite(matrix[:, j]).sum() >= 2]
    if not keep:
        raise CalibrationError(f"{source}: no usable values for {list(features)}")
    ref = GroupReference(tuple(features[j] for j in keep), matrix[:, keep], np.asarray(groups), source)
    if len(ref.groups) < 2:
        raise CalibrationError(f"{source}: fewer than 2 groups with >= {MIN_GROUP} items")
    return ref


def reference_data(scores: Sequence[Mapping[str, Any]], groups: Sequence[str],
                   digits: int = 6) -> dict[str, list[Any]]:
    """Per-item columns (``dataset`` and the raw signals ``REFERENCE_FIELDS``) of *every* calibration
    item, for the artifact's ``drift_reference``: a group's reference is then all its scored items
    (BoolQ: 1,000), not only its held-out test share (308), whose own sampling error every live
    window inherits (module doc)."""
    if len(scores) != len(groups):
        raise CalibrationError(f"{len(scores)} score records for {len(groups)} group names")
    out: dict[str, list[Any]] = {GROUP_KEY: [str(g) for g in groups]}
    for k in REFERENCE_FIELDS:
        out[k] = [_rounded(s.get(k), digits) for s in scores]
    return out


def group_reference_from_artifact(artifact: Mapping[str, Any], features: Sequence[str],
                                  source: str = "calibrator") -> GroupReference:
    """The artifact's ``drift_reference`` (every calibration item with its ``dataset``; written
    since issue 35) or, in older artifacts, its ``evaluation_data`` (the held-out test items only),
    restricted to the watched features it can compute (``epistemic``, ``aleatoric``, ``mean_logprob``...)."""
    name = "drift_reference" if artifact.get("drift_reference") else "evaluation_data"
    data = artifact.get(name) or {}
    if not isinstance(data.get(GROUP_KEY), list):
        raise CalibrationError(f"{source}: {name} has no '{GROUP_KEY}' column")
    keys = [k for k, v in data.items() if isinstance(v, list)]
    n = len(data[GROUP_KEY])
    records = [{k: data[k][i] for k in keys if i < len(data[k])} for i in range(n)]
    usable = [f for f in features if any(math.isfinite(_feature(r, f)) for r in records[:50])]
    return group_reference(records, usable, f"{source} {name} (n={n})")


@dataclass(frozen=True)
class CaseThresholds:
    """Per-reference thresholds on :func:`distance` (see the module doc for how they are set)."""

    mix: float
    groups: dict[str, float]
    false_alarm: float
    window: int
    draws: int

    def to_dict(self) -> dict[str, Any]:
        return {"mix": self.mix, "groups": dict(self.groups), "false_alarm": self.false_alarm,
                "window": self.window, "draws": self.draws}


def null_deviations(ref: GroupReference, group: str | None, window: int, draws: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """KS deviations (max over features) from the stored reference of ``draws`` bootstrap windows
    of ``window`` items, and of as many bootstrap references of its own size: the window's and the
    reference's sampling error, whose quantiles add up to the threshold (module doc)."""
    rows = ref.matrix if group is None else ref.matrix[ref.group == group]
    m = rows.shape[0]
    stored = [np.sort(rows[:, j][np.isfinite(rows[:, j])]) for j in range(len(ref.features))]

    def deviation(sample: np.ndarray) -> float:
        ds = [ks_d(stored[j], sample[:, j]) for j in range(len(stored))]
        return max((d for d in ds if math.isfinite(d)), default=math.nan)

    win = np.array([deviation(rows[rng.integers(0, m, window)]) for _ in range(draws)])
    own = np.array([deviation(rows[rng.integers(0, m, m)]) for _ in range(draws)])
    return win, own


def calibrate(ref: GroupReference, *, window: int = 500, false_alarm: float = FALSE_ALARM,
              draws: int = DRAWS, seed: int = 0) -> CaseThresholds:
    """Thresholds on the scaled statistic so that, given the stored reference, at most about
    ``false_alarm`` of in-distribution windows of ``window`` items exceed each reference's (except
    for a ``false_alarm`` share of reference draws); a few seconds of numpy for 2,000 items."""
    if not 0 < false_alarm < 1 or window < 2 or draws < 20:
        raise CalibrationError(f"need 0 < false_alarm < 1, window >= 2, draws >= 20; got "
                               f"{false_alarm}, {window}, {draws}")
    rng = np.random.default_rng(seed)
    q = 1 - false_alarm

    def threshold(group: str | None) -> float:
        win, own = null_deviations(ref, group, window, draws, rng)
        m = int((ref.group == group).sum()) if group is not None else ref.n
        return float((np.nanquantile(win, q) + np.nanquantile(own, q)) * math.sqrt(window * m / (window + m)))

    mix = threshold(None)
    groups = {g: threshold(g) for g in ref.groups}
    return CaseThresholds(mix, groups, false_alarm, window, draws)


@dataclass(frozen=True)
class Case:
    """The classification of one window; ``nearest`` is the group with the smallest
    distance/threshold ratio (named even when the case is ``ok`` or ``unseen``)."""

    case: str
    nearest: str | None
    mix_distance: float
    mix_threshold: float
    group_distances: dict[str, float]
    n: int
    group_thresholds: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``ok``, ``slice:<group>`` or ``unseen``: one string for logs and dashboards."""
        return f"slice:{self.nearest}" if self.case == "slice" else self.case

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "label": self.label, "nearest_group": self.nearest,
                "mix_distance": _r(self.mix_distance), "mix_threshold": _r(self.mix_threshold),
                "group_distances": {g: _r(d) for g, d in self.group_distances.items()},
                "group_thresholds": {g: _r(d) for g, d in self.group_thresholds.items()}, "n": self.n}


class CaseClassifier:
    """``ok`` / ``slice`` / ``unseen`` for windows of feature values (thresholds computed at
    construction unless given: they belong to the reference, not to the traffic)."""

    def __init__(self, ref: GroupReference, thresholds: CaseThresholds | None = None, *,
                 window: int = 500, false_alarm: float = FALSE_ALARM, draws: int = DRAWS, seed: int = 0) -> None:
        self.reference = ref
        self.thresholds = thresholds or calibrate(ref, window=window, false_alarm=false_alarm, draws=draws, seed=seed)
        self._mix = ref.sample()
        self._groups = {g: ref.sample(g) for g in self.thresholds.groups}

    @property
    def features(self) -> tuple[str, ...]:
        return self.reference.features

    def classify(self, window: Mapping[str, Sequence[float]]) -> Case:
        """The case of one window (feature -> values); fewer than 2 values reads ``ok``."""
        n = min((len(window.get(f, ())) for f in self.features), default=0)
        t = self.thresholds
        if n < 2:
            return Case("ok", None, math.nan, t.mix, {}, n, dict(t.groups))
        dm = distance(self._mix, window)
        dg = {g: distance(s, window) for g, s in self._groups.items()}
        ratio = {g: d / t.groups[g] for g, d in dg.items() if math.isfinite(d)}
        nearest = min(ratio, key=ratio.__getitem__) if ratio else None
        if not math.isfinite(dm) or dm <= t.mix:
            case = "ok"
        elif nearest is not None and ratio[nearest] <= 1:
            case = "slice"
        else:
            case = "unseen"
        return Case(case, nearest, dm, t.mix, dg, n, dict(t.groups))

    def classify_records(self, records: Sequence[Mapping[str, Any]]) -> Case:
        """The case of a batch of score records (the offline check)."""
        vals: dict[str, list[float]] = {f: [] for f in self.features}
        for rec in records:
            if not rec.get("valid", True):
                continue
            for f in self.features:
                v = _feature(rec, f)
                if math.isfinite(v):
                    vals[f].append(v)
        return self.classify(vals)


def _feature(rec: Mapping[str, Any], f: str) -> float:
    try:
        v = float(FEATURES[f](rec))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return math.nan
    return v if math.isfinite(v) else math.nan


def _rounded(x: Any, digits: int) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return float(f"{v:.{digits}g}") if math.isfinite(v) else None


def _r(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None
