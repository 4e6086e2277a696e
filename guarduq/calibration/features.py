"""Features a calibrator reads off the scores: the named feature functions, named feature sets and
the feature matrix.

Every feature is a function of one score dict (a ``Scores.to_dict()`` or a scoring-cache line).
Most come free with the forward + backward pass guarduq already runs; a few cost extra work and
are opt-in (:data:`COSTLY`). A feature the dict cannot provide (an old cache without
``grad_profile``, a run without P(True)) raises :class:`FeatureUnavailable`; the row is then
invalid for that calibrator (counted and excluded when fitting, risk 1.0 when serving), never a
crash. :func:`missing_features` says which features a set of scores lacks and why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from guarduq.errors import CalibrationError
from guarduq.scoring.parameters import ALL_PARAMETERS

# An exactly-zero gradient (p̄ saturated) would make log(epistemic) = -inf; floor it instead.
EPISTEMIC_FLOOR = 1e-12
# Floors for the other logs: a token probability or a gradient share can underflow to 0.
PROB_FLOOR = 1e-12
SHARE_FLOOR = 1e-12

ScoreLike = Any  # guarduq.scoring.uncertainty.Scores or a mapping with the same field names


class FeatureUnavailable(KeyError):
    """The score dict lacks what a feature needs (e.g. ``grad_profile`` in an old cache)."""


def restrict_profile(score: Mapping[str, Any], keep: Callable[[str], bool], name: str) -> dict[str, Any]:
    """The score dict a pass over a subset of the parameters would give, read off an all-parameter one.

    The gradient over a subset S of the parameters is the full gradient restricted to S, so
    ‖∇_S p̄‖² = Σ over the profile groups in S of their ‖·‖², and the pass over S would report
    exactly those groups as its profile; everything else (p̄, token probabilities, entropy) does
    not depend on S. ``keep`` says which ``grad_profile`` groups S holds (S must be a union of
    groups: an LM head tied to the embedding is one group, ``embed``); ``name`` is S's
    ``parameter_set``. tests/unit/test_long_context.py scores both ways and compares.
    """
    prof = score.get("grad_profile")
    if not isinstance(prof, Mapping) or not prof:
        raise FeatureUnavailable("grad_profile")
    kept = {g: float(v) for g, v in prof.items() if keep(str(g))}
    return {**score, "grad_profile": kept, "epistemic": math.fsum(kept.values()), "parameter_set": name}


_BLOCK_GROUP = re.compile(r"^block\.(\d+)\.")
_LAST_N_BLOCKS = re.compile(r"^last_n_blocks=(\d+)$")


def derive_parameter_set(score: Mapping[str, Any], parameter_set: str) -> dict[str, Any] | None:
    """``score`` (an all-parameter pass) as a pass over ``parameter_set`` would give it, where its
    ``grad_profile`` says so exactly: ``last_n_blocks=N`` is the union of the last N blocks'
    groups (the blocks counted from the profile, which holds every block). None for any other
    set, or without a profile. Generation does not depend on the set, so neither does the
    response the score belongs to."""
    m = _LAST_N_BLOCKS.match(parameter_set)
    prof = score.get("grad_profile")
    if m is None or not isinstance(prof, Mapping):
        return None
    blocks = [int(b.group(1)) for g in prof if (b := _BLOCK_GROUP.match(str(g)))]
    if not blocks:
        return None
    first = max(blocks) + 1 - int(m.group(1))
    return restrict_profile(score, lambda g: bool(b := _BLOCK_GROUP.match(g)) and int(b.group(1)) >= first,
                            parameter_set)


def _get(s: Mapping[str, Any], key: str) -> Any:
    value = s.get(key)
    if value is None:
        raise FeatureUnavailable(key)
    return value


def _log_epistemic(s: Mapping[str, Any]) -> float:
    e = float(_get(s, "epistemic"))
    return math.log(max(e, EPISTEMIC_FLOOR)) if e >= 0 else math.nan


def _log_epistemic_norm(s: Mapping[str, Any]) -> float:
    """log ||grad log p̄||² = log ||grad p̄||² - 2 log p̄ (chain rule: grad log p̄ = grad p̄ / p̄).

    ``grad p̄`` is a mean of ``p_t grad log p_t``, so its norm grows with the answer's own
    probability; dividing by p̄² asks whether the parameters are unsure beyond that confidence.
    """
    e, p = float(_get(s, "epistemic")), float(_get(s, "mean_token_prob"))
    if e < 0 or not p > 0:
        return math.nan
    return math.log(max(e, EPISTEMIC_FLOOR)) - 2 * math.log(max(p, PROB_FLOOR))


def _logit(p: float) -> float:
    """log(p / (1 - p)), with p kept inside [PROB_FLOOR, 1 - PROB_FLOOR] (a risk of exactly 0 or 1)."""
    if not 0 <= p <= 1:
        return math.nan
    p = min(max(p, PROB_FLOOR), 1 - PROB_FLOOR)
    return math.log(p) - math.log1p(-p)


def _log_prob(s: Mapping[str, Any], key: str) -> float:
    p = float(_get(s, key))
    return math.log(max(p, PROB_FLOOR)) if p >= 0 else math.nan


# ----------------------------------------------------------------------------- gradient profile

_BLOCK_KEY = re.compile(r"^block\.(\d+)\.(attn|mlp|norm)$")


def _profile(s: Mapping[str, Any]) -> tuple[dict[str, float], dict[int, dict[str, float]], float]:
    """(top-level groups, per-block groups, total) of ``grad_profile``; raises when absent."""
    prof = s.get("grad_profile")
    if not isinstance(prof, Mapping) or not prof:
        raise FeatureUnavailable("grad_profile")
    top: dict[str, float] = {}
    blocks: dict[int, dict[str, float]] = {}
    for k, v in prof.items():
        v = float(v)
        m = _BLOCK_KEY.match(str(k))
        if m:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            top[str(k)] = v
    total = sum(top.values()) + sum(sum(b.values()) for b in blocks.values())
    return top, blocks, total


def _log_share(part: float, total: float) -> float:
    if not total > 0 or not math.isfinite(total):
        return math.nan
    return math.log(max(part / total, SHARE_FLOOR))


def _grad_embed_head(s: Mapping[str, Any]) -> float:
    """Summed, so a model with tied embeddings (one tensor, reported under either name) is fine."""
    top, _, total = _profile(s)
    return _log_share(top.get("embed", 0.0) + top.get("head", 0.0), total)


def _grad_attn_mlp(s: Mapping[str, Any]) -> float:
    _, blocks, _ = _profile(s)
    attn = sum(b.get("attn", 0.0) for b in blocks.values())
    mlp = sum(b.get("mlp", 0.0) for b in blocks.values())
    if not blocks or attn + mlp <= 0:
        return math.nan
    return math.log(max(attn, SHARE_FLOOR * (attn + mlp))) - math.log(
        max(mlp, SHARE_FLOOR * (attn + mlp))
    )


def _third(s: Mapping[str, Any], which: int) -> float:
    """Log share of the whole gradient in the first (0) or last (2) third of the blocks."""
    _, blocks, total = _profile(s)
    if not blocks:
        return math.nan
    n = max(blocks) + 1
    lo, hi = (0, n / 3) if which == 0 else (2 * n / 3, n)
    part = sum(sum(b.values()) for i, b in blocks.items() if lo <= i < hi)
    return _log_share(part, total)


# ----------------------------------------------------------------------------- the registry

FEATURES: dict[str, Callable[[Mapping[str, Any]], float]] = {
    # the paper's pair
    "log_epistemic": _log_epistemic,
    "log_epistemic_norm": _log_epistemic_norm,
    "aleatoric": lambda s: float(_get(s, "aleatoric")),
    # likelihood of the answer, from the same forward pass
    "mean_logprob": lambda s: float(_get(s, "mean_logprob")),
    "log_min_token_prob": lambda s: _log_prob(s, "min_token_prob"),
    "mean_entropy": lambda s: float(_get(s, "mean_entropy")),
    "log_n_tokens": lambda s: math.log(max(float(_get(s, "n_tokens")), 1.0)),
    # gradient profile, from the same backward pass (needs Scores.grad_profile)
    "grad_embed_head": _grad_embed_head,
    "grad_attn_mlp": _grad_attn_mlp,
    "grad_early": lambda s: _third(s, 0),
    "grad_late": lambda s: _third(s, 2),
    # opt-in, extra cost
    "p_true": lambda s: float(_get(s, "p_true")),
    # SVE second opinion (evaluation.add_sve_opinion): one folded forward of the members
    "sve_mean_prob": lambda s: float(_get(s, "sve_mean_prob")),
    "sve_variance": lambda s: float(_get(s, "sve_variance")),
    "sve_mi": lambda s: float(_get(s, "sve_mi")),
    "sve_agree": lambda s: float(_get(s, "sve_agree")),
    # a cascade's second stage (guarduq.calibration.cascade): what the first stage concluded
    "first_stage_logit": lambda s: _logit(float(_get(s, "first_risk"))),
    # older names, kept so artifacts and scripts that use them still work
    "min_token_prob": lambda s: float(_get(s, "min_token_prob")),
    "n_tokens": lambda s: float(_get(s, "n_tokens")),
    "mean_token_prob": lambda s: float(_get(s, "mean_token_prob")),
}

# One line per feature: what it is and why it is there.
FEATURE_DOCS: dict[str, str] = {
    "log_epistemic": "log ||grad p̄||²: the paper's epistemic score; log, as it spans decades",
    "log_epistemic_norm": "log ||grad log p̄||² = log ||grad p̄||² - 2 log p̄: epistemic net of confidence",
    "aleatoric": "p̄(1-p̄): the paper's aleatoric score (peaks at p̄ = 0.5, so not monotone in p̄)",
    "mean_logprob": "mean log p(token): how likely the model finds its own answer (-log perplexity)",
    "log_min_token_prob": "log of the least likely token: one invented token sinks a fact",
    "mean_entropy": "mean next-token entropy: how spread the model's choices were along the answer",
    "log_n_tokens": "log answer length: long answers ramble, and p̄ averages over more tokens",
    "grad_embed_head": "log share of ||grad||² in the embeddings + output head: a lexical doubt",
    "grad_attn_mlp": "log ratio of ||grad||² in attention vs MLP blocks: routing vs stored facts",
    "grad_early": "log share of ||grad||² in the first third of the blocks",
    "grad_late": "log share of ||grad||² in the last third of the blocks",
    "p_true": "P(True) the model gives its own answer when asked: one extra forward (opt-in)",
    "sve_mean_prob": "SVE members' mean p̄ of the answer: a trained ensemble's own likelihood (opt-in)",
    "sve_variance": "variance of the SVE members' p̄: how much members that fit the data differ (opt-in)",
    "sve_mi": "SVE mutual information per answer token (nats): disagreement on each next token (opt-in)",
    "sve_agree": "1 if the SVE members' own greedy answer agrees with the answer, else 0 (opt-in)",
    "first_stage_logit": "logit of the first-stage calibrator's risk: all the first stage knows, in one number",
    "min_token_prob": "least likely token's probability (older name; prefer log_min_token_prob)",
    "n_tokens": "answer length in tokens (older name; prefer log_n_tokens)",
    "mean_token_prob": "p̄, the mean token probability",
}

# Direction expected before seeing data: +1 when a larger value should mean "more likely wrong".
# Used to orient single signals for AUROC; the gradient-profile shares have no prior (+1 by
# convention, so an AUROC below 0.5 means the opposite direction).
ORIENTATION: dict[str, int] = {
    "log_epistemic": 1,
    "log_epistemic_norm": 1,
    "aleatoric": 1,
    "mean_logprob": -1,
    "log_min_token_prob": -1,
    "mean_entropy": 1,
    "log_n_tokens": 1,
    "grad_embed_head": 1,
    "grad_attn_mlp": 1,
    "grad_early": 1,
    "grad_late": 1,
    "p_true": -1,
    "sve_mean_prob": -1,
    "sve_variance": 1,
    "sve_mi": 1,
    "sve_agree": -1,
    "first_stage_logit": 1,
    "min_token_prob": -1,
    "n_tokens": 1,
    "mean_token_prob": -1,
}

# What each score-dict key needs, for the message when it is missing.
_NEEDS: dict[str, str] = {
    "grad_profile": "the per-group gradient profile (Scores.grad_profile), which scores from "
    "before the batched scorer lack: re-score the data with a guarduq that writes it",
    "p_true": "P(True), one extra forward per answer: `guarduq calibrate` computes it when the "
    "feature set asks for it (same-pass+ptrue)",
    **{key: "an SVE second opinion, one folded forward of the ensemble's members per answer: "
       "`guarduq calibrate --sve FILE` computes it when the feature set asks for it (same-pass+sve)"
       for key in ("sve_mean_prob", "sve_variance", "sve_mi")},
    "first_risk": "the first-stage risk of a cascade (guarduq.calibration.cascade adds it)",
    "sve_agree": "the SVE members' own greedy answer: `guarduq calibrate --sve FILE` with "
    "--sve-answer-tokens N > 0 computes it when the feature set asks for it (same-pass+sve)",
}

SVE: tuple[str, ...] = ("sve_mean_prob", "sve_variance", "sve_mi", "sve_agree")

# Features that cost more than the pass guarduq already runs.
COSTLY: frozenset[str] = frozenset({"p_true", *SVE})

PAPER: tuple[str, ...] = ("log_epistemic", "aleatoric")
LIKELIHOOD: tuple[str, ...] = ("mean_logprob", "log_min_token_prob", "mean_entropy", "log_n_tokens")
GRAD_PROFILE: tuple[str, ...] = ("grad_embed_head", "grad_attn_mlp", "grad_early", "grad_late")

FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "paper": PAPER,  # the paper's pair, always available
    "likelihood": LIKELIHOOD,  # the answer's likelihood alone, no gradient
    "paper+likelihood": PAPER + LIKELIHOOD,  # every free feature an old cache holds
    "same-pass": PAPER + LIKELIHOOD + GRAD_PROFILE,  # everything free from one forward + backward
    "same-pass+ptrue": PAPER + LIKELIHOOD + GRAD_PROFILE + ("p_true",),  # + one extra forward
    "same-pass+sve": PAPER + LIKELIHOOD + GRAD_PROFILE + SVE,  # + an SVE second opinion
    "same-pass+ptrue+sve": PAPER + LIKELIHOOD + GRAD_PROFILE + ("p_true",) + SVE,
    # a cascade's second stage: the first stage's verdict and the SVE's, no greedy answer
    "cascade": ("first_stage_logit", "sve_mean_prob", "sve_variance", "sve_mi"),
    "cascade+agree": ("first_stage_logit", *SVE),
}
# The default set: free, available on every cache, and as good as any set within one dataset
# (docs/results/risk.md). Across several datasets, `same-pass` fitted pooled ranks traffic like
# the calibration mix best (the shipped calibrator uses it); the `sign-stable` rule
# (guarduq.calibration.analysis.FEATURE_RULES) fitted within datasets (Calibrator(within_groups=
# True)) ranks better inside most single datasets (the shipped within calibrator).
DEFAULT_FEATURE_SET = "paper+likelihood"
DEFAULT_FEATURES: tuple[str, ...] = FEATURE_SETS[DEFAULT_FEATURE_SET]

# ----------------------------------------------------------------------------- cost per answer

# Features that need the backward pass; every other free feature comes from the forward alone.
GRADIENT_FEATURES: frozenset[str] = frozenset({"log_epistemic", "log_epistemic_norm", *GRAD_PROFILE})


@dataclass(frozen=True)
class SVEShape:
    """What an SVE second opinion costs: M members, SVE layers in the last ``targeted_blocks`` of
    ``total_blocks`` blocks, and the greedy answer's token budget (0: no ``sve_agree``).
    ``evaluation.add_sve_opinion`` stores these with the features (``sve_members`` ...)."""

    members: int
    targeted_blocks: int
    total_blocks: int
    answer_tokens: int = 0

    @classmethod
    def of(cls, scores: Mapping[str, Any]) -> SVEShape | None:
        """The shape a score dict's SVE features were computed with; None when it has none."""
        try:
            return cls(int(scores["sve_members"]), int(scores["sve_targeted_blocks"]),
                       int(scores["sve_total_blocks"]), int(scores.get("sve_answer_tokens") or 0))
        except (KeyError, TypeError, ValueError):
            return None


