"""guarduq: does the model know what it is saying? Per-response epistemic and aleatoric scores.

The errors and the version load with the package; every other public name loads its module on
first use (``guarduq._lazy``), so ``import guarduq.policy`` or ``guarduq.review`` loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from guarduq._lazy import attach
from guarduq._version import __version__
from guarduq.errors import (
    ArtifactError,
    CacheCorruptError,
    CalibrationError,
    ContextLengthError,
    DatasetError,
    EscalationError,
    FingerprintMismatchError,
    GuardUQAbstention,
    GuardUQError,
    InputError,
    ModelLoadError,
    ModelNotFoundError,
    PolicyError,
    ScoringError,
    SVEError,
)

if TYPE_CHECKING:
    from guarduq.calibration.calibrator import Calibrator
    from guarduq.guard import Guard
    from guarduq.models import LoadedModel, ModelInfo, fingerprint, load_model
    from guarduq.policy import AuditLog, Decision, Policy, SecondOpinion
    from guarduq.response import GuardedResponse
    from guarduq.scoring.uncertainty import GradientScorer, Scores
    from guarduq.sve.ensemble import SVEnsemble

__all__ = [
    "ArtifactError",
    "AuditLog",
    "CacheCorruptError",
    "CalibrationError",
    "Calibrator",
    "ContextLengthError",
    "DatasetError",
    "Decision",
    "EscalationError",
    "FingerprintMismatchError",
    "GradientScorer",
    "Guard",
    "GuardUQAbstention",
    "GuardUQError",
    "GuardedResponse",
    "InputError",
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "ModelNotFoundError",
    "Policy",
    "PolicyError",
    "SVEError",
    "SVEnsemble",
    "Scores",
    "ScoringError",
    "SecondOpinion",
    "__version__",
    "fingerprint",
    "load_model",
]
__getattr__, __dir__ = attach(
    __name__,
    {
        "guarduq.calibration.calibrator": ["Calibrator"],
        "guarduq.guard": ["Guard"],
        "guarduq.models": ["LoadedModel", "ModelInfo", "fingerprint", "load_model"],
        "guarduq.policy": ["AuditLog", "Decision", "Policy", "SecondOpinion"],
        "guarduq.response": ["GuardedResponse"],
        "guarduq.scoring.uncertainty": ["GradientScorer", "Scores"],
        "guarduq.sve.ensemble": ["SVEnsemble"],
    },
)
