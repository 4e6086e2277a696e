"""Calibrator, guaranteed thresholds, metrics, artifact and report, on synthetic scores."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from guarduq.calibration import (
    Calibrator,
    Threshold,
    aurc,
    auroc,
    brier,
    clopper_pearson_upper,
    ece,
    ece_floor,
    prr,
    select_threshold,
    start_size,
    start_threshold,
)
from guarduq.calibration.metrics import EVAL_FIELDS, Evaluation
from guarduq.calibration.report import FIGURES, _fmt, metrics_rows, write_report
from guarduq.errors import ArtifactError, CalibrationError, FingerprintMismatchError
from guarduq.scoring.uncertainty import Scores

FP = "a" * 32


def synthetic(n: int, seed: int = 0) -> tuple[list[dict[str, float]], np.ndarray]:
    """Score dicts whose label depends on log(epistemic) and aleatoric through a known logistic."""
    rng = np.random.default_rng(seed)
    log_e = rng.normal(0.0, 1.5, n)
    ale = rng.uniform(0.0, 0.25, n)
    p_wrong = 1 / (1 + np.exp(-(1.2 * log_e + 8 * (ale - 0.12))))
    labels = (rng.uniform(size=n) >= p_wrong).astype(int)  # 1 = correct
    pbar = 0.5 + np.sqrt(0.25 - ale)
    scores = [
        {
            "epistemic": float(np.exp(le)),
            "aleatoric": float(a),
            "mean_token_prob": float(pb),
            "mean_logprob": float(np.log(pb) - rng.uniform(0, 0.3)),
            "min_token_prob": float(pb * rng.uniform(0.2, 1)),
            "mean_entropy": float(rng.uniform(0, 3)),
            "n_tokens": int(rng.integers(1, 30)),
            "valid": True,
        }
        for le, a, pb in zip(log_e, ale, pbar, strict=True)
    ]
    return scores, labels


def fitted(n: int = 600, seed: int = 0) -> tuple[Calibrator, list[dict[str, float]], np.ndarray]:
    scores, labels = synthetic(n, seed)
    cal = Calibrator("paper", model_name="tiny", model_fingerprint=FP)
    cal.fit(scores[: n // 2], labels[: n // 2])
    cal.fit_thresholds(scores[n // 2 :], labels[n // 2 :], alphas=(0.2, 0.3), delta=0.1)
    cal.attach_evaluation(cal.evaluate(scores[n // 2 :], labels[n // 2 :], ["a", "b"] * (n // 4)))
    return cal, scores, labels


# --------------------------------------------------------------------------- the risk model


def test_matches_a_direct_sklearn_fit() -> None:
    scores, labels = synthetic(400)
    cal = Calibrator("paper", C=1.0).fit(scores, labels)
    X = np.array([[math.log(s["epistemic"]), s["aleatoric"]] for s in scores])
    ref = make_pipeline(StandardScaler(), LogisticRegression()).fit(X, 1 - labels)
    np.testing.assert_allclose(cal.predict_risk(scores), ref.predict_proba(X)[:, 1], rtol=1e-6, atol=1e-9)
    # It learned the true direction: more epistemic uncertainty, more risk.
    assert cal.pipeline_.named_steps["logistic"].coef_[0][0] > 0


def test_optional_features_in_the_given_order() -> None:
    scores, labels = synthetic(300, seed=1)
    feats = ("mean_logprob", "n_tokens", "min_token_prob")
    cal = Calibrator(feats, C=0.5).fit(scores, labels)
    X = np.array([[s["mean_logprob"], s["n_tokens"], s["min_token_prob"]] for s in scores])
    ref = make_pipeline(StandardScaler(), LogisticRegression(C=0.5)).fit(X, 1 - labels)
    np.testing.assert_allclose(cal.predict_risk(scores), ref.predict_proba(X)[:, 1], rtol=1e-6, atol=1e-9)


def test_accepts_scores_objects() -> None:
    scores, labels = synthetic(100, seed=2)
    objs = [
        Scores(s["epistemic"], s["aleatoric"], s["mean_token_prob"], s["mean_logprob"], s["min_token_prob"],
               s["mean_entropy"], s["n_tokens"], (0.5,), 10)
        for s in scores
    ]
    cal = Calibrator().fit(scores, labels)
    np.testing.assert_allclose(cal.predict_risk(objs), cal.predict_risk(scores))
    assert cal.risk(objs[0]) == pytest.approx(cal.predict_risk(scores[:1])[0])


def test_invalid_scores_are_excluded_when_fitting_and_fail_closed_when_predicting() -> None:
    scores, labels = synthetic(200, seed=3)
    bad = [
        {**scores[0], "valid": False},
        {**scores[1], "epistemic": float("nan")},
        {**scores[2], "aleatoric": float("inf")},
        {**scores[3], "epistemic": -1.0},
        {k: v for k, v in scores[4].items() if k != "aleatoric"},
    ]
    cal = Calibrator().fit(bad + scores[5:], labels)
    assert cal.n_fit_invalid_ == 5 and cal.n_fit_ == 195
    ref = Calibrator().fit(scores[5:], labels[5:])
    np.testing.assert_allclose(cal.predict_risk(scores[5:]), ref.predict_risk(scores[5:]))
    assert cal.predict_risk(bad).tolist() == [1.0] * 5


def test_zero_epistemic_is_floored_not_infinite() -> None:
    scores, labels = synthetic(100, seed=4)
    cal = Calibrator().fit(scores, labels)
    risk = cal.predict_risk([{**scores[0], "epistemic": 0.0}])
    assert np.isfinite(risk).all() and risk[0] < 1.0


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (np.ones(50, int), "all 50 fitting labels are 'correct'"),
        (np.zeros(50, int), "'wrong'"),
        (np.array([0, 1, 2] * 16 + [0, 1]), "labels must be 0"),
        (np.array([0, 1] * 10), "got 20 labels for 50 scores"),
    ],
)
def test_bad_labels(labels: np.ndarray, match: str) -> None:
    scores, _ = synthetic(50)
    with pytest.raises(CalibrationError, match=match):
        Calibrator().fit(scores, labels)


def test_bad_parameters_and_unfitted_use() -> None:
    with pytest.raises(CalibrationError, match="unknown feature"):
        Calibrator(("log_epistemic", "vibes"))
    with pytest.raises(CalibrationError, match="duplicate"):
        Calibrator(("aleatoric", "aleatoric"))
    with pytest.raises(CalibrationError, match="C must be"):
        Calibrator(C=0)
    with pytest.raises(CalibrationError, match="not fitted"):
        Calibrator().predict_risk([])
    scores, labels = synthetic(5)
    with pytest.raises(CalibrationError, match="at least"):
        Calibrator().fit(scores[:3], labels[:3])


# --------------------------------------------------------------------------- thresholds


def test_clopper_pearson_zero_errors_closed_form() -> None:
    # With no errors in n trials the exact upper bound solves (1 - p)^n = delta.
    for n in (5, 30, 200):
        assert clopper_pearson_upper(0, n, 0.1) == pytest.approx(1 - 0.1 ** (1 / n), rel=1e-9)
    assert clopper_pearson_upper(3, 3, 0.1) == 1.0
    assert clopper_pearson_upper(0, 0, 0.1) == 1.0
    # Monotone in the number of errors.
    assert clopper_pearson_upper(5, 100, 0.1) < clopper_pearson_upper(10, 100, 0.1)


def test_guarantee_holds_across_draws_and_is_not_vacuous() -> None:
    """Risk r ~ U(0, 1) and wrong ~ Bernoulli(r): the true error among accepted (r <= t) is t / 2.

    So a threshold violates alpha exactly when t > 2 alpha. Over many independent calibration
    sets the violation frequency must stay <= delta, while the chosen coverage stays useful.
    """
    rng = np.random.default_rng(12345)
    alpha, delta, n, draws = 0.2, 0.1, 400, 400
    chosen, naive = [], []
    for _ in range(draws):
        r = rng.uniform(size=n)
        wrong = (rng.uniform(size=n) < r).astype(int)
        t = select_threshold(r, wrong, alpha, delta)
        chosen.append(t.threshold if t.threshold is not None else -1.0)
        # The naive rule (loosest t whose *empirical* error <= alpha) for contrast.
        order = np.argsort(r)
        emp = np.cumsum(wrong[order]) / np.arange(1, n + 1)
        ok = np.flatnonzero(emp <= alpha)
        naive.append(r[order][ok[-1]] if ok.size else -1.0)
    chosen_arr, naive_arr = np.array(chosen), np.array(naive)
    violations = np.mean(chosen_arr / 2 > alpha)
    sd = math.sqrt(delta * (1 - delta) / draws)
    assert violations <= delta + 2 * sd
    # Not vacuous: the best possible coverage is 0.4 (t = 2 alpha); we keep most of it.
    assert np.mean(chosen_arr > 0) > 0.8  # a threshold is found in most draws
    assert np.median(chosen_arr) > 0.25
    # And the bound matters: picking by the empirical error alone breaks the target far more often.
    assert np.mean(naive_arr / 2 > alpha) > 3 * delta


def test_threshold_not_met_is_said_plainly() -> None:
    r = np.linspace(0, 1, 100)
    wrong = np.ones(100, int)
    t = select_threshold(r, wrong, 0.1, 0.1)
    assert t.threshold is None and not t.met and t.coverage == 0.0
    assert "no risk threshold" in (t.message or "")
    # Too few items to certify anything even with zero errors: (1 - 0.1)^10 > 0.1.
    t = select_threshold(np.linspace(0, 1, 10), np.zeros(10, int), 0.1, 0.1)
    assert t.threshold is None


def test_threshold_when_everything_is_right_accepts_all() -> None:
    t = select_threshold(np.linspace(0, 0.5, 200), np.zeros(200, int), 0.1, 0.1)
    assert t.threshold is not None and t.coverage == 1.0 and t.errors == 0
    assert t.upper_bound == pytest.approx(1 - 0.1 ** (1 / 200))


def test_fixed_sequence_stops_at_first_failure() -> None:
    # Low-risk items are all right, then a block of errors, then more right answers: the loose
    # end has a low overall error, but the sequence must stop before the error block.
    r = np.arange(300) / 300
    wrong = np.zeros(300, int)
    wrong[100:160] = 1
    t = select_threshold(r, wrong, 0.1, 0.1)
    assert t.threshold is not None and t.threshold < 160 / 300
    assert t.error_rate is not None and t.error_rate <= 0.1


def test_fit_thresholds_uses_the_calibrated_risk() -> None:
    scores, labels = synthetic(800, seed=5)
    cal = Calibrator().fit(scores[:400], labels[:400])
    ts = cal.fit_thresholds(scores[400:], labels[400:], alphas=(0.3, 0.1), delta=0.05)
    assert [t.alpha for t in ts] == [0.1, 0.3]
    start = start_threshold(cal.predict_risk(scores[:400]), 1 - labels[:400], 0.3, 0.05)
    direct = select_threshold(cal.predict_risk(scores[400:]), 1 - labels[400:], 0.3, 0.05, start=start)
    assert ts[1] == direct
    assert cal.threshold_for(0.3) == direct.threshold and cal.threshold_for(0.25) is None
    with pytest.raises(CalibrationError, match="alpha"):
        cal.fit_thresholds(scores[400:], labels[400:], alphas=(1.5,))


# --------------------------------------------------------------------------- metrics


def test_ece_and_brier_on_hand_made_cases() -> None:
    conf = np.array([0.9, 0.9, 0.9, 0.9, 0.1, 0.1])
    correct = np.array([1, 1, 1, 0, 0, 0])
    # bin 0.9: acc 0.75 vs 0.9 (4 items); bin 0.1: acc 0 vs 0.1 (2 items)
    assert ece(conf, correct) == pytest.approx((4 * 0.15 + 2 * 0.1) / 6)
    assert brier(conf, correct) == pytest.approx((3 * 0.01 + 0.81 + 2 * 0.01) / 6)
    assert ece(np.array([1.0, 0.0]), np.array([1, 0])) == 0.0


def test_ece_floor_is_the_ece_of_a_perfect_calibrator() -> None:
    def mean_floor(c: np.ndarray) -> float:
        return ece_floor(c, n_draws=20000)[0]

    # All confidences 0.5: one bin, ECE = |B/n - 0.5| with B ~ Binomial(n, 0.5) when the labels are
    # drawn from the confidences, so the floor is E|B/n - 0.5|, summed exactly over the pmf.
    n = 20
    exact = sum(stats.binom.pmf(k, n, 0.5) * abs(k / n - 0.5) for k in range(n + 1))
    assert mean_floor(np.full(n, 0.5)) == pytest.approx(exact, abs=0.003)
    # Its 95th percentile: the smallest |B/n - 0.5| whose cumulative probability reaches 0.95.
    devs = sorted({abs(k / n - 0.5) for k in range(n + 1)})
    cdf = [sum(stats.binom.pmf(k, n, 0.5) for k in range(n + 1) if abs(k / n - 0.5) <= d) for d in devs]
    p95 = next(d for d, c in zip(devs, cdf, strict=True) if c >= 0.95)
    assert ece_floor(np.full(n, 0.5), n_draws=20000)[1] == pytest.approx(p95, abs=1e-9)
    # Two bins of 10 at 0.2 and 0.8: the floor is the size-weighted mean of each bin's E|B/10 - c|.
    two = np.r_[np.full(10, 0.2), np.full(10, 0.8)]
    per_bin = sum(stats.binom.pmf(k, 10, 0.2) * abs(k / 10 - 0.2) for k in range(11))
    assert mean_floor(two) == pytest.approx(per_bin, abs=0.003)  # equal by symmetry
    # Unequal bins (30 at 0.1, 10 at 0.5): each bin's expected error weighted by its size.
    uneven = np.r_[np.full(30, 0.1), np.full(10, 0.5)]
    e30 = sum(stats.binom.pmf(k, 30, 0.1) * abs(k / 30 - 0.1) for k in range(31))
    e10 = sum(stats.binom.pmf(k, 10, 0.5) * abs(k / 10 - 0.5) for k in range(11))
    assert mean_floor(uneven) == pytest.approx((30 * e30 + 10 * e10) / 40, abs=0.003)
    # The same binning as ece: against ece itself over labels drawn from spread confidences, on
    # independent draws (Monte Carlo tolerance).
    conf = np.random.default_rng(2).uniform(0, 1, 137)
    null = [ece(conf, d) for d in np.random.default_rng(5).random((4000, conf.size)) < conf]
    mean, q95 = ece_floor(conf, n_draws=4000)
    assert mean == pytest.approx(np.mean(null), abs=0.002)
    assert q95 == pytest.approx(np.quantile(null, 0.95), abs=0.006)
    # Sampling noise shrinks like 1/sqrt(n); certain confidences have none.
    rng = np.random.default_rng(1)
    small, large = rng.uniform(0.2, 0.8, 100), rng.uniform(0.2, 0.8, 10000)
    assert ece_floor(large)[0] < ece_floor(small)[0] / 5
    assert ece_floor(np.array([0.0, 1.0, 1.0])) == (0.0, 0.0) and ece_floor(np.array([])) == (0.0, 0.0)


def test_metrics_table_shows_the_floor_and_a_dash_for_artifacts_without_one() -> None:
    headers, rows = metrics_rows({"new": {"n": 5, "ece_floor": 0.018, "ece_floor_p95": 0.028}, "old": {"n": 5}})
    col = headers.index("ECE floor (95%)")
    assert rows[0][col] == "0.018 (0.028)" and rows[1][col] is None


def test_auroc_is_none_for_one_class() -> None:
    assert auroc(np.ones(5, int), np.arange(5.0)) is None
    assert auroc(np.zeros(5, int), np.arange(5.0)) is None
    assert auroc(np.array([0, 1]), np.array([0.1, 0.9])) == 1.0
    cal, scores, labels = fitted()
    ev = cal.evaluate(scores[:40], np.ones(40, int))
    assert all(v is None for v in ev.metrics["auroc"].values()) and ev.metrics["prr"] is None


def test_aurc_and_prr() -> None:
    wrong = np.array([0, 0, 0, 1, 1])
    oracle = wrong.astype(float)  # wrong ones most uncertain
    reverse = -oracle
    assert prr(oracle, wrong) == pytest.approx(1.0)
    assert prr(reverse, wrong) < 0
    assert aurc(oracle, wrong) < aurc(reverse, wrong)
    assert aurc(oracle, wrong) == pytest.approx(np.mean([0, 0, 0, 1 / 4, 2 / 5]))
    rng = np.random.default_rng(0)
    w = rng.integers(0, 2, 20000)
    assert abs(prr(rng.uniform(size=20000), w)) < 0.05  # random ranking ~ 0
    assert prr(oracle, np.zeros(5)) is None


def test_evaluate_metrics_and_guarantees() -> None:
    cal, scores, labels = fitted()
    test_s, test_y = scores[300:], labels[300:]
    ev = cal.evaluate(test_s, test_y)
    m = ev.metrics
    wrong = 1 - test_y
    risk = cal.predict_risk(test_s)
    assert m["n"] == 300 and m["accuracy"] == pytest.approx(test_y.mean())
    assert m["auroc"]["risk"] == pytest.approx(roc_auc_score(wrong, risk))
    assert m["auroc"]["epistemic"] == pytest.approx(roc_auc_score(wrong, [s["epistemic"] for s in test_s]))
    assert m["auroc"]["mean_logprob"] == pytest.approx(roc_auc_score(wrong, [-s["mean_logprob"] for s in test_s]))
    assert m["auroc"]["risk"] > 0.7  # the synthetic signal is strong
    assert m["ece_after"] < m["ece_before"]  # p̄ is not a calibrated confidence here; risk is
    assert (m["ece_floor"], m["ece_floor_p95"]) == pytest.approx(ece_floor(1 - risk))
    assert m["ece_floor"] < m["ece_floor_p95"]
    for g, t in zip(ev.guarantees, cal.thresholds_, strict=True):
        acc = risk <= t.threshold
        assert g["coverage"] == pytest.approx(acc.mean())
        assert g["error_rate"] == pytest.approx(wrong[acc].mean())
        assert g["held"] == (wrong[acc].mean() <= t.alpha)
    ev_ds = cal.evaluate(test_s, test_y, ["x"] * 100 + ["y"] * 200)
    assert set(ev_ds.per_dataset) == {"x", "y"} and ev_ds.per_dataset["x"]["n"] == 100
    out = ev.to_json()
    for key in ("n", "accuracy", "auroc", "ece_before", "ece_after", "ece_floor", "ece_floor_p95", "brier", "aurc", "prr",
                "guarantees"):
        assert key in out
    json.dumps(out)


def test_evaluate_counts_invalid_items() -> None:
    cal, scores, labels = fitted()
    ev = cal.evaluate([{**scores[0], "valid": False}, *scores[1:50]], labels[:50])
    assert ev.n_invalid == 1 and ev.metrics["n"] == 49


def test_coverage_notes_say_when_a_guarantee_rests_on_one_kind_of_question(tmp_path: Path) -> None:
    # 10 easy items at risk 0.1, 20 middling at 0.5, 30 hard at 0.9: a threshold of 0.2 accepts
    # the easy ones only (10 of 10 accepted, 10 / 60 = 17% of the items); 0.95 accepts them all.
    risk = np.repeat([0.1, 0.5, 0.9], [10, 20, 30])
    datasets = np.repeat(["easy", "mid", "hard"], [10, 20, 30])
    labels = (risk < 0.7).astype(int)
    signals = {k: risk for k in EVAL_FIELDS}

    def thr(t: float | None) -> Threshold:
        return Threshold(0.3, 0.1, t, 0.0, 60, 0, 0, None, None)

    ev = Evaluation.from_arrays(labels, signals, datasets, [thr(0.2), thr(0.95), thr(None)])
    assert ev.coverage_notes() == [
        "alpha=0.3 (risk <= 0.2): accepts no answer from hard or mid; 10 of the 10 accepted answers (100%) "
        "are easy, which is 17% of the items. The guarantee covers this mix, not each kind of question in it"
    ]
    assert ev.to_json()["coverage_notes"] == ev.coverage_notes()
    # At 0.6 the middling items join: 20 of the 30 accepted are "mid", a third of the items.
    assert Evaluation.from_arrays(labels, signals, datasets, [thr(0.6)]).coverage_notes() == [
        "alpha=0.3 (risk <= 0.6): accepts no answer from hard; 20 of the 30 accepted answers (67%) are mid,"
        " which is 33% of the items. The guarantee covers this mix, not each kind of question in it"
    ]
    # The first 30 items split evenly between "a" and "b": only the hard ones are left out.
    halves = np.r_[np.tile(["a", "b"], 15), np.full(30, "hard")]
    assert Evaluation.from_arrays(labels, signals, halves, [thr(0.6)]).coverage_notes() == [
        "alpha=0.3 (risk <= 0.6): accepts no answer from hard. The guarantee covers this mix, not each kind"
        " of question in it"
    ]
    # Every dataset accepted, but 40 of 45 accepted answers from one that is a third of the items.
    mixed = np.repeat(["x", "y", "z"], [20, 20, 20])
    risk_m = np.r_[np.full(20, 0.1), np.full(3, 0.1), np.full(17, 0.9), np.full(2, 0.1), np.full(18, 0.9)]
    sig_m = {k: risk_m for k in EVAL_FIELDS}
    assert Evaluation.from_arrays((risk_m < 0.5).astype(int), sig_m, mixed, [thr(0.2)]).coverage_notes() == [
        "alpha=0.3 (risk <= 0.2): 20 of the 25 accepted answers (80%) are x, which is 33% of the items."
        " The guarantee covers this mix, not each kind of question in it"
    ]
    # The same share from a dataset that is most of the items is no surprise: no note.
    big = np.repeat(["x", "y", "z"], [40, 10, 10])
    risk_b = np.r_[np.full(40, 0.1), np.full(3, 0.1), np.full(7, 0.9), np.full(2, 0.1), np.full(8, 0.9)]
    assert Evaluation.from_arrays((risk_b < 0.5).astype(int), {k: risk_b for k in EVAL_FIELDS}, big,
                                  [thr(0.2)]).coverage_notes() == []
    assert Evaluation.from_arrays(labels, signals, None, [thr(0.2)]).coverage_notes() == []  # one dataset
    even = Evaluation.from_arrays(labels, signals, np.tile(["a", "b"], 30), [thr(0.2)])
    assert even.coverage_notes() == []  # both kinds accepted, neither dominates
    page = write_report(ev, tmp_path / "rep").read_text()
    assert "Uneven coverage:</b> alpha=0.3 (risk &lt;= 0.2): accepts no answer from hard or mid;" in page
    assert "Uneven coverage" not in write_report(even, tmp_path / "even").read_text()


# --------------------------------------------------------------------------- artifact


def test_artifact_round_trip(tmp_path: Path) -> None:
    cal, scores, _ = fitted()
    path = tmp_path / "cal.json"
    sha = cal.save(path)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest() == cal.sha256
    doc = json.loads(path.read_text())
    for key in ("format_version", "guarduq_version", "model", "features", "scaler", "logistic",
                "thresholds", "metrics", "datasets", "created"):
        assert key in doc
    loaded = Calibrator.load(path, expected_fingerprint=FP)
    np.testing.assert_allclose(loaded.predict_risk(scores), cal.predict_risk(scores), rtol=1e-12)
    assert loaded.thresholds_ == cal.thresholds_
    assert loaded.features == cal.features and loaded.model_fingerprint == FP
    assert loaded.sha256 == sha and loaded.threshold_for(0.2) == cal.threshold_for(0.2)
    assert loaded.evaluation_ is not None
    assert loaded.evaluation_.metrics["auroc"]["risk"] == pytest.approx(cal.metrics_["auroc"]["risk"], abs=1e-5)
    assert not list(tmp_path.glob(".cal.json.*"))  # no temp files left


def test_cross_fingerprint_refusal_and_logged_override(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cal, scores, _ = fitted()
    path = tmp_path / "cal.json"
    cal.save(path)
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        Calibrator.load(path, expected_fingerprint="b" * 32)
    logging.getLogger("guarduq").setLevel(logging.WARNING)
    with caplog.at_level(logging.WARNING, logger="guarduq"):
        loaded = Calibrator.load(path, expected_fingerprint="b" * 32, allow_mismatch=True)
    assert "calibrator_fingerprint_mismatch_overridden" in caplog.text
    assert loaded.predict_risk(scores[:3]).shape == (3,)
    with pytest.raises(FingerprintMismatchError):
        cal.check_model("c" * 32)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: json.dumps([1, 2]), "not a guarduq calibrator"),
        (lambda d: json.dumps({**d, "format": "pickle"}), "not a guarduq calibrator"),
        (lambda d: json.dumps({**d, "format_version": 99}), "version 99"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "scaler"}), "scaler"),
        (lambda d: json.dumps({**d, "logistic": {**d["logistic"], "coef": [1.0]}}), "lengths"),
        (lambda d: json.dumps({**d, "scaler": {**d["scaler"], "scale": [0.0, 1.0]}}), "invalid calibrator parameters"),
        (lambda d: json.dumps({**d, "features": ["log_epistemic", "vibes"]}), "unknown feature"),
        (lambda d: json.dumps({**d, "logistic": {**d["logistic"], "intercept": "x"}}), "intercept"),
        (lambda d: json.dumps({**d, "evaluation_data": {"label": [1]}}), "evaluation_data"),
    ],
)
def test_corrupt_artifacts(tmp_path: Path, mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    cal, _, _ = fitted(200)
    path = tmp_path / "cal.json"
    cal.save(path)
    path.write_text(mutate(json.loads(path.read_text())))
    with pytest.raises(ArtifactError, match=match):
        Calibrator.load(path)


def test_missing_artifact(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        Calibrator.load(tmp_path / "nope.json")


# --------------------------------------------------------------------------- report


def test_report_writes_html_and_pngs(tmp_path: Path) -> None:
    cal, _, _ = fitted()
    cal.save(tmp_path / "cal.json")
    page = write_report(Calibrator.load(tmp_path / "cal.json"), tmp_path / "rep")
    html = page.read_text()
    for name in FIGURES.values():
        png = tmp_path / "rep" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and name in html
    assert f"{cal.metrics_['auroc']['risk']:.3f}" in html
    assert FP in html
    # Each threshold's learned start is shown beside it (it travels in the artifact).
    assert all(t.start is not None for t in cal.thresholds_)
    assert "<th>start</th>" in html and "".join(f"<td>{_fmt(t.start)}</td>" for t in cal.thresholds_[:1]) in html
    with pytest.raises(CalibrationError, match="nothing to report"):
        write_report(Calibrator().fit(*synthetic(50)), tmp_path / "x")


def test_threshold_dataclass_round_trips() -> None:
    t = Threshold(0.2, 0.1, 0.3, 0.5, 100, 50, 5, 0.1, 0.18)
    assert Threshold(**json.loads(json.dumps(t.__dict__))) == t and t.met


def _confidently_wrong_draw(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Risk ~ U(0, 0.8), wrong ~ Bernoulli(risk), except that the six lowest risks are all wrong:
    the confident errors real calibrators produce."""
    r = np.sort(rng.uniform(0.0, 0.8, size=n))
    wrong = (rng.uniform(size=n) < r).astype(int)
    wrong[:6] = 1
    return r, wrong


