"""The calibrator's JSON artifact: its format, as pydantic models (every field checked when an
artifact loads), reading and checking a file, and the strict JSON it is written in.

Saved as strict JSON (no NaN or infinity). Fields added after version 1 are optional, so older
artifacts still load and score identically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from guarduq.errors import ArtifactError

FORMAT = "guarduq-calibrator"
# 2 adds feature_set and logistic.cv; 3 (written only for a within fit) adds logistic.within,
# so an older guarduq refuses such an artifact as too new instead of calling it corrupt; 4
# (written only for a per-group fit) adds group_models, which an older reader would ignore and
# so serve the pooled risk under thresholds certified on the groups' own.
FORMAT_VERSION = 2
FORMAT_VERSION_WITHIN = 3
FORMAT_VERSION_GROUPS = 4
READABLE_VERSIONS = (1, 2, 3, 4)


class _ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    name: str | None
    fingerprint: str | None
    source: str | None = None  # an alias, an absolute path or a hub id: how to load the model again


class _Scaler(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    mean: list[float]
    scale: list[float]


class _CV(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grid: list[float]
    folds: int
    scoring: str
    mean_scores: list[float]


class _Logistic(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    coef: list[float]
    intercept: float
    C: float
    cv: _CV | None = None
    within: list[str] | None = None  # the groups a within-dataset fit learned from


class _GroupModel(BaseModel):
    """One traffic group's own risk model (``Calibrator(per_group=True)``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    scaler: _Scaler
    logistic: _Logistic
    n_fit: int


class _ThresholdModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    alpha: float
    delta: float
    threshold: float | None
    coverage: float
    n: int
    n_accepted: int
    errors: int
    error_rate: float | None
    upper_bound: float | None
    message: str | None = None
    start: float | None = None  # absent in artifacts written before it existed


class _DatasetRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    sha256: str
    n: int


class _Cascade(BaseModel):
    """A cascade's second stage: the first-stage risk band it was fitted and certified in."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    first_stage_sha256: str | None
    band_lower: float | None  # the first stage's threshold (exclusive); None: from the lowest risk
    band_upper: float  # inclusive
    band_share: float  # of the fit split's answers inside the band
    alpha: float
    delta: float


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    format: Literal["guarduq-calibrator"]
    format_version: Literal[1, 2, 3, 4]
    guarduq_version: str
    created: str
    model: _ModelRef
    features: list[str]
    feature_set: str | None = None
    parameter_set: str | None = None  # absent before it was recorded: every such fit scored all
    scaler: _Scaler
    logistic: _Logistic
    n_fit: int
    n_fit_invalid: int
    thresholds: list[_ThresholdModel]
    group_thresholds: dict[str, list[_ThresholdModel]] | None = None  # per traffic group (groups.py)
    group_models: dict[str, _GroupModel] | None = None  # a per-group fit's models (group_models.py)
    group_fallback: dict[str, str] | None = None  # the groups its pooled model serves, and why
    metrics: dict[str, Any]
    datasets: list[_DatasetRef]
    split: dict[str, float] | None = None
    evaluation_data: dict[str, list[Any]] | None = None
    reference: dict[str, list[float]] | None = None  # fit-split quantiles for drift checks
    drift_reference: dict[str, list[Any]] | None = None  # every calibration item, per dataset (drift_groups)
    cascade: _Cascade | None = None  # set on a cascade's second stage only


def read_artifact(path: Path) -> tuple[Artifact, bytes]:
    """The checked artifact at ``path`` and its bytes (whose sha256 names it); an
    ``ArtifactError`` that says what is wrong with the file otherwise."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"calibrator file not found: {path}") from None
    except OSError as exc:
        raise ArtifactError(f"cannot read calibrator {path}: {exc}") from exc
    except ValueError as exc:  # a NUL or a lone surrogate in the path
        raise ArtifactError(f"cannot read calibrator {str(path)!r}: {exc}") from exc
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON (corrupt calibrator?): {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a guarduq calibrator (format != {FORMAT!r})")
    if doc.get("format_version") not in READABLE_VERSIONS:
        raise ArtifactError(
            f"{path} has calibrator format version {doc.get('format_version')!r}; this guarduq "
            f"reads versions {list(READABLE_VERSIONS)} (refit it or upgrade guarduq)"
        )
    try:
        art = Artifact.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ArtifactError(f"{path}: corrupt calibrator at '{where}': {first['msg']}") from exc
    k = len(art.features)
    numbers = [*art.scaler.mean, *art.scaler.scale, *art.logistic.coef, art.logistic.intercept]
    if not (len(art.scaler.mean) == len(art.scaler.scale) == len(art.logistic.coef) == k):
        raise ArtifactError(f"{path}: parameter lengths do not match the {k} features")
    if not all(math.isfinite(x) for x in numbers) or min(art.scaler.scale, default=1.0) <= 0:
        raise ArtifactError(f"{path}: non-finite or invalid calibrator parameters")
    return art, raw


def strict_json(obj: Any) -> Any:
    """Replace NaN/inf by None so artifacts stay strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict_json(v) for v in obj]
    if isinstance(obj, np.generic):
        return strict_json(obj.item())
    return obj


def fitted_for(path: Path, model: str | None) -> str:
    """What to pass instead for ``model``: a calibrator fitted for it beside ``path``
    (``policies/calibrators/<model>.json``) and the shipped policy that uses it
    (``policies/<model>.yaml``), or, for an alias none ships for yet, the command that fits one."""
    from guarduq.aliases import ALIASES  # torch-free

    if not model or "/" in model:
        return ""
    sibling = path.with_name(f"{model}.json")
    if sibling == path:
        return ""
    if sibling.is_file():
        policy = path.parent.parent / f"{model}.yaml"
        return f"pass {sibling}, fitted for it" + (f" (its policy: {policy})" if policy.is_file() else "")
    alias = ALIASES.get(model)
    if alias is not None and alias.calibrate:
        return (f"none ships for it yet: `{alias.calibrate}` fits one into policies/calibrators/{model}.json "
                f"and writes its policy, policies/{model}.yaml")
    return ""


def fit_one_hint(model: str) -> str:
    """How a user gets a calibrator (and a policy on it) for a model none ships for."""
    return (f"fit a calibrator for {model} (guarduq calibrate --model ... --out mine.json), then write "
            "a policy on it (guarduq policy init --calibrator mine.json --out mine.yaml)")
