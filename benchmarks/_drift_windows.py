"""benchmarks/drift.py's windows: pools of scored items, the windows drawn from them, what the
drift classifier and the risk's guarantee say on each, and the summary per source.

Apart from the script so that the pipeline reads on its own; drift.py builds the pools (real or
synthetic), runs leave-one-dataset-out and writes the page.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from guarduq.calibration.drift import DEFAULT_BINS, psi
from guarduq.calibration.drift_groups import CaseClassifier, GroupReference

ALPHA = 0.7
FEATURES = ("log_epistemic", "aleatoric", "mean_logprob")  # those evaluation_data lets us compute
HELD_ASIDE = ("truthfulqa-mc", "truthfulqa-gen")  # no fresh items exist: half leave the reference


@dataclass
class Pool:
    """Scored items of one source: features (items x FEATURES), risk, wrong (1 = wrong answer)."""

    name: str
    x: np.ndarray
    risk: np.ndarray
    wrong: np.ndarray
    dataset: np.ndarray

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    def take(self, idx: np.ndarray) -> Pool:
        return Pool(self.name, self.x[idx], self.risk[idx], self.wrong[idx], self.dataset[idx])


def concat(name: str, pools: list[Pool]) -> Pool:
    return Pool(name, np.concatenate([p.x for p in pools]), np.concatenate([p.risk for p in pools]),
                np.concatenate([p.wrong for p in pools]), np.concatenate([p.dataset for p in pools]))


def auroc(wrong: np.ndarray, risk: np.ndarray) -> float:
    """AUROC of risk for wrong answers (ties count half); NaN with one class."""
    pos, neg = risk[wrong == 1], risk[wrong == 0]
    if pos.size == 0 or neg.size == 0:
        return math.nan
    allv = np.concatenate([pos, neg])
    order = allv.argsort(kind="mergesort")
    ranks = np.empty(allv.size)
    sorted_v = allv[order]
    # average ranks for ties
    _, inv, counts = np.unique(sorted_v, return_inverse=True, return_counts=True)
    cum = np.cumsum(counts)
    avg = cum - (counts - 1) / 2
    ranks[order] = avg[inv]
    return float((ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size))


def guarantee(p: Pool, threshold: float) -> tuple[float, float, bool]:
    """(coverage, error rate among accepted, held): accepted when risk <= threshold.

    Held unless the error rate among accepted is above alpha beyond a window's sampling noise
    (the 95% Wilson lower bound above alpha): the certificate bounds the population's rate, and
    on the calibration split it sat at 0.676 (bound 0.6995), so half of all windows of a healthy
    mix show a raw rate above 0.7 by chance alone.
    """
    acc = p.risk <= threshold
    if not acc.any():
        return 0.0, math.nan, True  # nothing answered: no wrong answer given
    k, n = int(p.wrong[acc].sum()), int(acc.sum())
    return float(acc.mean()), k / n, wilson(k, n)[0] <= ALPHA


def mix_pool(ref: GroupReference, pools: dict[str, Pool]) -> tuple[Pool, np.ndarray]:
    """Fresh in-distribution items in the reference's proportions: each source item weighted by
    the share of its dataset in the reference over its share in the pools."""
    share = Counter(ref.group.tolist())
    parts = [pools[g] for g in ref.groups if g in pools]
    return concat("mix", parts), np.concatenate([np.full(pools[g].n, share[g] / pools[g].n) for g in ref.groups
                                                if g in pools])


def windows(pool: Pool, size: int, count: int, rng: np.random.Generator, replace: bool,
            weights: np.ndarray | None = None) -> list[Pool]:
    """``count`` windows of ``size`` items (with or without replacement, by weight)."""
    p = None if weights is None else weights / weights.sum()
    out = []
    for _ in range(count):
        idx = rng.choice(pool.n, size=size, replace=replace or size > pool.n, p=p)
        out.append(pool.take(idx))
    return out


def psi_max(ref: GroupReference, w: Pool) -> float:
    mix = ref.sample()
    return max(psi(mix[f], w.x[:, j], DEFAULT_BINS) for j, f in enumerate(FEATURES))


def run(ref: GroupReference, pools: dict[str, Pool], threshold: float, *, size: int, count: int,
        replace: bool, seed: int = 0) -> dict[str, Any]:
    """Classify ``count`` windows per source; per window: case, nearest, AUROC, guarantee."""
    rng = np.random.default_rng(seed)
    clf = CaseClassifier(ref, window=size)
    mix, weights = mix_pool(ref, pools)
    sources: dict[str, tuple[Pool, np.ndarray | None, str]] = {"mix": (mix, weights, "ok")}
    for name, p in pools.items():
        if name in ref.groups:
            sources[name] = (p, None, f"slice:{name}")
        elif name not in HELD_ASIDE:
            sources[name] = (p, None, "unseen")
    rows = []
    for name, (pool, w, expected) in tqdm(sources.items(), desc=f"windows of {size}", file=sys.stderr):
        if not replace and size > pool.n:
            continue
        for win in windows(pool, size, count, rng, replace, w):
            case = clf.classify({f: win.x[:, j] for j, f in enumerate(FEATURES)})
            cov, err, held = guarantee(win, threshold)
            a = auroc(win.wrong, win.risk)
            rows.append({"source": name, "expected": expected, "label": case.label, "nearest": case.nearest,
                         "mix_distance": case.mix_distance, "auroc": a, "coverage": cov, "error": err,
                         "held": held, "psi_max": psi_max(ref, win)})
    return {"size": size, "count": count, "replace": replace, "rows": rows,
            "thresholds": clf.thresholds.to_dict(), "pool_n": {k: v[0].n for k, v in sources.items()}}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def summarize(res: dict[str, Any], auroc_floor: float) -> dict[str, Any]:
    """Per source: case counts, correct rate; detection of degrading windows."""
    by = defaultdict(list)
    for r in res["rows"]:
        by[r["source"]].append(r)
    per = {}
    for s, rs in by.items():
        cases = Counter(r["label"] for r in rs)
        ok = sum(r["label"] == r["expected"] for r in rs)
        ok_case = sum(r["label"].split(":")[0] == r["expected"].split(":")[0] for r in rs)
        alarm = sum(r["label"] != "ok" for r in rs)
        au = np.array([r["auroc"] for r in rs])
        per[s] = {"n": len(rs), "expected": rs[0]["expected"], "cases": dict(cases.most_common()),
                  "correct": ok / len(rs), "correct_ci": wilson(ok, len(rs)), "case_correct": ok_case / len(rs), "alarm": alarm / len(rs),
                  "alarm_ci": wilson(alarm, len(rs)), "auroc_median": float(np.nanmedian(au)) if np.isfinite(au).any() else math.nan,
                  "held": float(np.mean([r["held"] for r in rs])),
                  "psi_alarm": float(np.mean([r["psi_max"] >= 0.25 for r in rs]))}
    deg = [r for r in res["rows"] if is_degraded(r, auroc_floor)]
    fine = [r for r in res["rows"] if not is_degraded(r, auroc_floor)]
    det = sum(r["label"] != "ok" for r in deg)
    fa = sum(r["label"] != "ok" for r in fine)
    unseen_deg = sum(r["label"] == "unseen" for r in deg)
    by_case = {}
    for c in ("ok", "slice", "unseen"):
        rs = [r for r in res["rows"] if r["label"].split(":")[0] == c]
        k = sum(is_degraded(r, auroc_floor) for r in rs)
        au = [r["auroc"] for r in rs if math.isfinite(r["auroc"])]
        by_case[c] = {"n": len(rs), "degraded": k, "degraded_ci": wilson(k, len(rs)),
                      "guarantee_failed": sum(not r["held"] for r in rs),
                      "auroc_below": sum(math.isfinite(r["auroc"]) and r["auroc"] < auroc_floor for r in rs),
                      "auroc_median": float(np.median(au)) if au else math.nan,
                      "sources": dict(Counter(r["source"] for r in rs).most_common())}
    return {"by_case": by_case, "per_source": per, "degraded_n": len(deg), "detected": det, "detected_ci": wilson(det, len(deg)),
            "unseen_of_degraded": unseen_deg, "fine_n": len(fine), "fine_alarm": fa,
            "fine_alarm_ci": wilson(fa, len(fine))}


def is_degraded(r: dict[str, Any], auroc_floor: float) -> bool:
    """The window's risk is not to be trusted: the guarantee fails or AUROC is below the floor."""
    return (not r["held"]) or (math.isfinite(r["auroc"]) and r["auroc"] < auroc_floor)
