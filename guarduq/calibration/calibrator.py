"""Per-model calibration: raw uncertainty scores -> risk = P(wrong | scores) -> guaranteed thresholds.

Raw gradient norms live on a model-specific scale, so each model gets its own ``Calibrator``:

1. ``fit``: a scikit-learn pipeline (``StandardScaler`` + L2 ``LogisticRegression``) on a named
   feature set (``features.FEATURE_SETS``) or a list of features, predicting ``risk``. The L2
   strength ``C`` is chosen by stratified k-fold cross-validation on the fit data (scored by log
   loss: the risk is thresholded as a probability, so calibration counts, not only ranking; and
   log loss is smooth where a fold's AUROC on a few dozen items jumps), unless a number is given.
2. ``fit_thresholds``: for each target ``alpha`` (the largest error rate tolerated among accepted
   answers) pick the loosest risk threshold whose accepted set has error <= alpha with probability
   >= 1 - delta. Each candidate threshold is a hypothesis test with an exact binomial
   (Clopper-Pearson) bound, tested in a fixed sequence from strict to loose (Learn-then-Test);
   the sequence stops at the first failure, so no multiplicity correction is needed. A second
   sequence starts where the fit split gives the strongest evidence
   (``thresholds.start_threshold``), each at delta / 2, so a few confidently wrong answers among
   the lowest risks cannot stop everything at once.
   Use labels the risk model was not fitted on (see ``splits.split_of``).
3. ``evaluate``: AUROC per raw signal and for the risk, ECE / Brier before and after calibration,
   risk-coverage curve (AURC), prediction rejection ratio (PRR), and whether each guarantee held.
4. ``save`` / ``load``: one JSON artifact (never pickle) bound to the model fingerprint.

Invalid scores (``valid=False`` or a non-finite feature) are *excluded with a count* from fitting,
threshold selection and metrics, and get ``risk = 1.0`` from ``predict_risk`` (fail closed).
Labels are ``1 = correct``; risk and every uncertainty signal follow "higher = more uncertain".
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from guarduq._logging import get_logger
from guarduq._storage import write_atomic
from guarduq._version import __version__
from guarduq.calibration._artifact import (  # noqa: F401 - the format's names, re-exported
    FORMAT,
    FORMAT_VERSION,
    FORMAT_VERSION_GROUPS,
    FORMAT_VERSION_WITHIN,
    READABLE_VERSIONS,
    Artifact,
    fit_one_hint,
    fitted_for,
    read_artifact,
    strict_json,
)
from guarduq.calibration.drift import drift_features, reference_quantiles
from guarduq.calibration.features import (
    COSTLY,
    DEFAULT_FEATURE_SET,
    ScoreLike,
    _labels,
    as_float,
    as_score_dict,
    feature_matrix,
    missing_features,
    resolve_features,
    score_parameter_set,
)
from guarduq.calibration.group_models import (
    GroupModel,
    apply_group_models,
    certify_group_models,
    fit_group_models,
    group_array,
    models_from_json,
    models_to_json,
    require_groups,
)
from guarduq.calibration.logistic import (
    choose_C,
    fixed_pipeline,
    normalised_weights,
    pipeline,
    standardisation,
    within_fit,
)
from guarduq.calibration.metrics import EVAL_FIELDS, Evaluation
from guarduq.calibration.thresholds import (
    Threshold,
    select_threshold,
    start_threshold,
)
from guarduq.errors import ArtifactError, CalibrationError, FingerprintMismatchError, InputError
from guarduq.scoring.parameters import ALL_PARAMETERS, parse_parameter_set

log = get_logger("calibration")

MIN_FIT_ITEMS = 10
# Candidate L2 strengths for cross-validation, fixed before seeing data (1e-3 = a strong prior
# toward "risk = base rate", 100 = almost unregularised).
CV_GRID: tuple[float, ...] = tuple(float(c) for c in np.logspace(-3, 2, 11))
CV_FOLDS = 5


# --------------------------------------------------------------------------- the calibrator


class Calibrator:
    """Maps a model's raw scores to ``risk = P(wrong | scores)`` and holds guaranteed thresholds.

    Parameters (set in ``__init__``, scikit-learn style): ``features`` (a set name from
    ``FEATURE_SETS``, a comma list, or a sequence of names in ``FEATURES``), ``C`` (inverse L2
    strength, or ``"cv"`` to choose it from ``cv_grid`` by stratified ``cv_folds``-fold
    cross-validation), ``within_groups`` (learn each feature's direction inside the groups given
    to ``fit``, usually datasets, instead of across them: :func:`logistic.within_fit`),
    ``per_group`` (besides the pooled model, one model per group given to ``fit``, served to
    requests of that traffic group: :mod:`~guarduq.calibration.group_models`), and the
    model's ``model_name`` / ``model_fingerprint`` the artifact is bound to, and ``model_source``
    (an alias, an absolute path or a hub id) that loads that model again. Fitted state ends in
    ``_`` (``C_`` is the strength used, ``cv_`` the CV record, ``groups_`` the groups fitted
    within, ``group_models_`` / ``group_fallback_`` the per-group models and the groups the pooled
    model serves with the reason, ``parameter_set_`` the parameters the fitted scores' gradient
    covered: scores over any other set are refused, as their epistemic is another quantity).
    """

    def __init__(
        self,
        features: str | Sequence[str] = DEFAULT_FEATURE_SET,
        *,
        C: float | Literal["cv"] = "cv",
        cv_grid: Sequence[float] = CV_GRID,
        cv_folds: int = CV_FOLDS,
        within_groups: bool = False,
        per_group: bool = False,
        model_name: str | None = None,
        model_fingerprint: str | None = None,
        model_source: str | None = None,
    ) -> None:
        self.feature_set, self.features = resolve_features(features)
        if C != "cv" and not (isinstance(C, int | float) and C > 0):
            raise CalibrationError(f"C must be > 0 or 'cv', got {C!r}")
        if not cv_grid or not all(c > 0 for c in cv_grid):
            raise CalibrationError(f"cv_grid must hold positive strengths, got {list(cv_grid)}")
        if cv_folds < 2:
            raise CalibrationError(f"cv_folds must be >= 2, got {cv_folds}")
        self.C: float | str = C if C == "cv" else float(C)
        self.cv_grid = tuple(sorted(float(c) for c in cv_grid))
        self.cv_folds = int(cv_folds)
        self.within_groups = bool(within_groups)
        self.per_group = bool(per_group)
        if self.within_groups and self.per_group:
            raise CalibrationError("within_groups and per_group are exclusive: one learns a single model "
                                   "across groups, the other a model per group")
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.model_source = model_source  # how to load the model again: an alias, a path, a hub id
        self.thresholds_: list[Threshold] = []
        self.group_thresholds_: dict[str, list[Threshold]] = {}  # per traffic group (groups.py)
        self.metrics_: dict[str, Any] = {}
        self.datasets_: list[dict[str, Any]] = []
        self.split_: dict[str, float] | None = None  # how the data was split (test_fraction, ...)
        self.evaluation_: Evaluation | None = None
        self.drift_reference_: dict[str, list[Any]] | None = None  # every calibration item (drift_groups)
        self.cv_: dict[str, Any] | None = None
        self.groups_: list[str] | None = None
        self.group_models_: dict[str, GroupModel] = {}
        self.group_fallback_: dict[str, str] = {}
        self.parameter_set_: str = ALL_PARAMETERS
        self._sha256: str | None = None
        self.created_: str | None = None
        self.cascade_: dict[str, Any] | None = None  # a cascade's second stage: its band (cascade.py)

    @property
    def costly_features(self) -> tuple[str, ...]:
        """Features that need work beyond guarduq's own pass (P(True), SVE) at serving time too."""
        return tuple(f for f in self.features if f in COSTLY)

    # -- fitting

    def fit(
        self,
        scores: Sequence[ScoreLike],
        labels: Iterable[Any],
        groups: Sequence[str] | None = None,
        sample_weight: Sequence[float] | None = None,
    ) -> Calibrator:
        """Fit the scaler + logistic regression on valid rows (invalid ones are counted, excluded).

        ``groups`` (one name per item, e.g. its dataset; None: no group) is needed by
        ``within_groups=True`` and ``per_group=True``.
        ``sample_weight`` (one positive number per item, e.g. the inverse inclusion probability
        of a reviewed reply) weights each item's log-loss; it is rescaled to mean 1 over the valid
        rows, so ``C`` keeps its meaning per item. Not with ``within_groups``.
        """
        scores, labels = list(scores), list(labels)  # read twice by a per-group fit
        if self.per_group:
            require_groups(groups, len(scores))  # before anything fitted is replaced
        sample_weight = None if sample_weight is None else list(sample_weight)
        self.thresholds_, self.group_thresholds_ = [], {}  # certified on a model this fit replaces
        sets = {score_parameter_set(s) for s in scores}
        if len(sets) > 1:
            raise CalibrationError(
                f"the scores were taken over different parameter sets ({sorted(sets)}): "
                "fit one calibrator per set"
            )
        self.parameter_set_ = sets.pop() if sets else ALL_PARAMETERS
        codes, names = self._group_codes(groups, len(scores))
        missing = missing_features(scores, self.features)
        if missing and scores:
            raise CalibrationError("; ".join(missing.values()))
        X, ok = feature_matrix(scores, self.features)
        y_all = _labels(labels, len(scores))
        X, y = X[ok], y_all[ok]
        weights = normalised_weights(sample_weight, len(scores), ok, grouped=codes is not None)
        present: list[str] = []  # the groups left after invalid rows are dropped
        if codes is not None:
            codes = codes[ok]
            present = [names[i] for i in np.unique(codes)]
            if len(present) < 2:
                raise CalibrationError(
                    f"within_groups=True needs valid items from at least 2 groups, got {present}: "
                    "with one group a within fit is the pooled fit (drop --within-datasets)"
                )
        self.n_fit_invalid_ = int((~ok).sum())
        if self.n_fit_invalid_:
            log.warning("calibration_invalid_excluded", n=self.n_fit_invalid_, n_total=len(scores))
        if y.size < MIN_FIT_ITEMS:
            raise CalibrationError(
                f"need at least {MIN_FIT_ITEMS} valid labelled items to fit, got {y.size}"
            )
        if y.min() == y.max():
            which = "correct" if y[0] == 1 else "wrong"
            raise CalibrationError(
                f"all {y.size} fitting labels are '{which}': a calibrator needs both correct and "
                "wrong answers (use more or different data)"
            )
        target = 1 - y  # wrong
        C, self.cv_ = self._choose_C(X, target, codes, weights)
        if codes is None:
            pipe = pipeline(C).fit(X, target, logistic__sample_weight=weights)
            self.groups_ = None
        else:
            mean, scale = standardisation(X)
            coef, intercept = within_fit((X - mean) / scale, target.astype(float), codes, C)
            pipe = fixed_pipeline(mean, scale, coef, intercept, C, y.size)
            self.groups_ = present
            log.info("calibration_within_groups", groups=self.groups_)
        self.pipeline_ = pipe
        self.C_ = C
        self.group_models_, self.group_fallback_ = {}, {}
        if self.per_group:  # a model per group that supports one
            self.group_models_, self.group_fallback_ = fit_group_models(
                self._fit_one, scores, y_all, ok, require_groups(groups, len(scores)), weights)
        # Kept in memory only, for fit_thresholds to learn where its tests should start.
        self.fit_risk_, self.fit_wrong_ = pipe.predict_proba(X)[:, 1], target
        self.fit_groups_ = None  # (groups, served risk) of the fit rows, where group certificates start
        if self.per_group:
            self.fit_groups_ = (require_groups(groups, len(scores))[ok], self.predict_risk(scores, groups)[ok])
        self.n_fit_ = int(y.size)
        self.reference_ = reference_quantiles(
            [sc for sc, keep in zip(scores, ok, strict=True) if keep], drift_features(self.features)
        )
        self.created_ = datetime.now(UTC).isoformat(timespec="seconds")
        self._sha256 = None
        return self

    def _fit_one(self, scores: list[Any], labels: np.ndarray, weights: np.ndarray | None) -> Calibrator:
        """A pooled calibrator with this one's settings, fitted on one group's items."""
        return Calibrator(self.features, C=self.C, cv_grid=self.cv_grid, cv_folds=self.cv_folds).fit(
            scores, labels, sample_weight=weights)

    def _group_codes(
        self, groups: Sequence[str] | None, n: int
    ) -> tuple[np.ndarray | None, list[str]]:
        """Integer codes of ``groups`` for a within fit (None for a pooled one) and their names."""
        if not self.within_groups:
            return None, []
        if groups is None:
            raise CalibrationError(
                "within_groups=True learns directions inside each group: pass groups= to fit "
                "(the dataset of each item)"
            )
        names, codes = np.unique(np.asarray(list(groups), dtype=str), return_inverse=True)
        if codes.size != n:
            raise CalibrationError(f"got {codes.size} groups for {n} scores")
        return codes, [str(x) for x in names]

    def _choose_C(
        self, X: np.ndarray, target: np.ndarray, codes: np.ndarray | None = None,
        weights: np.ndarray | None = None,
    ) -> tuple[float, dict[str, Any] | None]:
        """The given C, or the CV choice (:func:`logistic.choose_C`)."""
        if self.C != "cv":
            return float(self.C), None
        return choose_C(X, target, self.cv_grid, self.cv_folds, codes, weights)

    def coefficients(self) -> dict[str, float]:
        """Standardised logistic coefficient per feature, on P(wrong): > 0 = larger means riskier."""
        self._check_fitted()
        coef = self.pipeline_.named_steps["logistic"].coef_[0]
        return {f: float(c) for f, c in zip(self.features, coef, strict=True)}

    def _check_fitted(self) -> None:
        if not hasattr(self, "pipeline_"):
            raise CalibrationError("calibrator is not fitted; call fit() or Calibrator.load()")

    def predict_risk(self, scores: Sequence[ScoreLike], groups: Sequence[str | None] | None = None) -> np.ndarray:
        """P(wrong | scores) per response; 1.0 (fail closed) for invalid or non-finite scores.

        ``groups``: each response's traffic group (None: unknown); a group with a model of its
        own (``per_group``) gets that model's risk, every other response the pooled one."""
        self._check_fitted()
        scores = list(scores)
        self.check_parameter_set(scores)
        X, ok = feature_matrix(scores, self.features)
        risk = np.ones(len(scores), dtype=float)
        if ok.any():
            risk[ok] = self.pipeline_.predict_proba(X[ok])[:, 1]
        return apply_group_models(risk, X, ok, group_array(groups, len(scores)), self.group_models_)

    def check_parameter_set(self, scores: Iterable[ScoreLike] | str) -> None:
        """``CalibrationError`` unless ``scores`` (or a parameter-set name) match the fitted set."""
        names = {scores} if isinstance(scores, str) else {score_parameter_set(s) for s in scores}
        for name in names - {self.parameter_set_}:
            raise CalibrationError(
                f"calibrator was fitted on gradients over parameters '{self.parameter_set_}', not "
                f"'{name}': epistemic is another quantity there (score with the calibrator's set, "
                "or fit one for this set)"
            )

    def risk(self, scores: ScoreLike, group: str | None = None) -> float:
        """``predict_risk`` for one response of traffic group ``group``."""
        return float(self.predict_risk([scores], None if group is None else [group])[0])

    def fit_thresholds(
        self,
        scores: Sequence[ScoreLike],
        labels: Iterable[Any],
        alphas: Sequence[float] = (0.1, 0.2, 0.3),
        delta: float = 0.1,
        groups: Sequence[str | None] | None = None,
    ) -> list[Threshold]:
        """Choose one guaranteed threshold per alpha on labelled data *not* used by ``fit``.

        The pooled thresholds are certified on the pooled risk, which every reply without a
        certified group model is served. A ``per_group`` calibrator given each item's
        ``groups`` also certifies each modelled group on its own items and its own model's risk
        (``group_thresholds_``, as :mod:`~guarduq.calibration.groups` does for traffic groups);
        a group model serves only where that certificate holds (``policy.context.risk_group``)."""
        self._check_fitted()
        scores = list(scores)
        y = _labels(labels, len(scores))
        _, ok = feature_matrix(scores, self.features)
        if self.per_group and groups is None:
            raise CalibrationError("a per-group calibrator certifies each group model on its own "
                                   "answers: pass groups= to fit_thresholds")
        risk = self.predict_risk(scores)[ok]
        wrong = 1 - y[ok]
        if wrong.size == 0:
            raise CalibrationError("no valid items to choose thresholds on")
        self.thresholds_ = [
            select_threshold(risk, wrong, a, delta, start=self._start(a, delta))
            for a in sorted(set(alphas))
        ]
        if self.per_group:
            self._certify_group_models(scores, y, ok, groups, alphas, delta)  # type: ignore[arg-type]
        for t in self.thresholds_:
            if t.threshold is None:
                log.warning("threshold_not_met", alpha=t.alpha, delta=t.delta, message=t.message)
        self._sha256 = None
        return self.thresholds_

    def _certify_group_models(self, scores: list[ScoreLike], y: np.ndarray, ok: np.ndarray,
                              groups: Sequence[str | None], alphas: Sequence[float], delta: float) -> None:
        """Each modelled group's own certificate, on its items' risk as its model serves it."""
        g = group_array(groups, len(scores))
        self.group_thresholds_ = certify_group_models(
            self.predict_risk(scores, groups)[ok], 1 - y[ok], g[ok], self.group_models_,  # type: ignore[index]
            alphas, delta, fit=getattr(self, "fit_groups_", None), fit_wrong=getattr(self, "fit_wrong_", None))

    def _start(self, alpha: float, delta: float) -> float | None:
        """Where the threshold test starts, learned on the fit split (None after ``load``)."""
        if getattr(self, "fit_risk_", None) is None:
            return None
        return start_threshold(self.fit_risk_, self.fit_wrong_, alpha, delta)

    def threshold_for(self, alpha: float) -> float | None:
        """The certified threshold for ``alpha`` (None when none met it or it was not asked for)."""
        for t in self.thresholds_:
            if math.isclose(t.alpha, alpha):
                return t.threshold
        return None

    # -- evaluation

    def evaluate(
        self,
        scores: Sequence[ScoreLike],
        labels: Iterable[Any],
        datasets: Sequence[str] | None = None,
    ) -> Evaluation:
        """Metrics of the pooled risk on labelled data and whether each pooled guarantee held."""
        self._check_fitted()
        scores = list(scores)
        y = _labels(labels, len(scores))
        _, ok = feature_matrix(scores, self.features)
        raw_fields = [k for k in EVAL_FIELDS if k != "risk"]
        raw = np.array(
            [[as_float(as_score_dict(s).get(k)) for k in raw_fields] for s in scores], dtype=float
        ).reshape(len(scores), len(raw_fields))
        ok &= np.isfinite(raw).all(axis=1)  # raw signals must be finite too, or AUROCs see NaNs
        signals = {k: raw[ok, j] for j, k in enumerate(raw_fields)}
        signals["risk"] = self.predict_risk(scores)[ok]
        ds = np.asarray(datasets, dtype=str)[ok] if datasets is not None else None
        return Evaluation.from_arrays(
            y[ok],
            signals,
            ds,
            self.thresholds_,
            n_invalid=int((~ok).sum()),
            model={"name": self.model_name, "fingerprint": self.model_fingerprint},
            calibrator_sha256=self._sha256,
        )

    def attach_evaluation(self, evaluation: Evaluation) -> None:
        """Store held-out metrics (and per-item data for reports) in the artifact."""
        self.evaluation_ = evaluation
        self.metrics_ = {**evaluation.metrics, "n_invalid": evaluation.n_invalid}
        if evaluation.per_dataset:
            self.metrics_["per_dataset"] = evaluation.per_dataset
        self.metrics_["guarantees"] = evaluation.guarantees
        self.metrics_["coefficients"] = self.coefficients()
        self._sha256 = None

    # -- model binding

    def check_model(self, fingerprint: str | None, *, model_name: str | None = None,
                    allow_mismatch: bool = False, hint: str = "") -> None:
        """Refuse to serve a model whose weights differ from the ones this was fitted on; the
        message names both models (``model_name``: the one at hand, when known)."""
        if fingerprint is None or self.model_fingerprint is None:
            return
        if fingerprint != self.model_fingerprint:
            this = f"model '{model_name}'" if model_name else "this model"
            msg = (
                f"calibrator was fitted for model '{self.model_name}' (fingerprint "
                f"{self.model_fingerprint}), not for {this} (fingerprint {fingerprint}); raw "
                f"scores do not transfer across models: {hint or fit_one_hint(this)}"
            )
            if not allow_mismatch:
                raise FingerprintMismatchError(msg)
            log.warning("calibrator_fingerprint_mismatch_overridden", detail=msg)

    # -- artifact

    @property
    def sha256(self) -> str | None:
        """sha256 of the artifact file this calibrator was last saved to or loaded from."""
        return self._sha256

    def to_dict(self, include_evaluation_data: bool = True) -> dict[str, Any]:
        self._check_fitted()
        scaler: StandardScaler = self.pipeline_.named_steps["scale"]
        logistic: LogisticRegression = self.pipeline_.named_steps["logistic"]
        out = {
            "format": FORMAT,
            "format_version": (FORMAT_VERSION_GROUPS if self.per_group else
                               FORMAT_VERSION if self.groups_ is None else FORMAT_VERSION_WITHIN),
            "guarduq_version": __version__,
            "created": self.created_ or datetime.now(UTC).isoformat(timespec="seconds"),
            "model": {"name": self.model_name, "fingerprint": self.model_fingerprint,
                      **({"source": self.model_source} if self.model_source else {})},
            "features": list(self.features),
            "feature_set": self.feature_set,
            "parameter_set": self.parameter_set_,
            "scaler": {"mean": scaler.mean_.tolist(), "scale": scaler.scale_.tolist()},
            "logistic": {
                "coef": logistic.coef_[0].tolist(),
                "intercept": float(logistic.intercept_[0]),
                "C": self.C_,
                "cv": self.cv_,
                **({"within": self.groups_} if self.groups_ is not None else {}),
            },
            "n_fit": self.n_fit_,
            "n_fit_invalid": self.n_fit_invalid_,
            "thresholds": [asdict(t) for t in self.thresholds_],
            **({"group_models": models_to_json(self.group_models_), "group_fallback": self.group_fallback_}
               if self.per_group else {}),
            **({"group_thresholds": {g: [asdict(t) for t in ts] for g, ts in self.group_thresholds_.items()}}
               if self.group_thresholds_ else {}),
            "metrics": strict_json(self.metrics_),
            "datasets": self.datasets_,
            "split": self.split_,
            "evaluation_data": self.evaluation_.data_dict()
            if include_evaluation_data and self.evaluation_ is not None
            else None,
            "reference": getattr(self, "reference_", None),
            **({"drift_reference": self.drift_reference_} if self.drift_reference_ else {}),
            **({"cascade": self.cascade_} if self.cascade_ is not None else {}),
        }
        return out

    def save(self, path: str | os.PathLike[str], include_evaluation_data: bool = True) -> str:
        """Write the JSON artifact atomically (temp file + fsync + rename); returns its sha256."""
        data = json.dumps(self.to_dict(include_evaluation_data), indent=1, allow_nan=False)
        raw = (data + "\n").encode()
        write_atomic(Path(path), raw)
        self._sha256 = hashlib.sha256(raw).hexdigest()
        return self._sha256

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        expected_fingerprint: str | None = None,
        allow_mismatch: bool = False,
        expected_model: str | None = None,
    ) -> Calibrator:
        """Read an artifact; ``FingerprintMismatchError`` if it belongs to another model, naming
        both (``expected_model``: the name of the model at hand) and, where a calibrator named for
        that model sits beside this one (``policies/calibrators/<model>.json``), that file.

        ``allow_mismatch=True`` loads it anyway and logs a warning (scores will be miscalibrated).
        """
        path = Path(path)
        art, raw = read_artifact(path)
        self = cls._from_artifact(art, path)
        self._sha256 = hashlib.sha256(raw).hexdigest()
        hint = fitted_for(path, expected_model)
        self.check_model(expected_fingerprint, model_name=expected_model, allow_mismatch=allow_mismatch, hint=hint)
        return self

    @classmethod
    def _from_artifact(cls, art: Artifact, path: Path) -> Calibrator:
        k = len(art.features)
        try:
            self = cls(
                art.features,
                C=art.logistic.C if art.logistic.cv is None else "cv",
                model_name=art.model.name,
                model_fingerprint=art.model.fingerprint,
                model_source=art.model.source,
            )
        except CalibrationError as exc:
            raise ArtifactError(f"{path}: {exc}") from exc
        self.pipeline_ = fixed_pipeline(
            art.scaler.mean, art.scaler.scale, art.logistic.coef, art.logistic.intercept,
            art.logistic.C, art.n_fit,
        )
        self.C_ = art.logistic.C
        self.parameter_set_ = art.parameter_set or ALL_PARAMETERS
        try:
            parse_parameter_set(self.parameter_set_)
        except InputError as exc:
            raise ArtifactError(f"{path}: {exc}") from exc
        self.within_groups = art.logistic.within is not None
        self.groups_ = art.logistic.within
        self.per_group = art.group_models is not None
        try:
            self.group_models_ = models_from_json(art.group_models or {}, k)
        except ValueError as exc:
            raise ArtifactError(f"{path}: {exc}") from exc
        self.group_fallback_ = dict(art.group_fallback or {})
        self.cv_ = art.logistic.cv.model_dump() if art.logistic.cv is not None else None
        if art.feature_set is not None:
            self.feature_set = art.feature_set
        self.n_fit_ = art.n_fit
        self.n_fit_invalid_ = art.n_fit_invalid
        self.thresholds_ = [Threshold(**t.model_dump()) for t in art.thresholds]
        self.group_thresholds_ = {g: [Threshold(**t.model_dump()) for t in ts]
                                  for g, ts in (art.group_thresholds or {}).items()}
        self.metrics_ = art.metrics
        self.datasets_ = [d.model_dump() for d in art.datasets]
        self.split_ = art.split
        self.created_ = art.created
        self.reference_ = art.reference
        self.drift_reference_ = art.drift_reference
        self.cascade_ = art.cascade.model_dump() if art.cascade is not None else None
        if art.evaluation_data:
            try:
                self.evaluation_ = Evaluation.from_data_dict(
                    art.evaluation_data,
                    self.thresholds_,
                    model={"name": self.model_name, "fingerprint": self.model_fingerprint},
                )
            except (KeyError, ValueError, TypeError, OverflowError) as exc:
                raise ArtifactError(f"{path}: corrupt evaluation_data: {exc}") from exc
        return self

    def __repr__(self) -> str:
        fitted = f"n_fit={self.n_fit_}" if hasattr(self, "pipeline_") else "unfitted"
        name = f"{self.feature_set!r}: " if self.feature_set else ""
        return f"Calibrator(features={name}{list(self.features)}, model={self.model_name!r}, {fitted})"

