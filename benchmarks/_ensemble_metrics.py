"""The ensemble harness's measurements: metrics with bootstrap intervals, temperature scaling,
and each member's training loss (the page's plots are ``_ensemble_plots``). Everything works on class probabilities [n, C] and member log-probs [M, n, C]."""

from __future__ import annotations

from typing import Any

import numpy as np

from guarduq.calibration.analysis import _auroc_rows
from guarduq.calibration.metrics import ECE_BINS, ece_floor

N_BOOT = 1000


def entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(-1)


def mutual_information(member_logp: np.ndarray) -> np.ndarray:
    """Entropy of the mean minus the mean entropy of the members (0 for one member)."""
    probs = np.exp(member_logp)
    return np.clip(entropy(probs.mean(0)) - entropy(probs).mean(0), 0.0, None)


def _ece_rows(conf: np.ndarray, correct: np.ndarray, n_bins: int = ECE_BINS) -> np.ndarray:
    """ECE of each row of [B, n] confidences / correctness (equal-width bins on [0, 1])."""
    bins = np.minimum((np.clip(conf, 0, 1) * n_bins).astype(int), n_bins - 1)
    offset = bins + n_bins * np.arange(conf.shape[0])[:, None]
    size = conf.shape[0] * n_bins
    gap = np.bincount(offset.ravel(), weights=(correct - conf).ravel(), minlength=size)
    return np.abs(gap).reshape(conf.shape[0], n_bins).sum(1) / conf.shape[1]


def _per_item(probs: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    n = len(labels)
    onehot = np.zeros_like(probs)
    onehot[np.arange(n), labels] = 1.0
    return {
        "conf": probs.max(1),
        "correct": (probs.argmax(1) == labels).astype(float),
        "nll": -np.log(np.clip(probs[np.arange(n), labels], 1e-12, 1.0)),
        "brier": ((probs - onehot) ** 2).sum(1),
    }


def _interval(point: float, boots: np.ndarray) -> list[float]:
    boots = boots[np.isfinite(boots)]
    if boots.size == 0:
        return [point, float("nan"), float("nan")]
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return [float(point), float(lo), float(hi)]


def evaluate(probs: np.ndarray, labels: np.ndarray, *, mi: np.ndarray | None = None,
             ood_probs: np.ndarray | None = None, ood_mi: np.ndarray | None = None,
             seed: int = 0) -> dict[str, Any]:
    """Accuracy, ECE (+ its noise floor), NLL, multi-class Brier, misclassification and OOD AUROCs.

    Each value is [point, 2.5%, 97.5%] over ``N_BOOT`` resamples of the items (OOD: the in- and
    out-of-distribution items resampled separately).
    """
    rng = np.random.default_rng(seed)
    n = len(labels)
    per = _per_item(probs, labels)
    idx = rng.integers(0, n, size=(N_BOOT, n))
    out: dict[str, Any] = {"n": n}
    for key in ("correct", "nll", "brier"):
        name = "accuracy" if key == "correct" else key
        out[name] = _interval(float(per[key].mean()), per[key][idx].mean(1))
    conf, correct = per["conf"], per["correct"]
    out["ece"] = _interval(float(_ece_rows(conf[None], correct[None])[0]), _ece_rows(conf[idx], correct[idx]))
    out["ece_floor"] = list(ece_floor(conf))
    out["mean_confidence"] = float(conf.mean())
    wrong = 1.0 - correct
    signals = {"entropy": entropy(probs)}
    if mi is not None:
        signals["mi"] = mi
    for name, sig in signals.items():
        point = float(_auroc_rows(wrong[None], sig[None])[0])
        out[f"auroc_{name}"] = _interval(point, _auroc_rows(wrong[idx], sig[idx]))
    if ood_probs is not None:
        m = len(ood_probs)
        jdx = rng.integers(0, m, size=(N_BOOT, m))
        is_ood = np.r_[np.zeros(n), np.ones(m)]
        ood_signals = {"entropy": (entropy(probs), entropy(ood_probs))}
        if mi is not None and ood_mi is not None:
            ood_signals["mi"] = (mi, ood_mi)
        for name, (a, b) in ood_signals.items():
            point = float(_auroc_rows(is_ood[None], np.r_[a, b][None])[0])
            boots = _auroc_rows(np.broadcast_to(is_ood, (N_BOOT, n + m)), np.c_[a[idx], b[jdx]])
            out[f"ood_auroc_{name}"] = _interval(point, boots)
        out["ood_n"] = m
    return out


def paired_diff(a: np.ndarray, b: np.ndarray, labels: np.ndarray, metric: str, seed: int = 0) -> list[float]:
    """metric(a) - metric(b) on the same resampled items: [point, 2.5%, 97.5%]."""
    pa, pb = _per_item(a, labels), _per_item(b, labels)
    idx = np.random.default_rng(seed).integers(0, len(labels), size=(N_BOOT, len(labels)))
    if metric == "ece":
        point = _ece_rows(pa["conf"][None], pa["correct"][None])[0] - _ece_rows(pb["conf"][None], pb["correct"][None])[0]
        boots = _ece_rows(pa["conf"][idx], pa["correct"][idx]) - _ece_rows(pb["conf"][idx], pb["correct"][idx])
    else:
        key = "correct" if metric == "accuracy" else metric
        point = pa[key].mean() - pb[key].mean()
        boots = pa[key][idx].mean(1) - pb[key][idx].mean(1)
    return _interval(float(point), boots)


def _log(probs: np.ndarray) -> np.ndarray:
    """log p, with -inf (not a clipped finite value) for options an item does not have (p = 0)."""
    with np.errstate(divide="ignore"):
        return np.where(probs > 0, np.log(np.where(probs > 0, probs, 1.0)), -np.inf)


def fit_temperature(probs: np.ndarray, labels: np.ndarray) -> float:
    """T minimising the NLL of p^(1/T) (renormalised) on held-out items: a grid over log T.

    For one model p = softmax(z) this is the usual softmax(z / T); for an ensemble it rescales
    the log of the mean probability (the "temperature of the mean").
    """
    logp = _log(probs)
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 601))
    best, best_nll = 1.0, np.inf
    for t in grid:
        nll = -scaled_logp(logp, t)[np.arange(len(labels)), labels].mean()
        if nll < best_nll:
            best, best_nll = float(t), nll
    return best


