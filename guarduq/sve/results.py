"""What the ensemble reports: its opinion on one response, its parameter cost, and answer agreement."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SVEOpinion:
    """The ensemble's view of one (prompt, response); same attribute names as ``policy.SecondOpinion``.

    ``variance`` is the population variance of the member mean probabilities;
    ``mutual_information`` is H(mean member predictive) − mean member entropy, per response
    token, averaged (nats). ``answer``/``agrees`` are filled only when a greedy answer was asked for.
    """

    member_mean_probs: list[float]
    mean_prob: float
    variance: float
    mutual_information: float
    agrees: bool | None = None
    answer: str | None = None
    n_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Overhead:
    """Parameter cost of the ensemble. ``ratio`` = extra_params / base_params, where
    extra_params = (M−1) × per_member_params (one member stands in for the base model), the
    quantity the paper's formula 5(M−1)/(4d) approximates for a full-width 4d-MLP transformer."""

    members: int
    per_member_params: int
    member_params: int
    extra_params: int
    base_params: int
    ratio: float
    formula: float
    hidden_size: int
    targeted_blocks: int
    total_blocks: int
    n_layers: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
