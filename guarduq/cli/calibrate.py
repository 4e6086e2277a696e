"""Calibration sub-commands: ``calibrate``, ``evaluate`` and ``report``.

``calibrate`` scores labelled data with a model (cached, resumable), splits it by id hash into
fit / threshold / test, fits the risk model, picks guaranteed thresholds and saves the artifact.
``evaluate`` scores new data with a saved calibrator and says whether each guarantee held.
``report`` redraws the HTML + PNG report from an artifact.
``calibrate --cascade-on`` lives in :mod:`guarduq.cli._cascade`; the steps the commands share
(data, SVE plan, scoring, splits) in :mod:`guarduq.cli._scoring`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from guarduq.aliases import DEFAULT_MODEL
from guarduq.calibration import (
    DEFAULT_FEATURE_SET,
    FEATURE_SETS,
    FEATURES,
    Calibrator,
    Evaluation,
)
from guarduq.calibration.analysis import FEATURE_RULES, available, select_features
from guarduq.calibration.cascade import DEFAULT_SHARE
from guarduq.calibration.datasets import DATASETS, PROMPT_STYLES
from guarduq.calibration.drift_groups import reference_data
from guarduq.calibration.features import SVE, forward_equivalents
from guarduq.calibration.reviews import (
    REVIEWS,
    check_review_size,
    group_certificates,
    review_parts,
    uniform_only,
    uniform_reference,
    weights_summary,
)
from guarduq.calibration.splits import TEST_FRACTION, THRESHOLD_FRACTION
from guarduq.cli._cascade import _cmd_cascade
from guarduq.cli._certify import allow_uncertified_arg, check_certified, reasons_for
from guarduq.cli._help import with_example
from guarduq.cli._run import model_of, run_args
from guarduq.cli._scoring import (
    _check_outputs,
    _json_default,
    _score_all,
    _splitter,
    _sve_plan,
    _sve_shape,
    _xy,
)
from guarduq.cli.calibrate_reviews import review_progress
from guarduq.errors import CalibrationError, InputError

DEFAULT_ALPHAS = (0.1, 0.2, 0.3)
DEFAULT_FRACTIONS = {"test_fraction": TEST_FRACTION, "threshold_fraction": THRESHOLD_FRACTION}


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "calibrate",
        help="fit a per-model calibrator on labelled data (risk model + guaranteed thresholds)",
        description="Score labelled datasets with MODEL (resumable cache), fit risk = P(wrong | "
        "scores) on the fit split, choose thresholds with a finite-sample guarantee on the "
        "threshold split, report metrics on the held-out test split.",
        **with_example("guarduq calibrate --dataset triviaqa --data triviaqa_dev.jsonl --limit 200 "
                       "--alpha 0.2 --out cal.json --report report/"),
    )
    c.add_argument("--model", default=DEFAULT_MODEL, help="alias, folder, hub id or .gguf")
    _data_args(c)
    _sve_args(c)
    c.add_argument("--alpha", type=float, action="append", help="target max error rate among "
                   f"accepted answers (repeatable; default {' '.join(map(str, DEFAULT_ALPHAS))})")
    c.add_argument("--delta", type=float, default=0.1, help="allowed probability that a guarantee fails")
    c.add_argument("--features", default=DEFAULT_FEATURE_SET,
                   help=f"a feature set ({', '.join(FEATURE_SETS)}; default {DEFAULT_FEATURE_SET}), "
                   f"a rule that picks them from the data ({', '.join(FEATURE_RULES)}: "
                   f"{FEATURE_RULES['sign-stable']}) or comma-separated features from: "
                   f"{', '.join(FEATURES)}")
    c.add_argument("--within-datasets", action="store_true",
                   help="learn each feature's direction inside each --dataset kind (one "
                   "intercept per kind while fitting; two files of one kind are one group), not "
                   "across them: better inside one kind of traffic, blind to which kind a "
                   "question is, so weaker on a mix like the calibration data "
                   "(docs/results/risk.md)")
    c.add_argument("--per-dataset", action="store_true",
                   help="besides the pooled risk model, one per --dataset kind with enough answers, "
                   "served to replies whose traffic group (policy groups: an API key, metadata.group, "
                   "guarduq.traffic_group) is that kind's name and whose kind is certified on its own model's "
                   "risk; every other reply gets the pooled risk and thresholds (docs/results/scale/)")
    c.add_argument("--C", dest="C", default="cv",
                   help="inverse L2 strength of the logistic fit, or 'cv' (default) to choose it "
                   "by stratified cross-validation")
    c.add_argument("--cascade-on", type=Path, metavar="FIRST.json",
                   help="fit a cascade's second stage over this first-stage calibrator: on the answers "
                   "in the band above its threshold at --alpha (one alpha), from the first-stage risk and "
                   "the --sve second opinion (--features defaults to 'cascade'); "
                   "docs/cascade/README.md")
    c.add_argument("--band-share", type=float, default=DEFAULT_SHARE,
                   help="with --cascade-on: the share of answers that pay for the second opinion "
                   "(default 1/3)")
    c.add_argument("--test-fraction", type=float,
                   help=f"share held out to measure the calibrator (default {DEFAULT_FRACTIONS['test_fraction']:g}, "
                   "or the --policy's review.test_fraction)")
    c.add_argument("--threshold-fraction", type=float,
                   help="share the thresholds are certified on (default "
                   f"{DEFAULT_FRACTIONS['threshold_fraction']:g}, or the --policy's review.threshold_fraction)")
    c.add_argument("--policy", type=Path, metavar="FILE",
                   help="--dataset reviews: the policy whose review section gives the split fractions "
                   "(the review page's progress line counts with the same) and whose alpha is the "
                   "default --alpha")
    c.add_argument("--out", type=Path, required=True,
                   help="calibrator JSON to write (left alone when no --alpha is certified)")
    allow_uncertified_arg(c)
    c.add_argument("--report", type=Path, help="also write the HTML report into this folder")
    c.set_defaults(func=_cmd_calibrate)

    e = sub.add_parser(
        "evaluate", help="score labelled data with a saved calibrator; check its guarantees",
        **with_example("guarduq evaluate --calibrator cal.json --dataset arc --data ARC-Easy-Dev.jsonl"),
    )
    e.add_argument("--calibrator", type=Path, required=True)
    e.add_argument("--model", help="model spec (default: the model named in the calibrator)")
    _data_args(e)
    _sve_args(e)
    e.add_argument("--split", choices=("all", "test"), default="all",
                   help="'test': only items in the held-out split (when the data was used to calibrate)")
    e.add_argument("--allow-mismatch", action="store_true",
                   help="use the calibrator on a model with another fingerprint (logged warning)")
    e.add_argument("--report", type=Path, help="also write the HTML report into this folder")
    e.set_defaults(func=_cmd_evaluate)

    r = sub.add_parser("report", help="write report.html + PNGs from a calibrator artifact",
                       **with_example("guarduq report cal.json --out report/"))
    r.add_argument("calibrator", type=Path)
    r.add_argument("--out", type=Path, required=True, help="output folder")
    r.set_defaults(func=_cmd_report)


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", action="append", choices=sorted(DATASETS), required=True,
                   help="dataset kind; pair each with a --data (repeatable, to mix datasets); "
                   "'reviews' reads labelled replies from --store instead")
    p.add_argument("--data", action="append", type=Path, default=[], help="path of the dataset file")
    p.add_argument("--store", metavar="URL", help="--dataset reviews: the store's database URL "
                   "(sqlite:///guarduq.db, postgresql://...)")
    p.add_argument("--since", metavar="DATE", help="--dataset reviews: only replies from this "
                   "date or time on (ISO 8601)")
    p.add_argument("--limit", action="append", metavar="N|DATASET=N",
                   help="at most N items per dataset (a stable subset); DATASET=N gives one dataset "
                   "its own limit (repeatable: --limit 450 --limit boolq=300)")
    p.add_argument("--prompt-style", choices=("auto", *PROMPT_STYLES), default="auto",
                   help="'fewshot' for base models; 'auto' picks it when the tokenizer has no chat template")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length for QA items")
    p.add_argument("--cache", type=Path, help="scoring cache JSONL (default: under --runs-dir)")
    p.add_argument("--work", "--runs-dir", dest="runs_dir", type=Path, metavar="DIR",
                   default=Path(os.environ.get("GUARDUQ_RUNS", "runs")),
                   help="working folder: the scoring cache, and for --dataset reviews the store's "
                   "export under DIR/reviews/ (prompt and reply text: files 0600, folder 0700); "
                   "default ./runs, or $GUARDUQ_RUNS")
    p.add_argument("--skip-malformed", action="store_true", help="skip bad rows instead of failing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true")
    run_args(p)


def _sve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sve", type=Path, metavar="FILE",
                   help="SVE members saved by `guarduq sve train` for this model (safetensors): "
                   f"needed by a feature set with SVE features ({', '.join(SVE)}), computed once "
                   "per answer and cached")
    p.add_argument("--sve-answer-tokens", type=int, default=32, metavar="N",
                   help="token budget of the SVE members' own greedy answer, for sve_agree "
                   "(default 32; 0: no greedy answer, so no sve_agree)")


# --------------------------------------------------------------------------- output


def _emit(args: argparse.Namespace, payload: dict[str, Any], evaluation: Evaluation, header: str) -> None:
    if args.json:
        json.dump(payload, sys.stdout, indent=1, default=_json_default)
        sys.stdout.write("\n")
        return
    from guarduq.calibration.report import metrics_rows

    by_name = {"all": evaluation.metrics, **evaluation.per_dataset}
    headers, rows = metrics_rows(by_name)
    print(header)
    print(_text_table(headers, rows))
    print("\nguarantees (accept when risk <= threshold):")
    print(_text_table(
        ["alpha", "delta", "threshold", "coverage", "accepted", "error_rate", "held"],
        [[g["alpha"], g["delta"], g["threshold"], g["coverage"], g["n_accepted"], g["error_rate"], g["held"]]
         for g in evaluation.guarantees],
    ))
    for g in evaluation.guarantees:
        if g["threshold"] is None:
            print(f"  alpha={g['alpha']:g}: NOT MET - {g.get('note')}")
    for note in evaluation.coverage_notes():
        print(f"  uneven coverage: {note}")


def _text_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, bool):
            return "yes" if x else "no"
        if isinstance(x, float):
            return f"{x:.3f}"
        return str(x)

    cells = [[cell(c) for c in r] for r in rows]
    short = [h.replace("AUROC ", "auc_") for h in headers]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(short)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(short, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


# --------------------------------------------------------------------------- commands


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from guarduq.calibration.evaluation import summarize

    C = _parse_C(args.C)
    _review_settings(args)
    alphas = tuple(args.alpha or DEFAULT_ALPHAS)
    if args.cascade_on is not None:
        return _cmd_cascade(args, C, alphas)
    rule = args.features if args.features in FEATURE_RULES else None
    if args.per_dataset and REVIEWS in args.dataset:
        raise InputError("--per-dataset fits a model per QA kind; reviews are certified per traffic group already")
    if args.per_dataset and args.within_datasets:
        raise InputError("--per-dataset and --within-datasets are exclusive: a model per kind, or one "
                         "model learned inside the kinds")
    for flag, wanted in ((f"--features {rule}", rule), ("--within-datasets", args.within_datasets),
                         ("--per-dataset", args.per_dataset)):
        if wanted and len(set(args.dataset)) < 2:
            raise InputError(f"{flag} compares datasets: give at least 2 --dataset/--data pairs "
                             "of different kinds")
    # validates features before the slow part (a rule chooses among the same-pass ones later)
    cal = Calibrator(FEATURE_SETS["same-pass"] if rule else args.features, C=C)
    features = cal.feature_set or cal.features
    for a in alphas:
        if not 0 < a < 1:
            raise InputError(f"--alpha must be in (0, 1), got {a}")
    if not 0 < args.delta < 1:
        raise InputError(f"--delta must be in (0, 1), got {args.delta}")
    sve = _sve_plan(args, cal.features)
    _check_outputs(args, args.out)
    guard, datasets, records = _score_all(args, args.model, p_true="p_true" in cal.features, sve=sve)
    ok = [r for r in records if r.usable]
    fractions = {"test_fraction": args.test_fraction, "threshold_fraction": args.threshold_fraction}
    parts: dict[str, list[Any]] = {"fit": [], "threshold": [], "test": []}
    weights, n_uniform = None, 0
    if REVIEWS in args.dataset:  # weighted fit, certificate from the uniform sample only
        parts, weights, n_uniform = review_parts(ok, datasets, fractions, review_progress(args.store))
        check_review_size(parts, n_uniform, alphas, args.delta, fractions)
    else:
        split = _splitter(datasets, fractions)
        for r in ok:
            parts[split(r)].append(r)
    for name, part in parts.items():
        if not part:
            raise CalibrationError(
                f"the '{name}' split is empty ({len(ok)} usable items); use more data (--limit) "
                "or other --test-fraction / --threshold-fraction"
            )
    for warning in _size_warnings(parts, alphas, args.delta, fractions):
        print(f"warning: {warning}", file=sys.stderr)
    if rule:
        features = _apply_rule(rule, parts["fit"], C)
    cal = Calibrator(features, C=C, within_groups=args.within_datasets, per_group=args.per_dataset,
                     model_name=guard.info.name,
                     model_fingerprint=guard.info.fingerprint, model_source=guard.info.source)
    if rule:
        cal.feature_set = rule  # the artifact records how its features were chosen
    cal.split_ = fractions
    cal.fit(*_xy(parts["fit"]), sample_weight=weights)  # the 3rd column, each item's dataset: --within-datasets
    if weights is not None:
        uniform_reference(cal, ok, datasets)
    kinds = _xy(parts["threshold"])[2] if args.per_dataset else None  # each kind's model certified on its own
    cal.fit_thresholds(*_xy(parts["threshold"])[:2], alphas=alphas, delta=args.delta, groups=kinds)
    if weights is not None:  # reviews: a certificate per traffic group where its labels allow one
        cal.group_thresholds_ = group_certificates(cal, parts, datasets, alphas, args.delta)
    reviews = weights is not None  # labels that count: the uniform sample's
    check_certified(args, args.out, cal.thresholds_, reasons_for(
        cal.thresholds_, parts["threshold"], n_labels=n_uniform if reviews else len(ok),
        threshold_fraction=args.threshold_fraction,
        unit="labels of the uniform sample" if reviews else "labelled answers"))
    evaluation = cal.evaluate(*_xy(parts["test"]))  # the pooled risk, as the pooled certificate
    cal.attach_evaluation(evaluation)
    if not reviews:  # reviews: the uniform sample per traffic group (uniform_reference)
        cal.drift_reference_ = reference_data([r.scores for r in ok], [r.dataset for r in ok])
    summary = summarize(records)
    cal.datasets_ = [
        {
            **ds.describe(),
            "prompt_style": ds.prompt_style,
            "n_usable": summary[ds.name]["usable"],
            **{f"n_{k}": sum(r.dataset == ds.name for r in v) for k, v in parts.items()},
        }
        for ds in datasets
    ]
    sha = cal.save(args.out)
    evaluation.calibrator_sha256 = sha
    if args.report:
        from guarduq.calibration.report import write_report

        write_report(cal, args.report)
    payload = {
        "calibrator": str(args.out),
        "sha256": sha,
        "model": {"name": guard.info.name, "fingerprint": guard.info.fingerprint},
        "split_sizes": {k: len(v) for k, v in parts.items()},
        "datasets": summary,
        "thresholds": [t.__dict__ for t in cal.thresholds_],
        "test": evaluation.to_json(),
    }
    payload["coefficients"] = cal.coefficients()
    payload["feature_set"] = cal.feature_set
    payload["parameter_set"] = cal.parameter_set_
    payload["C"] = {"chosen": cal.C_, "cv": cal.cv_}
    payload["within_datasets"] = cal.groups_
    if cal.per_group:  # which kinds got a model of their own, and why the others did not
        payload["per_dataset"] = {"models": {g: m.n_fit for g, m in cal.group_models_.items()},
                                  "pooled_for": cal.group_fallback_,
                                  "certified": {g: {t.alpha: t.threshold for t in ts}
                                                for g, ts in cal.group_thresholds_.items()}}
    shape = _sve_shape(ok) if sve is not None else None
    payload["forward_equivalents"] = forward_equivalents(cal.features, shape)  # work per answer
    if sve is not None:
        payload["sve"] = {**sve.describe(), **({"shape": asdict(shape)} if shape else {})}
    if weights is not None:
        payload["reviews"] = {"uniform": n_uniform, "weights": weights_summary(weights),
                              "groups": {g: [t.__dict__ for t in ts] for g, ts in cal.group_thresholds_.items()}}
    header = (
        f"calibrator written to {args.out} (sha256 {sha[:12]}); fit on {len(parts['fit'])}, "
        f"thresholds on {len(parts['threshold'])}, metrics on {len(parts['test'])} held-out items\n"
        + _coef_text(cal)
    )
    _emit(args, payload, evaluation, header)
    return 0


def _review_settings(args: argparse.Namespace) -> None:
    """Fill --alpha, --test-fraction and --threshold-fraction from --policy (reviews only), else
    the defaults. One setting: a flag that disagrees with the policy's review section is refused."""
    review = None
    if args.policy is not None:
        if REVIEWS not in args.dataset:
            raise InputError("--policy goes with --dataset reviews (its review section sets the split)")
        from guarduq.policy import Policy

        policy = Policy.from_yaml(args.policy)
        review = policy.config.review
        if not args.alpha and policy.alpha is not None:
            args.alpha = [policy.alpha]
    for name, default in DEFAULT_FRACTIONS.items():
        given, setting = getattr(args, name), getattr(review, name, None)
        if given is not None and setting is not None and not math.isclose(given, setting):
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} {given:g} disagrees with {args.policy}'s review.{name} {setting:g}, "
                             f"which the review page counts with: drop {flag} or edit the policy")
        setattr(args, name, next(v for v in (given, setting, default) if v is not None))
    tf, hf = args.test_fraction, args.threshold_fraction
    if not (0 < tf < 1 and 0 < hf < 1 and tf + hf < 1):  # checked before the slow scoring
        raise InputError(f"the test and threshold fractions must each be in (0, 1) with a sum below 1 "
                         f"(both splits are needed; the rest fits the risk model), got test {tf:g} "
                         f"and threshold {hf:g}")


