"""guarduq: does the model know what it is saying? Per-response epistemic and aleatoric scores."""

from guarduq._version import __version__
from guarduq.calibration import Calibrator
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
from guarduq.guard import Guard, GuardedResponse
from guarduq.models import LoadedModel, ModelInfo, fingerprint, load_model
from guarduq.policy import AuditLog, Decision, Policy, SecondOpinion
from guarduq.scoring import GradientScorer, Scores
from guarduq.sve import SVEnsemble

__all__ = [
    "AuditLog",
    "Calibrator",
    "Decision",
    "Policy",
    "SVEnsemble",
    "SecondOpinion",
    "ArtifactError",
    "CacheCorruptError",
    "CalibrationError",
    "ContextLengthError",
    "DatasetError",
    "EscalationError",
    "FingerprintMismatchError",
    "GradientScorer",
    "Guard",
    "GuardUQAbstention",
    "GuardUQError",
    "GuardedResponse",
    "InputError",
    "LoadedModel",
    "ModelLoadError",
    "ModelInfo",
    "ModelNotFoundError",
    "PolicyError",
    "SVEError",
    "ScoringError",
    "Scores",
    "__version__",
    "fingerprint",
    "load_model",
]
