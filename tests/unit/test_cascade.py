"""The calibrated cascade (issue 24, item 4): the band, the second stage fitted and certified inside
it, its artifact, and the policy that serves it (``so.risk``, ``so.threshold``, ``band``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from guarduq.calibration import Calibrator
from guarduq.calibration.cascade import (
    band_of,
    cascade_accepts,
    choose_band,
    fit_second_stage,
    with_first_risk,
)
from guarduq.errors import CalibrationError, PolicyError
from guarduq.policy import Policy
from guarduq.policy.validation import validate_policy_text

ALPHA = 0.3


def _world(n: int, seed: int) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Answers whose first-stage signal (mean_logprob) is weak and whose second opinion
    (sve_mean_prob) is strong: what a cascade is for."""
    rng = np.random.default_rng(seed)
    correct = rng.random(n) < 0.55
    first = np.where(correct, 0.6, -0.6) + rng.normal(0, 1.2, n)
    second = np.where(correct, 0.75, 0.3) + rng.normal(0, 0.12, n)
    scores = [{"valid": True, "mean_logprob": float(a), "sve_mean_prob": float(np.clip(b, 0.01, 0.99)),
               "sve_variance": float(rng.uniform(0, 0.01)), "sve_mi": float(rng.uniform(0, 0.1))}
              for a, b in zip(first, second, strict=True)]
    return scores, correct.astype(int)


@pytest.fixture(scope="module")
def stages() -> tuple[Calibrator, Calibrator]:
    fit, y_fit = _world(3000, 0)
    thr, y_thr = _world(3000, 1)
    first = Calibrator(("mean_logprob",), C=1.0).fit(fit, y_fit)
    first.fit_thresholds(thr, y_thr, alphas=(ALPHA,), delta=0.1)
    second = fit_second_stage(first, fit, y_fit, thr, y_thr, alpha=ALPHA, delta=0.1, C=1.0)
    return first, second


def test_band_holds_at_most_its_share_above_the_lower_edge() -> None:
    r = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    band = choose_band(r, lower=0.3, share=0.3)
    assert (band.lower, band.upper) == (0.3, 0.6)  # 0.4, 0.5, 0.6: three of ten
    assert band.contains(r).sum() == 3 and band.share == pytest.approx(0.3)
    assert choose_band(r, None, 0.25).upper == 0.2  # no first-stage threshold: from the lowest risk
    ties = np.array([0.1, 0.5, 0.5, 0.5, 0.9, 0.95])
    assert choose_band(ties, 0.1, 0.5).contains(ties).sum() == 3  # a tie straddling the edge stays out
    with pytest.raises(CalibrationError, match="ties"):
        choose_band(np.array([0.1, 0.5, 0.5, 0.5, 0.9]), 0.1, 0.4)
    with pytest.raises(CalibrationError, match="empty"):
        choose_band(r, lower=1.0, share=0.3)


def test_second_stage_is_fitted_in_the_band_and_raises_coverage_at_the_same_alpha(
    stages: tuple[Calibrator, Calibrator], tmp_path: Path,
) -> None:
    first, second = stages
    t1, t2 = first.threshold_for(ALPHA), second.threshold_for(ALPHA)
    band = band_of(second)
    assert t1 is not None and t2 is not None and band.lower == t1
    assert second.cascade_ is not None and second.cascade_["alpha"] == ALPHA
    assert second.coefficients()["sve_mean_prob"] < 0  # a likelier answer to the ensemble: less risk
    test, y = _world(6000, 2)
    r1 = first.predict_risk(test)
    r2 = second.predict_risk(with_first_risk(test, r1))
    alone = cascade_accepts(r1, r2, t1, band, None)
    both = cascade_accepts(r1, r2, t1, band, t2)
    assert (alone <= both).all()  # the cascade only adds answers
    assert both.mean() > alone.mean() + 0.05
    assert 1 - y[both].mean() <= ALPHA  # and keeps the error rate at alpha
    assert band.contains(r1).mean() < 0.37  # about a third paid for the second opinion
    path = tmp_path / "second.json"
    second.save(path)
    again = Calibrator.load(path)
    assert again.cascade_ == second.cascade_
    np.testing.assert_allclose(again.predict_risk(with_first_risk(test[:50], r1[:50])), r2[:50])


def _policy(tmp_path: Path, first: Calibrator, second: Calibrator, **changes: Any) -> Policy:
    first.save(tmp_path / "first.json")
    second.save(tmp_path / "second.json")
    doc = {
        "name": "cascade", "version": "1", "calibrator": "first.json", "second_calibrator": "second.json",
        "alpha": ALPHA,
        "rules": [
            {"name": "confident", "when": {"risk": {"le": "threshold"}}, "action": "allow"},
            {"name": "borderline", "when": {"risk": {"gt": "threshold", "le": "band"}}, "action": "second_opinion",
             "rules": [{"name": "confirmed", "when": {"so.risk": {"le": "so.threshold"}}, "action": "allow"},
                       {"name": "refused", "action": "abstain"}]},
            {"name": "risky", "action": "abstain"},
        ],
        **changes,
    }
    return Policy.from_dict(doc, base_dir=tmp_path)