def _apply_rule(rule: str, fit: Sequence[Any], C: float | str) -> tuple[str, ...]:
    """The features ``rule`` keeps, judged on the fit split dataset by dataset (the threshold and
    test splits stay unseen), out of the free features these scores carry."""
    import numpy as np

    by_ds: dict[str, list[Any]] = {}
    for r in fit:
        by_ds.setdefault(r.dataset, []).append(r)
    groups = {}
    for d, rs in by_ds.items():
        scores, labels, _ = _xy(rs)
        groups[d] = (scores, np.array(labels))
    base = available([r.scores for r in fit], FEATURE_SETS["same-pass"])
    return select_features(rule, groups, base, C)


def _parse_C(text: str) -> float | str:
    if text == "cv":
        return "cv"
    try:
        C = float(text)
    except ValueError:
        raise InputError(f"--C must be a positive number or 'cv', got {text!r}") from None
    if not C > 0:
        raise InputError(f"--C must be > 0, got {text}")
    return C


def _size_warnings(
    parts: dict[str, list[Any]], alphas: Sequence[float], delta: float, fractions: dict[str, float]
) -> list[str]:
    from guarduq.calibration.sizing import calibration_warnings

    fit_fraction = 1 - fractions["test_fraction"] - fractions["threshold_fraction"]
    return calibration_warnings(
        n_fit=len(parts["fit"]),
        n_fit_wrong=sum(r.label == 0 for r in parts["fit"]),
        n_threshold=len(parts["threshold"]),
        n_threshold_wrong=sum(r.label == 0 for r in parts["threshold"]),
        alphas=list(alphas),
        delta=delta,
        threshold_fraction=fractions["threshold_fraction"],
        fit_fraction=fit_fraction,
    )