def forward_equivalents(features: Iterable[str], sve: SVEShape | None = None) -> float | None:
    """Work per answer, beyond generating it, in forward passes over prompt + answer; ``None``
    when the features need an SVE opinion and ``sve`` does not say its shape.

    Counted as FLOPs, not wall time: the scoring forward is 1; a backward ≈ 2 forwards (gradients
    of activations and of weights), so the gradient features make it 3 (over every parameter; a
    ``last_n_blocks`` set costs less); P(True) is +1 forward over its own prompt; an SVE opinion
    is one folded forward in which the L − N blocks below the SVE ones run once (prefix shared,
    guarduq's default) and the N SVE blocks M times: +(L − N + M·N)/L, or +M when the SVE layers
    are not in numbered blocks; the members' greedy answer (``sve_agree``) adds ≈ M, M full
    members over the prompt and their own answer (KV cache, no sharing; token by token, so
    slower in wall time than its FLOPs say).
    """
    feats = set(features)
    cost = 1.0 + (2.0 if feats & GRADIENT_FEATURES else 0.0) + (1.0 if "p_true" in feats else 0.0)
    if feats & set(SVE):
        if sve is None:
            return None
        m, n, total = sve.members, sve.targeted_blocks, sve.total_blocks
        cost += (total - n + m * n) / total if 0 < n <= total else float(m)
        if "sve_agree" in feats and sve.answer_tokens > 0:
            cost += m
    return cost


