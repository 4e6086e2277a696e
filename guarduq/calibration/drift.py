"""Drift of live scores away from the distribution a calibrator was fitted on.

A calibrator's risk is only as good as the match between today's scores and the scores it saw
when it was fitted. This module compares, per feature (``log_epistemic``, ``aleatoric``, and any
feature the calibrator uses), a window of live values with a reference sample:

* **PSI** (population stability index): the reference's deciles cut the line into ``bins``
  bins (open at both ends); with ``r_i``/``l_i`` the reference/live share of bin ``i``, each
  floored at ``EPS``, ``PSI = sum_i (l_i - r_i) * ln(l_i / r_i)``. The usual reading, used here:
  below 0.1 stable (``ok``), 0.1 to 0.25 some shift (``watch``), 0.25 or more a real shift
  (``alarm``): recalibrate or look at the traffic.
* **KS**: the two-sample Kolmogorov-Smirnov statistic ``sup_x |F_ref(x) - F_live(x)|``.

The reference is the calibrator artifact's ``evaluation_data`` (scores of its held-out test
items: the same population as its fit split, which the artifact does not store) or a JSONL of
score records. Lower layer: numpy only, no torch, nothing above calibration.

PSI levels say *that* the scores moved, not *how*: one slice of the calibration mix (only ARC
questions) moves them as far as a task the calibrator never saw. When the reference knows each
item's group (``drift_reference``, every calibration item, or in older artifacts
``evaluation_data``, has ``dataset``), the monitor also classifies the window as
``ok`` / ``slice:<group>`` / ``unseen`` (:mod:`guarduq.calibration.drift_groups`), with thresholds
set for a 5% false-alarm rate on in-distribution windows.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from guarduq._logging import get_logger
from guarduq.calibration.drift_groups import (
    FALSE_ALARM,
    Case,
    CaseClassifier,
    GroupReference,
    group_reference_from_artifact,
)
from guarduq.calibration.features import FEATURE_SETS, FEATURES, as_score_dict
from guarduq.errors import CalibrationError

log = get_logger("drift")

HEADLINE_FEATURES = FEATURE_SETS["paper"]  # always watched: log_epistemic, aleatoric

PSI_WATCH = 0.1
PSI_ALARM = 0.25
EPS = 1e-4  # floor of a bin's share, so an empty bin gives a large but finite PSI
DEFAULT_BINS = 10
LEVELS = ("ok", "watch", "alarm")


def bin_edges(reference: Sequence[float], bins: int = DEFAULT_BINS) -> np.ndarray:
    """Inner edges at the reference's quantiles (duplicates merged); the outer bins are open."""
    ref = _finite(reference)
    if ref.size < 2:
        raise CalibrationError(f"a drift reference needs at least 2 finite values, got {ref.size}")
    if bins < 2:
        raise CalibrationError(f"PSI needs at least 2 bins, got {bins}")
    qs = np.quantile(ref, np.linspace(0, 1, bins + 1)[1:-1])
    return np.unique(qs)


def shares(values: Sequence[float], edges: np.ndarray) -> np.ndarray:
    """Share of ``values`` in each bin ``(-inf, e0], (e0, e1], ..., (e_k, inf)``."""
    v = _finite(values)
    counts = np.bincount(np.searchsorted(edges, v, side="left"), minlength=len(edges) + 1)
    return counts / max(v.size, 1)


def psi(reference: Sequence[float], live: Sequence[float], bins: int = DEFAULT_BINS) -> float:
    """Population stability index of ``live`` against ``reference`` (see the module doc)."""
    edges = bin_edges(reference, bins)
    return psi_from_shares(shares(reference, edges), shares(live, edges))


def psi_from_shares(ref: np.ndarray, live: np.ndarray) -> float:
    r = np.maximum(np.asarray(ref, dtype=float), EPS)
    q = np.maximum(np.asarray(live, dtype=float), EPS)
    return float(np.sum((q - r) * np.log(q / r)))