def test_policy_serves_the_cascade_with_certified_numbers_only(
    stages: tuple[Calibrator, Calibrator], tmp_path: Path,
) -> None:
    first, second = stages
    asked: list[str] = []

    def opinion(prompt: Any, response: str) -> Any:
        asked.append(response)
        p = 0.8 if response == "good" else 0.2
        return SimpleNamespace(mean_prob=p, variance=0.001, mutual_information=0.02, agrees=None)

    pol = _policy(tmp_path, first, second).bind(
        second_opinion=opinion, calibrator=Calibrator.load(tmp_path / "first.json"),
        second_calibrator=Calibrator.load(tmp_path / "second.json"))
    t1, band = first.threshold_for(ALPHA), band_of(second)
    assert pol.second_threshold == second.threshold_for(ALPHA) and pol.band_upper == band.upper
    inside = (t1 + band.upper) / 2
    assert pol.decide({"risk": t1 / 2}, response="x").rule == "confident" and not asked
    assert pol.decide({"risk": band.upper + 0.01}, response="x").rule == "risky" and not asked
    good = pol.decide({"risk": inside}, response="good")
    bad = pol.decide({"risk": inside}, response="bad")
    assert asked == ["good", "bad"]
    assert good.action == "allow" and good.rule == "borderline/confirmed"
    assert bad.action == "abstain" and bad.rule == "borderline/refused"
    expected = second.risk({"first_risk": inside, "sve_mean_prob": 0.8, "sve_variance": 0.001, "sve_mi": 0.02})
    assert f"risk={expected:.4g}" in good.explanation


def test_policy_refuses_a_second_stage_from_another_band_alpha_or_first_stage(
    stages: tuple[Calibrator, Calibrator], tmp_path: Path,
) -> None:
    first, second = stages
    pol = _policy(tmp_path, first, second)
    loaded_first = Calibrator.load(tmp_path / "first.json")
    with pytest.raises(PolicyError, match="load its second_calibrator"):
        pol.bind(second_opinion=lambda p, r: None, calibrator=loaded_first)
    with pytest.raises(PolicyError, match="not a cascade's second stage"):
        pol.bind(second_opinion=lambda p, r: None, calibrator=loaded_first, second_calibrator=loaded_first)
    other = Calibrator.load(tmp_path / "second.json")
    other.cascade_ = {**other.cascade_, "alpha": 0.4}
    with pytest.raises(PolicyError, match="certified at alpha=0.4"):
        pol.bind(second_opinion=lambda p, r: None, calibrator=loaded_first, second_calibrator=other)
    other.cascade_ = {**second.cascade_, "band_lower": 0.01}
    with pytest.raises(PolicyError, match="band starts at"):
        pol.bind(second_opinion=lambda p, r: None, calibrator=loaded_first, second_calibrator=other)
    other.cascade_ = {**second.cascade_, "first_stage_sha256": "0" * 64}
    with pytest.raises(PolicyError, match="another first-stage"):
        pol.bind(second_opinion=lambda p, r: None, calibrator=loaded_first, second_calibrator=other)


@pytest.mark.parametrize(("rules", "message"), [
    ("[{name: a, when: {risk: {le: so.threshold}}, action: allow}, {name: b, action: abstain}]",
     "compare it with so.risk only"),
    ("[{name: a, when: {risk: {le: band}}, action: allow}, {name: b, action: abstain}]",
     "second_calibrator"),
    ("[{name: a, action: second_opinion, rules: [{name: c, when: {so.risk: {le: 0.5}}, action: allow}]}]",
     "second_calibrator"),
])
def test_cascade_words_are_checked_where_they_are_written(rules: str, message: str) -> None:
    text = f"name: p\nversion: '1'\ncalibrator: c.json\nalpha: 0.3\nrules: {rules}\n"
    config, issues = validate_policy_text(text, "p.yaml")
    assert config is None and any(message in str(i) for i in issues), issues


