"""What one scoring pass yields: the :class:`Scores` of a (prompt, response) pair.

Both scorers (one sequence in ``uncertainty``, a batch in ``batched``) build their results with
:func:`pass_scores`, from this module below both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from guarduq.scoring.parameters import grad_profile

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
    # ‖∇p̄‖² split by parameter group (see ``parameter_groups``); sums to ``epistemic``.
    grad_profile: dict[str, float] = field(default_factory=dict)
    # which parameters the gradient covered (``parameter_set_id``); scores taken over different
    # sets are different quantities, and a calibrator reads only its own
    parameter_set: str = "all"

    def to_dict(self, with_token_probs: bool = True, with_grad_profile: bool = True) -> dict[str, Any]:
        """JSON-friendly fields; log lines drop the per-token and per-group lists to stay short."""
        d = asdict(self)
        d["token_probs"] = list(self.token_probs)
        if not with_token_probs:
            d.pop("token_probs")
        if not with_grad_profile:
            d.pop("grad_profile", None)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scores:
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["token_probs"] = tuple(kw.get("token_probs", ()))
        kw.setdefault("timings", {})
        kw["grad_profile"] = dict(kw.get("grad_profile") or {})  # absent in caches written before it
        kw["parameter_set"] = kw.get("parameter_set") or "all"  # every earlier cache scored all
        return cls(**kw)


def pass_scores(
    tok_logp: Any,
    entropy: float,
    totals: list[float],
    finite: bool,
    timings: dict[str, float],
    *,
    n_params: int,
    groups: Sequence[str],
    parameter_set: str,
) -> Scores:
    """Scores from one pass: the response tokens' log p (a tensor [T]), the mean entropy and the
    per-parameter squared norms, named by ``groups``. The one-sequence and the batch path both
    end here, so their numbers are built alike."""
    probs = tok_logp.exp()
    pb = float(probs.mean())
    token_probs = tuple(float(x) for x in probs)
    epistemic = math.fsum(totals)  # fixed order: bit-identical across runs and threads
    valid, reason = True, None
    if not all(math.isfinite(x) for x in token_probs):
        valid, reason = False, "non-finite token probability"
    elif not finite or not math.isfinite(epistemic):
        valid, reason = False, "non-finite gradient"
    return Scores(
        epistemic=epistemic,
        aleatoric=pb * (1.0 - pb),
        mean_token_prob=pb,
        mean_logprob=float(tok_logp.mean()),
        min_token_prob=min(token_probs),
        mean_entropy=entropy,
        n_tokens=len(token_probs),
        token_probs=token_probs,
        n_params=n_params,
        valid=valid,
        reason=reason,
        timings=dict(timings),
        grad_profile=grad_profile(groups, totals),
        parameter_set=parameter_set,
    )