def test_the_sequence_starts_where_the_fit_split_is_strongest() -> None:
    rng = np.random.default_rng(7)
    alpha, delta = 0.3, 0.1
    fit_r, fit_w = _confidently_wrong_draw(rng, 500)
    thr_r, thr_w = _confidently_wrong_draw(rng, 400)
    # From the strictest testable threshold, the confident errors stop the sequence at once.
    assert select_threshold(thr_r, thr_w, alpha, delta).threshold is None
    start = start_threshold(fit_r, fit_w, alpha, delta)
    # Independent expectation: loop over the grid, count by hand, keep the smallest p-value.
    best_p, expect = math.inf, None
    for t in np.round(np.linspace(0, 1, 1001), 6):
        acc = fit_r <= t
        if acc.sum() >= start_size(alpha, delta):
            p = stats.binom.cdf(int(fit_w[acc].sum()), int(acc.sum()), alpha)
            if p < best_p:
                best_p, expect = p, float(t)
    assert start == expect and 0.1 < start < 0.6
    t = select_threshold(thr_r, thr_w, alpha, delta, start=start)
    assert t.threshold is not None and t.threshold >= start and t.start == start
    assert t.error_rate is not None and t.error_rate <= alpha
    assert t.upper_bound is not None and t.upper_bound <= alpha + 1e-9  # the test and its bound agree
    # A start at or before the first testable threshold adds nothing: one sequence, the whole delta.
    r = rng.uniform(size=400)
    w = (rng.uniform(size=400) < r).astype(int)
    alone = select_threshold(r, w, alpha, delta)
    assert alone.threshold is not None
    assert select_threshold(r, w, alpha, delta, start=0.0) == dataclasses.replace(alone, start=0.0)
    # Nothing testable on too little data: no start, and select_threshold falls back to start_size.
    assert start_threshold(fit_r[:3], fit_w[:3], alpha, delta) is None


