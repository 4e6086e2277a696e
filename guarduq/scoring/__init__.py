"""Per-response scores: the gradient scorer (``uncertainty``) and the baselines it is compared with.

``from guarduq.scoring import GradientScorer, Scores`` is the usual entry point. The baselines
live in :mod:`guarduq.scoring.baselines` and are imported from there, so that loading the scorer
does not also load the dataset helpers the baselines grade answers with.
"""

from guarduq.scoring.uncertainty import (
    GradientScorer,
    Scores,
    mean_token_prob,
    model_lock,
    response_log_probs,
    select_parameters,
)

__all__ = [
    "GradientScorer",
    "Scores",
    "mean_token_prob",
    "model_lock",
    "response_log_probs",
    "select_parameters",
]