def resolve_features(spec: str | Sequence[str]) -> tuple[str | None, tuple[str, ...]]:
    """``(set name or None, feature names)`` from a set name, a comma list or a sequence."""
    if isinstance(spec, str):
        name = spec.strip()
        if name in FEATURE_SETS:
            return name, FEATURE_SETS[name]
        feats = tuple(f.strip() for f in name.split(",") if f.strip())
    else:
        feats = tuple(spec)
    for set_name, members in FEATURE_SETS.items():
        if feats == members:
            return set_name, feats
    unknown = [f for f in feats if f not in FEATURES]
    if unknown or not feats:
        raise CalibrationError(
            f"unknown feature(s) {unknown or '(none given)'}; choose a set from "
            f"{sorted(FEATURE_SETS)} or features from {sorted(FEATURES)}"
        )
    if len(set(feats)) != len(feats):
        raise CalibrationError(f"duplicate features in {list(feats)}")
    return None, feats


def as_score_dict(scores: ScoreLike) -> dict[str, Any]:
    """A ``Scores`` object or a mapping (a cache line) as a plain dict of its fields."""
    if isinstance(scores, Mapping):
        return dict(scores)
    to_dict = getattr(scores, "to_dict", None)
    if callable(to_dict):
        return to_dict(with_token_probs=False)
    raise CalibrationError(f"expected Scores or a mapping of scores, got {type(scores).__name__}")