def _coef_text(cal: Calibrator) -> str:
    """Feature set, chosen C and one line per standardised coefficient with its sign."""
    how = f"chosen by {cal.cv_['folds']}-fold CV ({cal.cv_['scoring']})" if cal.cv_ else "fixed"
    lines = [f"features: {cal.feature_set or 'custom'}; gradient over parameters: {cal.parameter_set_}; "
             f"C = {cal.C_:.3g} ({how})"]
    if cal.groups_:
        lines.append(f"directions learned within each dataset: {', '.join(cal.groups_)}")
    lines.append("coefficients on P(wrong), standardised (+ = larger value, more risk):")
    for f, c in cal.coefficients().items():
        lines.append(f"  {f:>20s}  {c:+.3f}")
    if cal.costly_features:
        lines.append(f"  costly features (extra work per answer): {', '.join(cal.costly_features)}")
    return "\n".join(lines)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    cal = Calibrator.load(args.calibrator)  # fingerprint checked as soon as the model is loaded
    _check_outputs(args)
    spec = model_of(args.model, calibrator=args.calibrator)  # where it records its model, or --model
    if args.parameter_set is None:  # score over the parameters the calibrator was fitted on
        args.parameter_set = cal.parameter_set_
    sve = _sve_plan(args, cal.features)
    guard, datasets, records = _score_all(  # refuse another model's calibrator before scoring
        args,
        spec,
        lambda g: cal.check_model(g.info.fingerprint, model_name=g.info.name, allow_mismatch=args.allow_mismatch),
        p_true="p_true" in cal.features,
        sve=sve,
    )
    split = _splitter(datasets, cal.split_ or {})
    if REVIEWS in args.dataset and args.split == "test":  # reviews' test split: uniform items only
        records = uniform_only(records, datasets)
    selected = [r for r in records if args.split == "all" or split(r) == "test"]
    ok = [r for r in selected if r.usable]
    if not ok:
        raise CalibrationError("no usable items to evaluate (empty split, or every item failed)")
    evaluation = cal.evaluate(*_xy(ok))
    evaluation.n_invalid += len(selected) - len(ok)  # unscorable items (errors, invalid scores)
    if args.report:
        from guarduq.calibration.report import write_report

        write_report(evaluation, args.report)
    header = f"evaluated {args.calibrator} on {len(ok)} items (model {guard.info.name})"
    _emit(args, evaluation.to_json(), evaluation, header)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from guarduq.calibration.report import write_report

    cal = Calibrator.load(args.calibrator)
    page = write_report(cal, args.out)
    print(f"report written to {page}")
    return 0
