"""One exception hierarchy: every error guarduq raises on purpose is a ``GuardUQError``.

Callers catch one type; the CLI turns any of them into a one-line message and a non-zero exit.
Subclasses also inherit the matching builtin (``ValueError``, ``FileNotFoundError``) so code
written against the builtins keeps working.
"""

from __future__ import annotations


class GuardUQError(Exception):
    """Base class of every deliberate guarduq error."""


class InputError(GuardUQError, ValueError):
    """A prompt, response or argument that cannot be scored as given."""


class ContextLengthError(InputError):
    """Prompt plus response do not fit in the model's context window."""


class ModelNotFoundError(GuardUQError, FileNotFoundError):
    """A model spec that names nothing loadable (unknown alias, missing path, uncached hub id)."""


class ModelLoadError(GuardUQError):
    """A model file exists but cannot be loaded (corrupt GGUF, broken folder)."""


class CacheCorruptError(ModelLoadError):
    """A guarduq cache entry is unreadable; the message names the path to delete."""


class ScoringError(GuardUQError):
    """Scoring failed for a reason other than bad input."""


class DatasetError(GuardUQError, ValueError):
    """A dataset file is missing, empty, malformed or lacks required columns."""


class CalibrationError(GuardUQError):
    """A calibrator cannot be fit, loaded or applied."""


class FingerprintMismatchError(CalibrationError):
    """An artifact was made for another model (its fingerprint differs)."""


class ArtifactError(GuardUQError):
    """A saved artifact (calibrator JSON, SVE safetensors) is corrupt or of an unknown format."""


class PolicyError(GuardUQError, ValueError):
    """A policy file is invalid or cannot be applied."""


class ReloadError(GuardUQError):
    """A new policy/calibrator pair was refused (or could not be swapped in); the pair in force
    stays. The message says what failed."""


class UncertifiedPairError(ReloadError, PolicyError):
    """A policy/calibrator pair under which a threshold rule of the policy can never match (the
    check ``guarduq policy check --strict`` makes): refused by ``Guard(...)`` (unless
    ``allow_uncertified=True``), ``Guard.reload`` (unless ``force=True``), ``guarduq serve`` (unless
    ``--allow-uncertified``) and its reloads (unless ``POST /admin/reload?force=true``)."""

    def __init__(self, message: str, problem: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem or message  # why, without how to force it (each caller says its own)


class EscalationError(GuardUQError):
    """An escalation sink failed to accept a case."""


class SVEError(GuardUQError, ValueError):
    """A Singular Value Ensemble cannot be built, trained or loaded as asked."""


class GuardUQAbstention(GuardUQError):
    """Raised instead of returning an abstention message when a caller asks for exceptions."""

    def __init__(self, message: str, decision: object | None = None) -> None:
        super().__init__(message)
        self.decision = decision


class StorageError(GuardUQError, OSError):
    """A file guarduq must write (cache, audit log, artifact) cannot be written: a read-only
    folder, a full disk, a path that is a directory."""


class StoreError(GuardUQError):
    """The reply and review store cannot be opened, migrated or written: an unreachable database,
    a schema written by a newer guarduq, a failed transaction."""


class StoreInputError(StoreError, InputError):
    """An argument the store refuses as given: a URL of another scheme, an unknown label, an
    empty reviewer, an over-long note, a bad filter."""


class UnknownItemError(StoreInputError, LookupError):
    """No review item has that request id (a label for a reply that was not sampled)."""
