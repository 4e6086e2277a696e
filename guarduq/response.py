"""What a Guard hands back: the reply with its scores, risk, decision and the pair that decided
it (``GuardedResponse``), and the explicit scores of a reply that could not be scored."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from guarduq.decider import Identity
from guarduq.layout import PromptLike
from guarduq.models import ModelInfo
from guarduq.policy import Decision
from guarduq.policy.context import InForce
from guarduq.scoring.scores import Scores


@dataclass(frozen=True)
class GuardedResponse:
    """A response with its scores; ``ended`` says whether the model closed its turn."""

    text: str
    scores: Scores
    ended: bool
    prompt: PromptLike
    model: ModelInfo
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    timings: dict[str, float] = field(default_factory=dict)
    risk: float | None = None  # calibrated P(wrong), when the Guard has a calibrator
    decision: Decision | None = None  # what the policy decided, when the Guard has one
    decided_by: Identity | None = None  # the policy/calibrator pair that decided it
    in_force: InForce | None = None  # its traffic group, the drift case, which certificate decided

    @property
    def shown_text(self) -> str:
        """What the user should see: the policy's text when there is a decision, else the reply."""
        return self.decision.text if self.decision is not None else self.text

    def metadata(self, scored_by: str = "model") -> dict[str, Any]:
        """The JSON-ready record a face (LangChain message, server reply) attaches to the answer.

        ``scored_by`` is ``"model"`` when the scores are the generating model's own, ``"scorer"``
        when a local model read someone else's text by teacher forcing.
        """
        return {
            "request_id": self.request_id,
            "scored_by": scored_by,
            "model": self.model.name,
            "model_fingerprint": self.model.fingerprint,
            "ended": self.ended,
            "scores": self.scores.to_dict(with_token_probs=False),
            "risk": self.risk,
            "decision": self.decision.to_dict() if self.decision is not None else None,
            **(self.decided_by or Identity()).to_dict(),  # policy, policy_sha256, calibrator_sha256
            "in_force": self.in_force.to_dict() if self.in_force is not None else None,
            "timings": dict(self.timings),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "ended": self.ended,
            "model": self.model.name,
            "model_fingerprint": self.model.fingerprint,
            **self.scores.to_dict(with_token_probs=False),
            "timings": {**self.scores.timings, **self.timings},
            **({"risk": self.risk} if self.risk is not None else {}),
            **({"decision": self.decision.to_dict()} if self.decision is not None else {}),
        }


def invalid_scores(reason: str, n_params: int = 0, parameter_set: str = "all") -> Scores:
    """Scores for a response that could not be scored: explicit ``valid=False``, never silent
    (over the scorer's parameter set, so its calibrator turns them into risk 1.0, not an error)."""
    nan = math.nan
    return Scores(nan, nan, nan, nan, nan, nan, 0, (), n_params, valid=False, reason=reason,
                  parameter_set=parameter_set)