def test_a_learned_start_keeps_the_guarantee() -> None:
    """As test_guarantee_holds_across_draws_and_is_not_vacuous, with the start learned on a fresh
    fit draw each time: the true error among risk <= t is t / 2, so t* violates alpha iff t* > 2 alpha.
    Here the lowest risks hold no confident errors, so the second start only costs delta / 2."""
    rng = np.random.default_rng(99)
    alpha, delta, n, draws = 0.2, 0.1, 400, 300
    chosen = []
    for _ in range(draws):
        fr = rng.uniform(size=n)
        start = start_threshold(fr, (rng.uniform(size=n) < fr).astype(int), alpha, delta)
        r = rng.uniform(size=n)
        t = select_threshold(r, (rng.uniform(size=n) < r).astype(int), alpha, delta, start=start)
        chosen.append(t.threshold if t.threshold is not None else -1.0)
        if t.threshold is not None:  # the bound is taken at the level the sequences were tested at
            levels = [clopper_pearson_upper(t.errors, t.n_accepted, d) for d in (delta, delta / 2)]
            assert any(t.upper_bound == pytest.approx(b) for b in levels) and t.upper_bound <= alpha
    chosen_arr = np.array(chosen)
    assert np.mean(chosen_arr / 2 > alpha) <= delta + 2 * math.sqrt(delta * (1 - delta) / draws)
    assert np.mean(chosen_arr > 0) > 0.8 and np.median(chosen_arr) > 0.2  # best possible: 0.4


