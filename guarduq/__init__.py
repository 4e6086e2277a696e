"""guarduq: does the model know what it is saying? Per-response epistemic and aleatoric scores."""

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
from guarduq.uncertainty import Scores

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "CacheCorruptError",
    "CalibrationError",
    "ContextLengthError",
    "DatasetError",
    "EscalationError",
    "FingerprintMismatchError",
    "GuardUQAbstention",
    "GuardUQError",
    "InputError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PolicyError",
    "SVEError",
    "ScoringError",
    "Scores",
    "__version__",
]
