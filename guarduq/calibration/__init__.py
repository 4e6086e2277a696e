"""Per-model calibration: raw scores -> risk = P(wrong | scores) -> guaranteed thresholds.

``features`` turns scores into the calibrator's inputs, ``thresholds`` certifies risk thresholds
(Clopper-Pearson, Learn-then-Test), ``metrics`` measures a labelled set, ``calibrator`` holds the
:class:`Calibrator` and its JSON artifact. ``datasets`` loads labelled data, ``evaluation`` scores
it through a guard with a resumable cache, ``report`` draws the plots and HTML (import it from
:mod:`guarduq.calibration.report`; it needs matplotlib, so the package does not load it).
"""

from guarduq.calibration.calibrator import (
    CV_GRID,
    FORMAT,
    FORMAT_VERSION,
    MIN_FIT_ITEMS,
    Calibrator,
)
from guarduq.calibration.features import (
    COSTLY,
    DEFAULT_FEATURE_SET,
    DEFAULT_FEATURES,
    EPISTEMIC_FLOOR,
    FEATURE_DOCS,
    FEATURE_SETS,
    FEATURES,
    ORIENTATION,
    FeatureUnavailable,
    ScoreLike,
    as_score_dict,
    feature_matrix,
    missing_features,
    resolve_features,
)
from guarduq.calibration.metrics import (
    ECE_BINS,
    EVAL_FIELDS,
    SIGNALS,
    Evaluation,
    aurc,
    auroc,
    brier,
    compute_metrics,
    ece,
    ece_floor,
    prr,
    reliability_bins,
    risk_coverage,
    roc_points,
    signal_values,
)
from guarduq.calibration.thresholds import (
    Threshold,
    check_guarantees,
    clopper_pearson_upper,
    default_grid,
    select_threshold,
    start_size,
    start_threshold,
)

__all__ = [
    "COSTLY",
    "CV_GRID",
    "DEFAULT_FEATURES",
    "DEFAULT_FEATURE_SET",
    "FEATURE_DOCS",
    "FEATURE_SETS",
    "ORIENTATION",
    "FeatureUnavailable",
    "missing_features",
    "resolve_features",
    "ECE_BINS",
    "EPISTEMIC_FLOOR",
    "EVAL_FIELDS",
    "FEATURES",
    "FORMAT",
    "FORMAT_VERSION",
    "MIN_FIT_ITEMS",
    "SIGNALS",
    "Calibrator",
    "Evaluation",
    "ScoreLike",
    "Threshold",
    "as_score_dict",
    "aurc",
    "auroc",
    "brier",
    "check_guarantees",
    "clopper_pearson_upper",
    "compute_metrics",
    "default_grid",
    "ece",
    "ece_floor",
    "feature_matrix",
    "prr",
    "reliability_bins",
    "risk_coverage",
    "roc_points",
    "select_threshold",
    "signal_values",
    "start_size",
    "start_threshold",
]
