"""policies/cascade.yaml on the real SmolLM2: the shipped calibrator, the shipped SVE
(`make sve`) and the shipped second stage (`make cascade-calibrator`) bind together, and an answer
in the band is decided by the second stage's certified threshold, not by hand-set numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from guarduq import Guard
from guarduq.calibration import Calibrator
from guarduq.models import LoadedModel
from guarduq.policy import Policy
from guarduq.sve import SVEnsemble

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CASCADE = REPO / "policies/cascade.yaml"
SVE_FILE = REPO / "policies/sve/smollm2-135m-instruct.safetensors"


@pytest.fixture(scope="module")
def cascade_guard(real_guard: Guard) -> Guard:
    policy = Policy.from_yaml(CASCADE)
    for path in (policy.calibrator_path, policy.second_calibrator_path, SVE_FILE):
        if path is None or not path.is_file():
            pytest.skip(f"{path} is absent (make calibrator / make sve / make cascade-calibrator)")
    loaded = LoadedModel(real_guard.model, real_guard.tokenizer, real_guard.info)
    # its second stage certifies nothing on SmolLM2 (the policy's comment): taken knowingly
    return Guard(loaded, policy=CASCADE, second_opinion=SVEnsemble.load(SVE_FILE, loaded), allow_uncertified=True)


def test_shipped_cascade_binds_certified_numbers(cascade_guard: Guard) -> None:
    policy = cascade_guard.policy
    assert policy is not None
    second = Calibrator.load(policy.second_calibrator_path)
    stage = second.cascade_
    assert stage is not None and stage["alpha"] == policy.alpha
    assert stage["first_stage_sha256"] == cascade_guard.calibrator.sha256
    assert policy.band_upper == stage["band_upper"] and stage["band_lower"] == policy.risk_threshold
    assert policy.second_threshold == second.threshold_for(policy.alpha)


@pytest.mark.parametrize(("prompt", "response"), [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Who was the first person to walk on Mars?", "Neil Armstrong walked on Mars in 1969."),
])
def test_an_answer_in_the_band_is_decided_by_the_second_stage(
    cascade_guard: Guard, prompt: str, response: str,
) -> None:
    """Every first-stage risk in the band asks the real SVE, whose opinion the second stage turns
    into so.risk; the answer is shown exactly when so.risk <= the certified so.threshold."""
    policy = cascade_guard.policy
    assert policy is not None and policy.risk_threshold is not None and policy.band_upper is not None
    second = Calibrator.load(policy.second_calibrator_path)
    inside = (policy.risk_threshold + policy.band_upper) / 2
    decision = policy.decide({"risk": inside}, prompt=prompt, response=response)
    so = decision.second_opinion
    assert so is not None and decision.rule is not None and decision.rule.startswith("borderline/")
    expected = second.risk({"first_risk": inside, "sve_mean_prob": so.mean_prob, "sve_variance": so.variance,
                            "sve_mi": so.mutual_information})
    assert f"risk={expected:.4g}" in decision.explanation
    t2 = policy.second_threshold
    assert (decision.action == "allow") == (t2 is not None and expected <= t2)
    above = policy.decide({"risk": min(policy.band_upper + 0.01, 1.0)}, prompt=prompt, response=response)
    assert above.second_opinion is None and above.action == "abstain"  # no second opinion is paid for


def test_guarded_answers_pay_for_the_second_opinion_only_in_the_band(cascade_guard: Guard) -> None:
    result = cascade_guard.guarded("What is the capital of France?", "The capital of France is Paris.")
    d, policy = result.decision, cascade_guard.policy
    assert d is not None and policy is not None and d.risk is not None
    in_band = policy.risk_threshold is not None and policy.risk_threshold < d.risk <= policy.band_upper
    assert (d.second_opinion is not None) == in_band