def test_cli_fits_a_second_stage_the_policy_then_binds(tmp_path: Path, tiny_model_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`guarduq calibrate --cascade-on FIRST --sve FILE`: the second stage is fitted in the band
    above FIRST's threshold, bound to FIRST by sha256, and `policy check` reads it as bind does."""
    import json

    from guarduq.cli import main
    from guarduq.models import load_model
    from guarduq.sve import SVEnsemble

    rng = np.random.default_rng(0)
    words = ["red", "blue", "green", "four", "Paris", "seven", "tea", "a cat", "no", "yes"]
    rows = [{"id": f"r{i}", "prompt": f"Question {i}: name a thing.", "response": str(rng.choice(words)),
             "label": int(rng.random() < 0.6)} for i in range(180)]
    data = tmp_path / "logs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    sve = SVEnsemble.from_model(load_model(str(tiny_model_dir)), members=2, last_n_blocks=1, sigma_init=0.3)
    sve_file = sve.save(tmp_path / "sve.safetensors")
    common = ["--model", str(tiny_model_dir), "--dataset", "jsonl", "--data", str(data),
              "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--json", "--C", "1", "--alpha", "0.6",
              "--allow-uncertified"]
    assert main(["calibrate", *common, "--features", "paper+likelihood", "--out", str(tmp_path / "first.json")]) == 0
    capsys.readouterr()
    first = Calibrator.load(tmp_path / "first.json")

    bad = main(["calibrate", *common, "--alpha", "0.5", "--cascade-on", str(tmp_path / "first.json"),
                "--sve", str(sve_file), "--sve-answer-tokens", "0", "--out", str(tmp_path / "x.json")])
    assert bad == 2 and "one --alpha" in capsys.readouterr().err
    assert main(["calibrate", *common, "--cascade-on", str(tmp_path / "first.json"), "--sve", str(sve_file),
                 "--sve-answer-tokens", "0", "--out", str(tmp_path / "second.json")]) == 0
    res = json.loads(capsys.readouterr().out)
    second = Calibrator.load(tmp_path / "second.json")
    assert second.features == ("first_stage_logit", "sve_mean_prob", "sve_variance", "sve_mi")
    assert second.cascade_ is not None and second.cascade_["first_stage_sha256"] == first.sha256
    assert second.cascade_["band_lower"] == first.threshold_for(0.6) and second.cascade_["band_share"] <= 1 / 3
    assert res["band"]["upper"] == second.cascade_["band_upper"]
    assert res["test"]["cascade"]["coverage"] >= res["test"]["first stage"]["coverage"]
    assert 0 < res["test"]["paid_second_opinion"] < 0.6

    policy = tmp_path / "cascade.yaml"
    policy.write_text(
        "name: c\nversion: '1'\ncalibrator: first.json\nsecond_calibrator: second.json\nalpha: 0.6\nrules:\n"
        "  - {name: ok, when: {risk: {le: threshold}}, action: allow}\n"
        "  - name: band\n    when: {risk: {gt: threshold, le: band}}\n    action: second_opinion\n"
        "    rules:\n      - {name: confirmed, when: {so.risk: {le: so.threshold}}, action: allow}\n"
        "      - {name: refused, action: abstain}\n"
        "  - {name: risky, action: abstain}\n")
    status = main(["policy", "check", str(policy)])
    out = capsys.readouterr().out
    assert f"band = {second.cascade_['band_upper']:g}" in out
    t2 = second.threshold_for(0.6)
    assert (f"so.threshold = {t2:g}" in out) if t2 is not None else ("no certified so.threshold" in out)
    assert status == 0


def test_decider_loads_the_second_stage_the_policy_names_and_refuses_another_models(
    stages: tuple[Calibrator, Calibrator], tmp_path: Path,
) -> None:
    import yaml

    from guarduq.decider import Binding, Decider
    from guarduq.errors import FingerprintMismatchError

    first, second = stages
    first.model_fingerprint = second.model_fingerprint = "a" * 32
    policy = _policy(tmp_path, first, second)  # saves both files beside the policy
    path = tmp_path / "cascade.yaml"
    path.write_text(yaml.safe_dump(policy.config.model_dump(mode="json", by_alias=True, exclude_none=True)))
    model = SimpleNamespace(name="m", fingerprint="a" * 32)
    decider = Decider.load(path, None, model, Binding(second_opinion=lambda p, r: None))  # type: ignore[arg-type]
    assert decider.policy is not None and decider.policy.band_upper == band_of(second).upper
    assert tmp_path / "second.json" in decider.files()  # a reload (serve --watch) re-reads it
    second.model_fingerprint = "b" * 32
    second.save(tmp_path / "second.json")
    with pytest.raises(FingerprintMismatchError):
        decider.reloaded(model)  # type: ignore[arg-type]


def test_policy_refuses_a_second_stage_reading_what_serving_does_not_give(
    stages: tuple[Calibrator, Calibrator], tmp_path: Path,
) -> None:
    """sve_agree needs the members' greedy answer, which the policy never asks for: such a second
    stage would score every band answer as invalid (risk 1.0), so it is refused at bind."""
    first, second = stages
    pol = _policy(tmp_path, first, second)
    agree = Calibrator(("first_stage_logit", "sve_mean_prob", "sve_agree"), C=1.0)
    agree.cascade_ = second.cascade_
    with pytest.raises(PolicyError, match="sve_agree"):
        pol.bind(second_opinion=lambda p, r: None, calibrator=Calibrator.load(tmp_path / "first.json"),
                 second_calibrator=agree)
