"""Epistemic and aleatoric scores from one forward and one backward pass.

For a prompt x and response tokens y_1..y_T, with p_t = p(y_t | x, y<t) at temperature 1 and
p̄ = mean_t p_t:

* epistemic = ‖∇_θ p̄‖²: the delta method with an isotropic parameter covariance,
  Var[p̄] ≈ gᵀ Σ_θ g ≈ ‖g‖².
* aleatoric = p̄ (1 − p̄): the variance of a Bernoulli with success probability p̄.

The gradient is never held whole: a post-accumulate hook on each selected parameter adds the
squared norm of its gradient to a per-parameter float64 total and frees ``.grad`` at once, so
peak memory is the activations plus the largest single parameter gradient.
"""

from __future__ import annotations

import math
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from guarduq.errors import ContextLengthError, InputError

# Every *uncertainty* score follows "higher = more uncertain". Confidence-like quantities
# (mean_token_prob, mean_logprob, min_token_prob) keep their own names.
UNCERTAINTY_FIELDS = ("epistemic", "aleatoric", "mean_entropy")


@dataclass(frozen=True)
class Scores:
    """Everything one forward+backward pass yields for one (prompt, response) pair."""

    epistemic: float
    aleatoric: float
    mean_token_prob: float
    mean_logprob: float
    min_token_prob: float
    mean_entropy: float
    n_tokens: int
    token_probs: tuple[float, ...]
    n_params: int
    valid: bool = True
    reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self, with_token_probs: bool = True) -> dict[str, Any]:
        d = asdict(self)
        d["token_probs"] = list(self.token_probs)
        if not with_token_probs:
            d.pop("token_probs")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scores:
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["token_probs"] = tuple(kw.get("token_probs", ()))
        kw.setdefault("timings", {})
        return cls(**kw)