def ks(reference: Sequence[float], live: Sequence[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic, ``max |F_ref - F_live|`` over all sample points."""
    a, b = np.sort(_finite(reference)), np.sort(_finite(live))
    if a.size == 0 or b.size == 0:
        return math.nan
    x = np.concatenate([a, b])
    fa = np.searchsorted(a, x, side="right") / a.size
    fb = np.searchsorted(b, x, side="right") / b.size
    return float(np.max(np.abs(fa - fb)))


def level(value: float, watch: float = PSI_WATCH, alarm: float = PSI_ALARM) -> str:
    """``ok`` / ``watch`` / ``alarm`` for a PSI value (NaN: ``ok``, nothing to say yet)."""
    if not math.isfinite(value) or value < watch:
        return "ok"
    return "watch" if value < alarm else "alarm"


def feature_values(records: Iterable[Mapping[str, Any]], feature: str) -> list[float]:
    """One feature of many score records (dicts with ``epistemic``, ``aleatoric``, ...)."""
    if feature not in FEATURES:
        raise CalibrationError(f"unknown feature {feature!r}; choose from {sorted(FEATURES)}")
    out = []
    for rec in records:
        if not rec.get("valid", True):
            continue
        try:
            v = FEATURES[feature](rec)
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(v):
            out.append(v)
    return out


REFERENCE_POINTS = 201  # quantiles kept per feature: the fit split's shape in ~4 KB of JSON


def reference_quantiles(
    records: Sequence[Mapping[str, Any]], features: Sequence[str], points: int = REFERENCE_POINTS
) -> dict[str, list[float]]:
    """The fit split's distribution of each watched feature, as ``points`` evenly spaced quantiles
    (all values when there are fewer), unrounded so that the ties of a discrete feature such as
    ``log_n_tokens`` stay exactly on the values live traffic takes.

    Why quantiles: PSI only needs the reference's deciles and its share per bin, and KS against
    201 quantiles is off by at most 1/200 in the empirical CDF, so a compact summary of the fit
    distribution serves drift checks without storing every fitted answer in the artifact.
    Features with fewer than 2 finite values are left out.
    """
    out: dict[str, list[float]] = {}
    dicts = [as_score_dict(r) for r in records]
    for f in features:
        v = np.sort(np.asarray(feature_values(dicts, f), dtype=float))
        if v.size < 2:
            continue
        q = v if v.size <= points else np.quantile(v, np.linspace(0, 1, points))
        out[f] = [float(x) for x in q]
    return out


# --------------------------------------------------------------------------- references


@dataclass(frozen=True)
class Reference:
    """Per-feature reference samples and where they came from; ``grouped``, when the source knows
    each item's calibration group, feeds the ok/slice/unseen classifier."""

    values: dict[str, np.ndarray]
    source: str
    grouped: GroupReference | None = field(default=None, compare=False)

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(self.values)


def drift_features(calibrator_features: Sequence[str] = ()) -> tuple[str, ...]:
    """The watched features: the two headline ones, then whatever else the calibrator uses."""
    return tuple(dict.fromkeys([*HEADLINE_FEATURES, *calibrator_features]))


def reference_from_artifact(artifact: Mapping[str, Any], source: str = "calibrator") -> Reference:
    """The reference stored in a calibrator artifact (``Calibrator.to_dict()`` or its JSON).

    Prefers ``reference`` (quantiles of the fit split, written since artifacts carry it), else
    ``evaluation_data`` (the held-out items' scores, same distribution by the random split).
    Raises ``CalibrationError`` naming what is missing when neither covers a watched feature.
    """
    wanted = drift_features(artifact.get("features") or ())
    stored = artifact.get("reference") or {}
    grouped = _grouped(artifact, wanted, source)
    if all(len(stored.get(f) or ()) >= 2 for f in wanted):
        n = artifact.get("n_fit", "?")
        return Reference({f: np.asarray(stored[f], dtype=float) for f in wanted},
                         f"{source} fit split (n={n}, quantiles)", grouped)
    data = artifact.get("evaluation_data")
    if not data:
        raise CalibrationError(
            f"{source} stores no evaluation_data (saved without it?); pass --reference scores.jsonl"
        )
    keys = [k for k, v in data.items() if isinstance(v, list)]
    n = max((len(data[k]) for k in keys), default=0)
    records = [{k: data[k][i] for k in keys if i < len(data[k])} for i in range(n)]
    values: dict[str, np.ndarray] = {}
    for f in wanted:
        v = feature_values(records, f)
        if len(v) < 2:
            raise CalibrationError(
                f"{source}: evaluation_data has no usable values for feature {f!r} "
                f"(it stores {sorted(keys)}); pass --reference scores.jsonl"
            )
        values[f] = np.asarray(v)
    return Reference(values, f"{source} evaluation_data (n={n})", grouped)


def _grouped(artifact: Mapping[str, Any], features: Sequence[str], source: str) -> GroupReference | None:
    """The per-group reference, or None (an old artifact without ``dataset``: PSI levels only)."""
    try:
        return group_reference_from_artifact(artifact, features, source)
    except CalibrationError as exc:
        log.info("drift_cases_unavailable", reason=str(exc))
        return None


def load_reference(
    path: str | Path, features: Sequence[str] = HEADLINE_FEATURES
) -> Reference:
    """A reference from a calibrator JSON artifact or a JSONL of score records.

    A JSONL line is a score record (``epistemic``, ``aleatoric``, ...) or an audit line whose
    ``scores`` holds one; ``guarduq score --input`` output works as is.
    """
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"drift reference not found: {path}")
    if path.suffix == ".json":
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CalibrationError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise CalibrationError(f"{path} is not a calibrator artifact")
        return reference_from_artifact(doc, str(path))
    records, _ = read_score_records(path)
    values = {f: np.asarray(feature_values(records, f)) for f in drift_features(features)}
    short = [f for f, v in values.items() if v.size < 2]
    if short:
        raise CalibrationError(f"{path}: fewer than 2 usable values for {short}")
    return Reference(values, f"{path} (n={len(records)})")


def read_score_records(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Score dicts from a JSONL file (audit lines or bare score lines), and the count of lines
    skipped as incomplete or not JSON (a process killed mid-write leaves at most one)."""
    records, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(rec, dict):
                skipped += 1
                continue
            scores = rec.get("scores") if isinstance(rec.get("scores"), dict) else rec
            if "epistemic" in scores:
                records.append(scores)
    return records, skipped


# --------------------------------------------------------------------------- the live monitor


@dataclass(frozen=True)
class FeatureDrift:
    feature: str
    psi: float
    ks: float
    n: int
    level: str

    def to_dict(self) -> dict[str, Any]:
        return {"feature": self.feature, "psi": self.psi, "ks": self.ks, "n": self.n, "level": self.level}


def compare(reference: Reference, records: Sequence[Mapping[str, Any]], bins: int = DEFAULT_BINS,
            watch: float = PSI_WATCH, alarm: float = PSI_ALARM) -> list[FeatureDrift]:
    """PSI and KS of every reference feature for a batch of score records (the offline check)."""
    out = []
    for f, ref in reference.values.items():
        live = feature_values(records, f)
        value = psi(ref, live, bins) if live else math.nan
        out.append(FeatureDrift(f, value, ks(ref, live), len(live), level(value, watch, alarm)))
    return out


class DriftMonitor:
    """A rolling window of live feature values, compared with the reference as it fills.

    Nothing is reported until ``min_n`` values are in the window. ``observe`` returns the
    features whose level changed; a rise is logged as a warning, a fall as info.
    """

    def __init__(self, reference: Reference, *, window: int = 500, min_n: int = 50,
                 bins: int = DEFAULT_BINS, watch: float = PSI_WATCH, alarm: float = PSI_ALARM,
                 false_alarm: float = FALSE_ALARM, case_every: int = 10) -> None:
        if window < 2 or not 2 <= min_n <= window:
            raise CalibrationError(f"need 2 <= min_n <= window, got min_n={min_n}, window={window}")
        if not 0 < watch < alarm:
            raise CalibrationError(f"need 0 < watch < alarm, got {watch}, {alarm}")
        self.reference, self.min_n, self.watch, self.alarm = reference, min_n, watch, alarm
        self._edges = {f: bin_edges(v, bins) for f, v in reference.values.items()}
        self._ref_shares = {f: shares(v, self._edges[f]) for f, v in reference.values.items()}
        self._windows: dict[str, deque[float]] = {f: deque(maxlen=window) for f in reference.values}
        self._state: dict[str, FeatureDrift] = {
            f: FeatureDrift(f, math.nan, math.nan, 0, "ok") for f in reference.values
        }
        self._lock = threading.Lock()
        # The case needs each item's features together (whole items in one window).
        self.cases = (CaseClassifier(reference.grouped, window=window, false_alarm=false_alarm)
                      if reference.grouped is not None else None)
        self._case_window: deque[dict[str, float]] = deque(maxlen=window)
        self._case: Case | None = None
        self._case_every, self._since_case = max(1, case_every), 0

    def observe(self, scores: Mapping[str, Any]) -> list[FeatureDrift]:
        """Add one response's scores; returns the features whose level changed."""
        changed = []
        with self._lock:
            for f, win in self._windows.items():
                v = feature_values([scores], f)
                if not v:
                    continue
                win.append(v[0])
                new = self._measure(f, win)
                old = self._state[f]
                self._state[f] = new
                if new.level != old.level:
                    changed.append(new)
            case_change = self._observe_case(scores)
        if case_change is not None:
            old_label, c = case_change
            emit = log.warning if c.case != "ok" else log.info
            emit("drift_case_changed", case=c.label, was=old_label, nearest_group=c.nearest,
                 mix_distance=round(c.mix_distance, 3), mix_threshold=round(c.mix_threshold, 3), n=c.n,
                 reference=self.reference.source)
        for d in changed:
            emit = log.warning if LEVELS.index(d.level) > 0 else log.info
            emit("drift_level_changed", feature=d.feature, level=d.level, psi=round(d.psi, 4),
                 ks=round(d.ks, 4), n=d.n, watch=self.watch, alarm=self.alarm,
                 reference=self.reference.source)
        return changed

    def _measure(self, feature: str, win: deque[float]) -> FeatureDrift:
        if len(win) < self.min_n:
            return FeatureDrift(feature, math.nan, math.nan, len(win), "ok")
        value = psi_from_shares(self._ref_shares[feature], shares(list(win), self._edges[feature]))
        return FeatureDrift(feature, value, ks(self.reference.values[feature], list(win)), len(win),
                            level(value, self.watch, self.alarm))

    def snapshot(self) -> list[FeatureDrift]:
        with self._lock:
            return list(self._state.values())

    def case(self) -> Case | None:
        """The window's last classification (None: no grouped reference, or fewer than min_n)."""
        with self._lock:
            return self._case

    def _observe_case(self, scores: Mapping[str, Any]) -> tuple[str | None, Case] | None:
        """Add the item to the case window; reclassify every ``case_every`` items (a few ms);
        returns (old label, new case) when the label changed. Call with the lock held."""
        if self.cases is None:
            return None
        item = {}
        for f in self.cases.features:
            v = feature_values([scores], f)
            if v:
                item[f] = v[0]
        if not item:
            return None
        self._case_window.append(item)
        self._since_case += 1
        n = len(self._case_window)
        if n < self.min_n or (self._since_case < self._case_every and self._case is not None):
            return None
        self._since_case = 0
        window = {f: [it[f] for it in self._case_window if f in it] for f in self.cases.features}
        new, old = self.cases.classify(window), self._case
        self._case = new
        if old is None or old.label != new.label:
            return (old.label if old is not None else None, new)
        return None


def _finite(values: Sequence[float]) -> np.ndarray:
    a = np.asarray(list(values), dtype=float).reshape(-1)
    return a[np.isfinite(a)]
