"""Per-model calibration: raw scores -> risk = P(wrong | scores) -> guaranteed thresholds.

``features`` turns scores into the calibrator's inputs, ``thresholds`` certifies risk thresholds
(Clopper-Pearson, Learn-then-Test), ``metrics`` measures a labelled set, ``calibrator`` holds the
:class:`Calibrator` and its JSON artifact. ``datasets`` loads labelled data, ``evaluation`` scores
it through a guard with a resumable cache, ``report`` draws the plots and HTML (import it from
:mod:`guarduq.calibration.report`; it needs matplotlib, so the package does not load it).

Each public name loads its module on first use (``guarduq._lazy``): ``calibration.sizing`` or
``calibration.labels`` import without sklearn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from guarduq._lazy import attach

if TYPE_CHECKING:
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
    "Calibrator",
    "DEFAULT_FEATURES",
    "DEFAULT_FEATURE_SET",
    "ECE_BINS",
    "EPISTEMIC_FLOOR",
    "EVAL_FIELDS",
    "Evaluation",
    "FEATURES",
    "FEATURE_DOCS",
    "FEATURE_SETS",
    "FORMAT",
    "FORMAT_VERSION",
    "FeatureUnavailable",
    "MIN_FIT_ITEMS",
    "ORIENTATION",
    "SIGNALS",
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
    "missing_features",
    "prr",
    "reliability_bins",
    "resolve_features",
    "risk_coverage",
    "roc_points",
    "select_threshold",
    "signal_values",
    "start_size",
    "start_threshold",
]
__getattr__, __dir__ = attach(
    __name__,
    {
        "guarduq.calibration.calibrator": [
            "CV_GRID",
            "FORMAT",
            "FORMAT_VERSION",
            "MIN_FIT_ITEMS",
            "Calibrator",
        ],
        "guarduq.calibration.features": [
            "COSTLY",
            "DEFAULT_FEATURE_SET",
            "DEFAULT_FEATURES",
            "EPISTEMIC_FLOOR",
            "FEATURE_DOCS",
            "FEATURE_SETS",
            "FEATURES",
            "ORIENTATION",
            "FeatureUnavailable",
            "ScoreLike",
            "as_score_dict",
            "feature_matrix",
            "missing_features",
            "resolve_features",
        ],
        "guarduq.calibration.metrics": [
            "ECE_BINS",
            "EVAL_FIELDS",
            "SIGNALS",
            "Evaluation",
            "aurc",
            "auroc",
            "brier",
            "compute_metrics",
            "ece",
            "ece_floor",
            "prr",
            "reliability_bins",
            "risk_coverage",
            "roc_points",
            "signal_values",
        ],
        "guarduq.calibration.thresholds": [
            "Threshold",
            "check_guarantees",
            "clopper_pearson_upper",
            "default_grid",
            "select_threshold",
            "start_size",
            "start_threshold",
        ],
    },
)