def scaled_logp(logp: np.ndarray, t: float) -> np.ndarray:
    z = logp / t
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def apply_temperature(probs: np.ndarray, t: float) -> np.ndarray:
    return np.exp(scaled_logp(_log(probs), t))


def diversity(member_logp: np.ndarray) -> dict[str, float]:
    """Pairwise disagreement of the members' answers and the mean mutual information."""
    m = member_logp.shape[0]
    if m < 2:
        return {}
    preds = member_logp.argmax(-1)
    pairs = [(a, b) for a in range(m) for b in range(a + 1, m)]
    return {
        "pairwise_disagreement": float(np.mean([(preds[a] != preds[b]).mean() for a, b in pairs])),
        "mean_mi": float(mutual_information(member_logp).mean()),
    }


# --------------------------------------------------------------------------- training loss


def loss_ends(fit: dict[str, Any], members: int | None = None) -> dict[str, Any] | None:
    """Each member's training loss at the start and the end: the mean of its first and of its last
    w steps (w = a tenth of the steps, 1 to 20; one step's batch is noisy). A member whose loss
    does not fall has not been tuned. ``members``: only the first so many (SVE M=4 of 16).
    A fit saved before per-member losses were kept has only the members' mean (``mean_only``)."""
    rows, mean_only = fit.get("member_history"), False
    if not rows:
        if not fit.get("history"):
            return None
        rows, mean_only = [[h] for h in fit["history"]], True
    steps = np.asarray(rows, dtype=float)[:, :members]  # [steps, M]
    w = max(1, min(20, len(steps) // 10))
    return {"window": w, "first": steps[:w].mean(0).tolist(), "last": steps[-w:].mean(0).tolist(),
            "mean_only": mean_only}


def loss_cell(ends: dict[str, Any] | None) -> str:
    """'first → last' of each member, for the page; '–' when not recorded."""
    if ends is None:
        return "–"
    pairs = [f"{a:.3f}→{b:.3f}" for a, b in zip(ends["first"], ends["last"], strict=True)]
    if ends.get("mean_only"):
        return f"{pairs[0]} (mean over all the run's members: this run kept no per-member losses)"
    falls = sum(b < a for a, b in zip(ends["first"], ends["last"], strict=True))
    return f"{', '.join(pairs)} ({falls}/{len(pairs)} fall)"
