"""The calibrator's JSON artifact, as pydantic models: every field checked when an artifact loads.

Saved as strict JSON (no NaN or infinity). Fields added after version 1 are optional, so older
artifacts still load and score identically.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # saved as strict JSON
    name: str | None
    fingerprint: str | None


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
    format_version: Literal[1, 2, 3]
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
    metrics: dict[str, Any]
    datasets: list[_DatasetRef]
    split: dict[str, float] | None = None
    evaluation_data: dict[str, list[Any]] | None = None
    reference: dict[str, list[float]] | None = None  # fit-split quantiles for drift checks
    cascade: _Cascade | None = None  # set on a cascade's second stage only
