"""Per-response scores: the gradient scorer (``uncertainty``) and the baselines it is compared with.

``from guarduq.scoring import GradientScorer, Scores`` is the usual entry point; the names load
their module on first use (``guarduq._lazy``), so ``scoring.parameters`` imports without the
scorer. The baselines live in :mod:`guarduq.scoring.baselines` and are imported from there, so
that loading the scorer does not also load the dataset helpers the baselines grade answers with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from guarduq._lazy import attach

if TYPE_CHECKING:
    from guarduq.scoring.gradients import model_lock
    from guarduq.scoring.parameters import select_parameters
    from guarduq.scoring.scores import Scores
    from guarduq.scoring.uncertainty import GradientScorer, mean_token_prob, response_log_probs

__all__ = [
    "GradientScorer",
    "Scores",
    "mean_token_prob",
    "model_lock",
    "response_log_probs",
    "select_parameters",
]
__getattr__, __dir__ = attach(
    __name__,
    {
        "guarduq.scoring.gradients": ["model_lock"],
        "guarduq.scoring.parameters": ["select_parameters"],
        "guarduq.scoring.scores": ["Scores"],
        "guarduq.scoring.uncertainty": ["GradientScorer", "mean_token_prob", "response_log_probs"],
    },
)
