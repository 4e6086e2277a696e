"""A small fitted calibrator on synthetic scores, for tests that need certified and uncertified
alphas without a model: wrongness grows with log epistemic, so low risk is mostly right."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from guarduq.calibration import Calibrator


def synthetic_calibrator(path: Path, *, n_fit: int, n_threshold: int, alphas: Sequence[float], delta: float,
                         seed: int = 0, fingerprint: str = "ab" * 16) -> Calibrator:
    """Fit on ``n_fit`` items, certify ``alphas`` on the next ``n_threshold``, save to ``path``."""
    n = n_fit + n_threshold
    rng = np.random.default_rng(seed)
    log_e = rng.normal(0, 1, n)
    wrong = rng.random(n) < 1 / (1 + np.exp(-2 * log_e))
    scores = [{"epistemic": math.exp(v), "aleatoric": float(a), "mean_logprob": -float(a), "valid": True}
              for v, a in zip(log_e, rng.uniform(0, 0.25, n), strict=True)]
    cal = Calibrator("paper", C=1.0, model_name="tiny", model_fingerprint=fingerprint)
    cal.fit(scores[:n_fit], (~wrong[:n_fit]).astype(int))
    cal.fit_thresholds(scores[n_fit:], (~wrong[n_fit:]).astype(int), alphas=tuple(alphas), delta=delta)
    cal.save(path, include_evaluation_data=False)
    return cal
