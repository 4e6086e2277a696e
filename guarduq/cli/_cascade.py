"""``guarduq calibrate --cascade-on FIRST.json``: fit a cascade's second stage over a saved
first-stage calibrator (docs/cascade/README.md); its own module to keep ``calibrate`` small."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from guarduq.calibration import DEFAULT_FEATURE_SET, Calibrator
from guarduq.calibration.analysis import FEATURE_RULES
from guarduq.calibration.cascade import (
    band_of,
    cascade_accepts,
    fit_second_stage,
    with_first_risk,
)
from guarduq.calibration.reviews import REVIEWS
from guarduq.cli._certify import check_certified
from guarduq.cli._scoring import (
    _check_outputs,
    _json_default,
    _score_all,
    _splitter,
    _sve_plan,
    _xy,
)
from guarduq.errors import InputError


def _cmd_cascade(args: argparse.Namespace, C: float | str, alphas: Sequence[float]) -> int:
    """``calibrate --cascade-on FIRST``: score (with the SVE features), fit the second stage on
    the fit split's band answers, certify it on the threshold split's, report on the test split."""
    import numpy as np

    if len(alphas) != 1 or not 0 < alphas[0] < 1:
        raise InputError(f"--cascade-on fits the band above one threshold: give one --alpha in (0, 1), got {list(alphas)}")
    if not 0 < args.band_share <= 1:
        raise InputError(f"--band-share must be in (0, 1], got {args.band_share}")
    if args.within_datasets or args.per_dataset or args.features in FEATURE_RULES or REVIEWS in args.dataset:
        raise InputError("--cascade-on fits a pooled second stage: drop --within-datasets, --per-dataset, "
                         "feature rules and reviews")
    alpha = alphas[0]
    first = Calibrator.load(args.cascade_on)
    if first.per_group:  # its risk depends on the traffic group, which the band and fit here do not see
        raise InputError(f"--cascade-on {args.cascade_on}: a per-group first stage is not supported; "
                         "fit the first stage without --per-dataset")
    features = args.features if args.features != DEFAULT_FEATURE_SET else "cascade"
    probe = Calibrator(features, C=C)
    if "first_stage_logit" not in probe.features:
        raise InputError(f"--cascade-on needs a feature set with first_stage_logit (cascade, cascade+agree), got {features!r}")
    if first.threshold_for(alpha) is None and not any(np.isclose(t.alpha, alpha) for t in first.thresholds_):
        raise InputError(f"{args.cascade_on} has no threshold for alpha={alpha}: refit it with --alpha {alpha}")
    if not 0 < args.delta < 1:
        raise InputError(f"--delta must be in (0, 1), got {args.delta}")
    sve = _sve_plan(args, probe.features)
    _check_outputs(args, args.out)
    guard, datasets, records = _score_all(args, args.model, check=lambda g: first.check_model(g.info.fingerprint),
                                          p_true="p_true" in first.features, sve=sve)
    fractions = {"test_fraction": args.test_fraction, "threshold_fraction": args.threshold_fraction}
    split = _splitter(datasets, fractions)
    parts: dict[str, list[Any]] = {"fit": [], "threshold": [], "test": []}
    for r in records:
        if r.usable:
            parts[split(r)].append(r)
    second = fit_second_stage(first, *_xy(parts["fit"])[:2], *_xy(parts["threshold"])[:2], alpha=alpha,
                              delta=args.delta, share=args.band_share, features=features, C=C)
    check_certified(args, args.out, second.thresholds_,
                    [f"second stage, alpha={t.alpha:g}: {t.message}" for t in second.thresholds_ if not t.met])
    second.split_ = fractions
    second.datasets_ = [ds.describe() for ds in datasets]
    band = band_of(second)
    test_scores, test_labels, _ = _xy(parts["test"])
    r1 = first.predict_risk(test_scores)
    r2 = second.predict_risk(with_first_risk(test_scores, r1))
    y = np.asarray(test_labels)
    t1, t2 = first.threshold_for(alpha), second.threshold_for(alpha)
    stages = {"first stage": cascade_accepts(r1, r2, t1, band, None), "cascade": cascade_accepts(r1, r2, t1, band, t2)}
    test = {name: {"coverage": float(acc.mean()), "accepted": int(acc.sum()),
                   "error_rate": float((y[acc] == 0).mean()) if acc.any() else None}
            for name, acc in stages.items()}
    test["paid_second_opinion"] = float(band.contains(r1).mean())
    sha = second.save(args.out)
    payload = {
        "calibrator": str(args.out), "sha256": sha, "first_stage": str(args.cascade_on),
        "first_stage_sha256": first.sha256, "alpha": alpha, "delta_second_stage": args.delta,
        "first_threshold": t1, "band": {"lower": band.lower, "upper": band.upper, "share": band.share},
        "second_threshold": t2, "thresholds": [t.__dict__ for t in second.thresholds_],
        "coefficients": second.coefficients(), "split_sizes": {k: len(v) for k, v in parts.items()},
        "test": test, "n_test": len(test_labels),
    }
    if args.json:
        json.dump(payload, sys.stdout, indent=1, default=_json_default)
        sys.stdout.write("\n")
        return 0
    print(f"second stage written to {args.out} (sha256 {sha[:12]}): band {band.lower} < first-stage risk "
          f"<= {band.upper:.4f} ({band.share:.0%} of the fit split), second threshold at alpha={alpha:g}: {t2}")
    for name in ("first stage", "cascade"):
        t = test[name]
        err = "n/a" if t["error_rate"] is None else f"{t['error_rate']:.3f}"
        print(f"  test ({len(test_labels)}): {name:12s} coverage {t['coverage']:.3f}, error rate {err}")
    print(f"  test: {test['paid_second_opinion']:.0%} of answers paid for the second opinion")
    return 0
