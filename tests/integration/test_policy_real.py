"""policies/default.yaml on the real SmolLM2 with its shipped calibrator: real allow and abstain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from guarduq import Guard
from guarduq.models import LoadedModel
from guarduq.policy import Policy

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEFAULT_POLICY = REPO / "policies/default.yaml"
CALIBRATOR = Policy.from_yaml(DEFAULT_POLICY).calibrator_path

# Teacher-forced pairs, from a plainly right answer to plainly wrong or evasive ones: the
# calibrated risk should spread over them enough that the default policy both allows and abstains.
PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the boiling point of water at sea level in Celsius?", "Water boils at 100 degrees Celsius."),
    ("What is the capital of France?", "Purple elephants sing loudly under the frozen toaster."),
    ("Who was the first person to walk on Mars?", "Neil Armstrong walked on Mars in 1969."),
    ("What did I eat for breakfast yesterday?", "You ate exactly 17 pancakes with blue syrup."),
]


@pytest.fixture(scope="module")
def policy_guard(real_guard, tmp_path_factory) -> Guard:
    if not CALIBRATOR.is_file():
        pytest.skip(f"shipped calibrator {CALIBRATOR.relative_to(REPO)} is absent (run `make calibrator`)")
    loaded = LoadedModel(real_guard.model, real_guard.tokenizer, real_guard.info)
    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    return Guard(loaded, policy=DEFAULT_POLICY, audit=audit)


def test_default_policy_allows_and_abstains_on_real_answers(policy_guard):
    # default.yaml allows when calibrated risk <= a bound (read from the file, not from the code):
    # a number, or `threshold`, the risk threshold the calibrator certified for the policy's alpha
    rule = yaml.safe_load(DEFAULT_POLICY.read_text())["rules"][0]
    assert rule["action"] == "allow"
    bound = rule["when"]["risk"]["le"]
    if bound == "threshold":
        threshold = policy_guard.policy.risk_threshold
        assert threshold == policy_guard.calibrator.threshold_for(policy_guard.policy.alpha)
        assert threshold is not None, "the default policy's alpha has no certified threshold"
    else:
        threshold = float(bound)
    results = [policy_guard.guarded(p, r) for p, r in PAIRS]
    for res in results:
        d = res.decision
        assert d.action == ("allow" if res.risk <= threshold else "abstain"), d.explanation
        assert d.text == (res.text if d.action == "allow" else d.text)
        assert d.shown == (d.action == "allow")
    actions = {res.decision.action for res in results}
    assert actions == {"allow", "abstain"}, [(r.text, r.risk) for r in results]
    # the audit log has one line per call, in order, with no raw text
    lines = [json.loads(x) for x in policy_guard.audit.path.read_text().splitlines()]
    assert [x["request_id"] for x in lines] == [r.request_id for r in results]
    assert all("prompt" not in x and "response" not in x for x in lines)