def score_parameter_set(s: ScoreLike) -> str:
    """The parameter set a score was taken over (``Scores.parameter_set``; absent: all)."""
    value = s.get("parameter_set") if isinstance(s, Mapping) else getattr(s, "parameter_set", None)
    return str(value) if value else ALL_PARAMETERS


def as_float(x: Any) -> float:
    """``float(x)``, or NaN where x is not a number (a missing or malformed raw score)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def feature_value(d: Mapping[str, Any], name: str) -> float:
    """One feature of one score dict; NaN when the dict cannot provide it."""
    try:
        return float(FEATURES[name](d))
    except (KeyError, TypeError, ValueError):  # FeatureUnavailable is a KeyError
        return math.nan


def feature_matrix(
    scores: Iterable[ScoreLike], features: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """``(X, valid)``: one row per response; ``valid`` is False for invalid or non-finite rows."""
    rows, valid = [], []
    for s in scores:
        d = as_score_dict(s)
        row = [feature_value(d, f) for f in features]
        ok = bool(d.get("valid", True)) and all(math.isfinite(v) for v in row)
        rows.append(row)
        valid.append(ok)
    X = np.asarray(rows, dtype=float).reshape(len(rows), len(features))
    return X, np.asarray(valid, dtype=bool)


def missing_features(scores: Iterable[ScoreLike], features: Sequence[str]) -> dict[str, str]:
    """Feature -> message, for each feature that *no* score provides (the others are fine)."""
    dicts = [as_score_dict(s) for s in scores]
    out: dict[str, str] = {}
    for f in features:
        if any(math.isfinite(feature_value(d, f)) for d in dicts):
            continue
        key = "?"
        for d in dicts[:1]:
            try:
                FEATURES[f](d)
            except FeatureUnavailable as exc:
                key = str(exc.args[0])
            except (KeyError, TypeError, ValueError):
                pass
        need = _NEEDS.get(key, f"the score field '{key}'")
        out[f] = f"feature '{f}' is unavailable in these {len(dicts)} scores: it needs {need}"
    return out


def _labels(labels: Iterable[Any], n: int) -> np.ndarray:
    y = np.asarray(list(labels))
    if y.shape != (n,):
        raise CalibrationError(f"got {y.size} labels for {n} scores")
    if y.dtype == bool:
        y = y.astype(int)
    if not np.isin(y, (0, 1)).all():
        raise CalibrationError("labels must be 0 (wrong) or 1 (correct)")
    return y.astype(int)