def test_fit_thresholds_starts_from_the_fit_split_and_records_it(tmp_path: Path) -> None:
    scores, labels = synthetic(800, seed=5)
    cal = Calibrator().fit(scores[:400], labels[:400])
    ts = cal.fit_thresholds(scores[400:], labels[400:], alphas=(0.3,), delta=0.1)
    fit_risk = cal.predict_risk(scores[:400])
    expect = start_threshold(fit_risk, 1 - np.asarray(labels[:400]), 0.3, 0.1)
    assert expect is not None and ts[0].start == pytest.approx(expect)
    cal.save(tmp_path / "c.json")
    back = Calibrator.load(tmp_path / "c.json")
    assert back.thresholds_ == cal.thresholds_  # the start travels in the artifact
    # A loaded calibrator has no fit split: its own fit_thresholds falls back to start_size.
    assert back.fit_thresholds(scores[400:], labels[400:], alphas=(0.3,))[0].start is None


def test_the_learned_start_ignores_a_handful_of_lucky_answers() -> None:
    # Fit split: the 5 lowest risks right, then 115 wrong, then 60% wrong. At alpha 0.7 the five
    # alone give p = 0.3^5 = 0.002, the smallest p-value anywhere: a fluke to start from.
    alpha, delta = 0.7, 0.1
    r = np.round(np.arange(400) / 400 + 1 / 800, 6)
    wrong = np.r_[np.zeros(5, int), np.ones(115, int), np.tile([1, 1, 1, 0, 0], 56)]
    fluke = start_threshold(r, wrong, alpha, delta, min_share=0.0)
    assert fluke is not None and np.sum(r <= fluke) == 5  # without the floor it starts at the five
    start = start_threshold(r, wrong, alpha, delta)  # at least 5% of the answers (20 here)
    assert start is not None and np.sum(r <= start) >= 20
