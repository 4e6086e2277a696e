"""Guard + policy: score -> calibrate -> decide -> audit on a tiny model with a real calibrator."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from guarduq import Guard
from guarduq.calibration import Calibrator
from guarduq.decider import calibrated_signals as calibrate
from guarduq.errors import FingerprintMismatchError, GuardUQAbstention, PolicyError, ScoringError
from guarduq.policy.audit import AuditLog

PROMPT, RESPONSE = "Name a colour.", "Blue"


@pytest.fixture
def guard(llama, tokenizer) -> Guard:
    return Guard((llama, tokenizer), max_new_tokens=4)


@pytest.fixture
def calibrator_path(guard: Guard, tmp_path: Path) -> Path:
    """A calibrator fitted on synthetic scores centred on this model's own epistemic value,
    so the risk of RESPONSE lands inside (0, 1) rather than at an extreme."""
    e0 = guard.score(PROMPT, RESPONSE).epistemic
    rng = np.random.default_rng(0)
    log_e = math.log(e0) + rng.normal(0, 1, 600)
    wrong = rng.random(600) < 1 / (1 + np.exp(-2 * (log_e - math.log(e0))))
    scores = [{"epistemic": math.exp(v), "aleatoric": float(a), "valid": True}
              for v, a in zip(log_e, rng.uniform(0, 0.25, 600), strict=True)]
    cal = Calibrator("paper", model_name="tiny", model_fingerprint=guard.info.fingerprint)
    cal.fit(scores[:300], (~wrong[:300]).astype(int))
    cal.fit_thresholds(scores[300:], (~wrong[300:]).astype(int), alphas=(0.3,), delta=0.1)
    path = tmp_path / "cal.json"
    cal.save(path)
    return path


def write_policy(tmp_path: Path, rules: str, extra: str = "") -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(f"name: t\nversion: 2\ncalibrator: cal.json\nalpha: 0.3\n{extra}rules:\n{rules}")
    return path


def risk_band_rules(bound: float) -> str:
    return (f"  - name: ok\n    when: {{risk: {{le: {bound}}}}}\n    action: allow\n"
            "  - name: unsure\n    action: abstain\n    message: 'Not sure (risk {risk:.2f}).'\n")


def test_risk_and_decision_follow_the_calibrator(guard, calibrator_path, tmp_path, llama, tokenizer):
    cal = Calibrator.load(calibrator_path)
    expected = cal.risk(guard.score(PROMPT, RESPONSE))
    assert 0.01 < expected < 0.99
    above = Guard((llama, tokenizer), policy=write_policy(tmp_path, risk_band_rules(expected + 0.005)))
    r = above.guarded(PROMPT, RESPONSE)
    assert r.risk == pytest.approx(expected, abs=1e-12)
    assert (r.decision.action, r.decision.text, r.decision.rule) == ("allow", RESPONSE, "ok")
    below = Guard((llama, tokenizer), policy=write_policy(tmp_path, risk_band_rules(expected - 0.005)))
    d = below.guarded(PROMPT, RESPONSE).decision
    assert (d.action, d.shown, d.rule) == ("abstain", False, "unsure")
    assert d.text == f"Not sure (risk {expected:.2f})."
    assert f"risk={expected:.4g} le {expected - 0.005:.4g}: no" in d.explanation


def test_threshold_comes_from_alpha(guard, calibrator_path, tmp_path, llama, tokenizer):
    rules = "  - name: ok\n    when: {risk: {le: threshold}}\n    action: allow\n  - {name: rest, action: abstain}\n"
    g = Guard((llama, tokenizer), policy=write_policy(tmp_path, rules))
    cal = Calibrator.load(calibrator_path)
    assert g.policy.risk_threshold == cal.threshold_for(0.3) is not None
    r = g.guarded(PROMPT, RESPONSE)
    assert r.decision.threshold == cal.threshold_for(0.3)
    assert r.decision.action == ("allow" if r.risk <= cal.threshold_for(0.3) else "abstain")


def test_z_scores_use_the_calibrators_scaler(guard, calibrator_path):
    cal = Calibrator.load(calibrator_path)
    scores = guard.score(PROMPT, RESPONSE)
    scaler = cal.pipeline_.named_steps["scale"]
    got = calibrate(cal, scores)
    assert got["epistemic_z"] == pytest.approx((math.log(scores.epistemic) - scaler.mean_[0]) / scaler.scale_[0])
    assert got["aleatoric_z"] == pytest.approx((scores.aleatoric - scaler.mean_[1]) / scaler.scale_[1])
    assert calibrate(None, scores) == {}


def test_generate_carries_a_decision_and_writes_the_audit_line(calibrator_path, tmp_path, llama, tokenizer):
    audit = tmp_path / "audit.jsonl"
    policy = write_policy(tmp_path, risk_band_rules(0.5))
    g = Guard((llama, tokenizer), policy=policy, audit=audit, max_new_tokens=4)
    r = g.generate(PROMPT, suppress_tokens=tokenizer.convert_tokens_to_ids(["Ġ", "Ċ", "ĉ", "č"]))
    assert r.decision is not None and r.decision.action in ("allow", "abstain")
    (line,) = [json.loads(x) for x in audit.read_text().splitlines()]
    assert line["request_id"] == r.request_id and line["model_fingerprint"] == g.info.fingerprint
    assert line["policy"] == {"name": "t", "version": "2",
                              "sha256": hashlib.sha256(policy.read_bytes()).hexdigest()}
    assert line["calibrator_sha256"] == hashlib.sha256(calibrator_path.read_bytes()).hexdigest()
    assert line["risk"] == pytest.approx(r.risk) and line["action"] == r.decision.action
    assert line["scores"]["epistemic"] == pytest.approx(r.scores.epistemic)
    assert line["response_sha256"] == hashlib.sha256(r.text.encode()).hexdigest()
    assert "response" not in line and "prompt" not in line
    assert r.to_dict()["decision"]["rule"] == r.decision.rule


def test_scoring_failure_fails_closed_with_a_policy(calibrator_path, tmp_path, llama, tokenizer, monkeypatch):
    audit = AuditLog(tmp_path / "audit.jsonl")
    g = Guard((llama, tokenizer), policy=write_policy(tmp_path, risk_band_rules(1.0)), audit=audit)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(g.scorer, "score", broken)
    r = g.guarded(PROMPT, RESPONSE)
    assert (r.decision.action, r.decision.shown, r.decision.rule) == ("abstain", False, "on_error")
    assert "simulated kernel failure" in r.decision.errors[0] and not r.scores.valid
    assert r.risk == 1.0  # the calibrator fails closed on invalid scores too
    line = json.loads((tmp_path / "audit.jsonl").read_text())
    assert line["action"] == "abstain" and "simulated kernel failure" in line["errors"][0]


def test_without_a_policy_the_core_behaviour_is_unchanged(guard, monkeypatch):
    monkeypatch.setattr(guard.scorer, "score", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(ScoringError):
        guard.guarded(PROMPT, RESPONSE)
    monkeypatch.undo()
    r = guard.guarded(PROMPT, RESPONSE)
    assert r.decision is None and r.risk is None and "decision" not in r.to_dict()


def test_raise_on_abstain(calibrator_path, tmp_path, llama, tokenizer):
    g = Guard((llama, tokenizer), policy=write_policy(tmp_path, risk_band_rules(-1.0)), raise_on_abstain=True)
    with pytest.raises(GuardUQAbstention) as err:
        g.guarded(PROMPT, RESPONSE)
    assert err.value.decision.action == "abstain" and str(err.value).startswith("Not sure")


def test_construction_refuses_mismatches(calibrator_path, tmp_path, llama, tokenizer):
    so_rules = ("  - name: so\n    action: second_opinion\n    rules:\n"
                "      - name: a\n        when: {so.mean_prob: {gt: 0.5}}\n        action: allow\n")
    with pytest.raises(PolicyError, match="no second-opinion provider"):
        Guard((llama, tokenizer), policy=write_policy(tmp_path, so_rules))
    ens = SimpleNamespace(second_opinion=lambda p, r: SimpleNamespace(
        mean_prob=0.9, variance=0.0, mutual_information=0.0, agrees=None))
    g = Guard((llama, tokenizer), policy=write_policy(tmp_path, so_rules), second_opinion=ens)
    assert g.guarded(PROMPT, RESPONSE).decision.rule == "so/a"
    with pytest.raises(PolicyError, match="is for model 'other-model'"):
        Guard((llama, tokenizer), policy=write_policy(tmp_path, risk_band_rules(1), "model: other-model\n"))
    Guard((llama, tokenizer), policy=write_policy(tmp_path, risk_band_rules(1), "model: tiny\n"))
    other = tmp_path / "other.json"
    doc = json.loads(calibrator_path.read_text())
    doc["model"]["fingerprint"] = "0" * 64
    other.write_text(json.dumps(doc))
    with pytest.raises(FingerprintMismatchError):
        Guard((llama, tokenizer), policy=write_policy(tmp_path, risk_band_rules(1)), calibrator=other)


def test_a_policy_whose_calibrator_is_another_models_names_both_and_the_right_file(
        calibrator_path, tmp_path, llama, tokenizer):
    """What a user bringing their own model hits first: the message names the policy, both models,
    and the calibrator fitted for this model where one sits beside the foreign one."""
    doc = json.loads(calibrator_path.read_text())
    doc["model"] = {"name": "qwen2.5-coder-1.5b-instruct", "fingerprint": "0" * 32}
    (tmp_path / "cals").mkdir()
    foreign = tmp_path / "cals" / "qwen2.5-coder-1.5b-instruct.json"
    foreign.write_text(json.dumps(doc))
    policy = write_policy(tmp_path, risk_band_rules(1)).read_text()
    path = tmp_path / "qwen.yaml"
    path.write_text(re.sub(r"calibrator: .*", f"calibrator: {foreign}", policy))
    name = Guard((llama, tokenizer)).info.name
    with pytest.raises(FingerprintMismatchError) as err:
        Guard((llama, tokenizer), policy=path)
    msg = str(err.value)
    assert "qwen.yaml" in msg and "fitted for model 'qwen2.5-coder-1.5b-instruct'" in msg
    assert f"not for model '{name}'" in msg and "pass " not in msg  # none fitted for it beside the other
    assert "guarduq calibrate --model" in msg and "guarduq policy init" in msg  # how to get one
    (tmp_path / "cals" / f"{name}.json").write_text(calibrator_path.read_text())
    with pytest.raises(FingerprintMismatchError) as err:
        Guard((llama, tokenizer), policy=path)
    assert f"pass {tmp_path / 'cals' / name}.json, fitted for it" in str(err.value)
    assert "its policy" not in str(err.value)
    (tmp_path / f"{name}.yaml").write_text(policy)  # the shipped layout: policies/<model>.yaml
    with pytest.raises(FingerprintMismatchError) as err:
        Guard((llama, tokenizer), policy=path)
    assert f"(its policy: {tmp_path / name}.yaml)" in str(err.value)


def test_cli_policy_explain(calibrator_path, tmp_path, llama, tokenizer, capsys):
    from guarduq.cli import main

    folder = tmp_path / "tiny-model"
    llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    policy = write_policy(tmp_path, risk_band_rules(1.0))
    argv = ["policy", "explain", str(policy), "--model", str(folder), "--prompt", PROMPT,
            "--response", RESPONSE]
    assert main([*argv, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["response"] == RESPONSE and row["decision"]["action"] == "allow"
    assert row["decision"]["rule"] == "ok" and "risk=" in row["decision"]["explanation"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "action   : allow" in out and "match ok: risk=" in out


def test_the_sve_result_type_is_accepted_as_a_second_opinion():
    from guarduq.policy import SecondOpinion
    from guarduq.sve import SVEOpinion

    opinion = SVEOpinion(member_mean_probs=[0.5, 0.7], mean_prob=0.6, variance=0.01,
                         mutual_information=0.02, agrees=None)
    assert SecondOpinion.coerce(opinion) == SecondOpinion(0.6, 0.01, 0.02, None, (0.5, 0.7))


def test_an_alias_none_ships_for_is_told_the_make_target_that_fits_one(tmp_path):
    """A scale model's user, on the default policy: where no calibrator sits beside the foreign
    one, the alias's own target that fits one (and writes its policy) is named."""
    from guarduq.calibration._artifact import fitted_for

    shipped = tmp_path / "calibrators" / "smollm2-135m-instruct.json"
    hint = fitted_for(shipped, "qwen2.5-coder-1.5b-instruct")
    assert "`make calibrator-qwen-1.5b`" in hint and "policies/qwen2.5-coder-1.5b-instruct.yaml" in hint
    assert fitted_for(shipped, "my-own-model") == ""  # not an alias: the generic advice applies
    (tmp_path / "calibrators").mkdir()
    (tmp_path / "calibrators" / "qwen2.5-coder-1.5b-instruct.json").write_text("{}")
    assert fitted_for(shipped, "qwen2.5-coder-1.5b-instruct").startswith("pass ")  # one sits there now
