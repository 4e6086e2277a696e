"""Certificates per kind of traffic and drift that acts: a group with labels gets its own
threshold, one without falls back as the policy says, and an `unseen` drift window applies the
policy's drift action to every reply (decision, audit line, store row, review sample)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from guarduq.calibration.groups import accepted_error, certify_groups
from guarduq.calibration.thresholds import Threshold, select_threshold
from guarduq.errors import PolicyError
from guarduq.policy import Policy, in_force, traffic_group
from guarduq.policy.context import current_group, group_of

ALPHA, DELTA = 0.3, 0.1


def traffic(rng: np.random.Generator, n: int, base: float, slope: float) -> tuple[np.ndarray, np.ndarray]:
    """Risks uniform on [0, 1]; P(wrong | risk) = base + slope * risk (capped at 1)."""
    risk = rng.uniform(0, 1, n)
    wrong = (rng.uniform(0, 1, n) < np.minimum(1.0, base + slope * risk)).astype(int)
    return risk, wrong


def test_two_groups_with_labels_get_two_certificates_that_hold_where_the_pooled_one_fails() -> None:
    rng = np.random.default_rng(0)
    # easy: few errors at any risk; hard: many errors even at low risk; tiny: 12 labels only
    easy, hard, tiny = traffic(rng, 1500, 0.02, 0.3), traffic(rng, 1500, 0.1, 0.8), traffic(rng, 12, 0.02, 0.3)
    risk = np.concatenate([easy[0], hard[0], tiny[0]])
    wrong = np.concatenate([easy[1], hard[1], tiny[1]])
    groups = ["easy"] * 1500 + ["hard"] * 1500 + ["tiny"] * 12
    table = certify_groups(risk, wrong, groups, [ALPHA], DELTA)
    assert set(table) == {"easy", "hard", "tiny"}
    (t_easy,), (t_hard,), (t_tiny,) = table["easy"], table["hard"], table["tiny"]
    assert t_easy.threshold is not None and t_hard.threshold is not None  # two certificates
    assert t_tiny.threshold is None and t_tiny.n == 12  # too few labels: falls back
    assert t_hard.threshold < t_easy.threshold  # the harder group is held to a stricter risk
    pooled = select_threshold(risk, wrong, ALPHA, DELTA).threshold
    assert pooled is not None
    # on fresh traffic of each group: the pooled certificate fails inside "hard"; each group's holds
    fresh_easy, fresh_hard = traffic(rng, 20_000, 0.02, 0.3), traffic(rng, 20_000, 0.1, 0.8)
    assert accepted_error(*fresh_hard, pooled)["error_rate"] > ALPHA
    assert accepted_error(*fresh_hard, t_hard.threshold)["error_rate"] <= ALPHA
    assert accepted_error(*fresh_easy, t_easy.threshold)["error_rate"] <= ALPHA
    assert accepted_error(*fresh_easy, None) == {"n": 20_000, "accepted": 0, "coverage": 0.0, "errors": 0,
                                                 "error_rate": None}


def _threshold(value: float | None) -> Threshold:
    return Threshold(ALPHA, DELTA, value, 0.5, 100, 50, 5, 0.1, 0.2, None if value is not None else "not met")


CAL = SimpleNamespace(thresholds_=[_threshold(0.5)],
                      group_thresholds_={"legal": [_threshold(0.2)], "support": [_threshold(None)]})

POLICY = {
    "name": "p", "version": "1", "alpha": ALPHA, "calibrator": "cal.json",
    "sinks": {"humans": {"type": "jsonl", "path": "esc.jsonl"}},
    "rules": [{"name": "ok", "when": {"risk": {"le": "threshold"}}, "action": "allow"},
              {"name": "no", "action": "abstain", "message": "Risk {risk:.0%}."}],
}


def policy(**extra: Any) -> Policy:
    return Policy.from_dict({**POLICY, **extra}, base_dir=Path("."))


def test_a_group_with_its_own_certificate_is_decided_with_it_and_others_fall_back() -> None:
    p = policy(groups={"fallback": "escalate"})
    own = in_force(p, CAL, "legal", None)
    assert (own.certificate, own.threshold, own.rule) == ("group", 0.2, None)
    assert own.signals() == {"risk_threshold": 0.2}
    d = p.decide({"risk": 0.3, **own.signals()})  # allowed under the pooled 0.5, not under legal's 0.2
    assert d.action == "abstain" and d.threshold == 0.2
    for g in ("support", "never-seen"):  # uncertified at alpha, or never calibrated
        fb = in_force(p, CAL, g, None)
        assert fb.certificate == "override" and fb.rule is not None and fb.rule.action == "escalate"
        d = p.decide({"risk": 0.01, "risk_threshold": 0.5}, override=fb.rule, override_reason=fb.reason)
        assert d.action == "escalate" and not d.shown and "%" not in d.text  # no risk quoted as the reason
        assert d.escalation is None and "no certificate of its own" in d.explanation
    pooled = in_force(p, CAL, None, None)
    assert (pooled.certificate, pooled.rule, pooled.signals()) == ("pooled", None, {})
    # the default fallback: the pooled threshold
    assert in_force(policy(), CAL, "support", None).certificate == "pooled"
    # where a request's group comes from
    assert group_of(p, "legal") is None  # the policy does not trust clients to name it
    assert group_of(policy(groups={"default": "web"}), None) == "web"
    assert group_of(p, None) is None


def test_drift_cases_act_as_the_policy_says() -> None:
    p = policy(on_drift={"unseen": {"action": "escalate", "sink": "humans", "review_rate": 1.0},
                         "slice": {"review_rate": 0.5}})
    unseen = in_force(p, CAL, None, "unseen")
    assert unseen.rule is not None and unseen.rule.sink == "humans" and unseen.review_rate == 1.0
    assert in_force(p, CAL, "legal", "unseen").certificate == "override"  # drift beats a group's own
    sliced = in_force(p, CAL, None, "slice:arc")  # arc has no certificate of its own
    assert sliced.rule is None and sliced.review_rate == 0.5 and sliced.certificate == "pooled"
    own_slice = in_force(p, CAL, None, "slice:legal")  # a slice that has its own: nothing to do
    assert own_slice.review_rate == 0.0 and own_slice.reason is None
    ok = in_force(p, CAL, None, "ok")
    assert ok.rule is None and ok.review_rate == 0.0
    assert in_force(policy(), CAL, None, "unseen").rule is None  # no on_drift: decisions unchanged
    with pytest.raises(PolicyError, match="sink 'nowhere' is not declared"):
        policy(on_drift={"unseen": {"action": "escalate", "sink": "nowhere"}})
    with pytest.raises(PolicyError, match="escalate"):
        policy(groups={"fallback": {"action": "abstain", "sink": "humans"}})


def test_the_group_is_set_around_a_call_and_checked() -> None:
    assert current_group() is None
    with traffic_group("legal"):
        assert current_group() == "legal"
    assert current_group() is None
    for bad in ("", "x" * 65, 3):
        with pytest.raises(PolicyError, match="traffic group"), traffic_group(bad):  # type: ignore[arg-type]
            pass


class FakeDrift:
    """A drift monitor stuck on one case (the Guard reads ``case()`` only)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def case(self) -> Any:
        return SimpleNamespace(label=self.label)


def built_guard(tmp_path: Path) -> tuple[Any, Any, Path]:
    """A tiny-model Guard whose calibrator certifies ``legal`` (threshold 0: nothing accepted) and
    not ``support``; its policy escalates unseen drift (review rate 1) and uncertified groups."""
    pytest.importorskip("sqlalchemy")
    from guarduq import Guard
    from guarduq.models import fingerprint
    from guarduq.store import Store
    from tests.conftest import make_tokenizer, tiny_llama
    from tests.unit.test_reload import fitted_calibrator_doc

    model = tiny_llama()
    doc = fitted_calibrator_doc(fingerprint(model))
    doc["thresholds"] = [asdict(_threshold(1.0))]  # the pooled rule allows everything
    doc["group_thresholds"] = {"legal": [asdict(_threshold(0.0))], "support": [asdict(_threshold(None))]}
    (tmp_path / "cal.json").write_text(json.dumps(doc))
    text = {**POLICY, "review": {"keep_text": True, "rate": 0.0, "escalations": False},
            "on_drift": {"unseen": {"action": "escalate", "review_rate": 1.0}},
            "groups": {"fallback": "escalate", "from_metadata": True}}
    (tmp_path / "p.yaml").write_text(json.dumps(text))
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    audit = tmp_path / "audit.jsonl"
    guard = Guard((model, make_tokenizer()), policy=tmp_path / "p.yaml", store=store, audit=audit,
                  max_new_tokens=4)
    return guard, store, audit


def test_an_unseen_window_escalates_every_reply_and_says_so_in_reply_audit_and_store(tmp_path: Path) -> None:
    from tests.unit.serve_helpers import varied

    guard, store, audit = built_guard(tmp_path)
    kw = varied(guard.tokenizer)
    calm = guard.generate("hello", **kw)
    assert calm.decision is not None and calm.decision.action == "allow"
    guard.drift = FakeDrift("unseen")
    drifting = [guard.generate(p, **kw) for p in ("hello", "what is 2+2?", "tell me")]
    assert all(r.decision is not None and r.decision.action == "escalate" for r in drifting)  # 100%
    assert all(r.metadata()["in_force"]["drift"] == "unseen" for r in drifting)
    guard.drift = FakeDrift("ok")
    with traffic_group("legal"):
        legal = guard.generate("hello", **kw)  # its own threshold (0.0) accepts nothing
    with traffic_group("support"):
        support = guard.generate("hello", **kw)  # no certificate of its own: escalated
    assert legal.decision is not None and legal.decision.action == "abstain" and legal.decision.threshold == 0.0
    assert support.decision is not None and support.decision.action == "escalate"
    assert guard.traffic is not None and guard.traffic.flush()
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [x["in_force"]["drift"] for x in lines] == [None, "unseen", "unseen", "unseen", "ok", "ok"]
    assert [x["in_force"]["group"] for x in lines][-2:] == ["legal", "support"]
    for r in drifting:  # stored with the case, and every one sampled for review by the drift rate
        item = store.item(r.request_id)
        assert item is not None and item.reply.drift == "unseen" and "drift" in item.sample.reasons
    assert store.reply(calm.request_id).drift is None  # type: ignore[union-attr]
    assert store.item(calm.request_id) is None  # rate 0: the calm reply was not sampled
    assert store.reply(legal.request_id).group == "legal"  # type: ignore[union-attr]
    store.close()


def test_serve_takes_the_group_from_metadata_and_every_reply_says_what_was_in_force(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from tests.unit.serve_helpers import body
    from tests.unit.test_serve import client_for

    guard, store, _ = built_guard(tmp_path)
    with client_for(guard, guard.tokenizer) as c:
        support = c.post("/v1/chat/completions", json=body(metadata={"group": "support"})).json()["guarduq"]
        legal = c.post("/v1/chat/completions", json=body(metadata={"group": "legal"})).json()["guarduq"]
        plain = c.post("/v1/chat/completions", json=body()).json()["guarduq"]
        bad = c.post("/v1/chat/completions", json=body(metadata={"group": "x" * 65}))
    assert support["in_force"]["group"] == "support" and support["decision"]["action"] == "escalate"
    assert legal["in_force"]["certificate"] == "group" and legal["decision"]["threshold"] == 0.0
    assert plain["in_force"]["group"] is None and plain["in_force"]["certificate"] == "pooled"
    assert plain["decision"]["action"] == "allow"
    assert bad.status_code == 400 and "metadata.group" in bad.text
    store.close()


def _scores(centre: tuple[float, float, float], n: int, rng: np.random.Generator, group: str = "") -> list[dict]:
    le, al, lp = centre
    return [{"dataset": group, "epistemic": float(np.exp(rng.normal(le, 0.5))),
             "aleatoric": float(np.clip(rng.normal(al, 0.03), 0, 0.25)), "mean_logprob": float(rng.normal(lp, 0.3)),
             "valid": True} for _ in range(n)]


def test_drift_action_covers_every_unseen_reply_and_few_in_distribution_ones() -> None:
    """A live stream through the monitor, as the Guard reads it: SST-2-style traffic (like no
    calibration group) is escalated once the window fills, every reply; a held-out slice of the
    mix is named and, certified, left to the rules; in-distribution traffic rarely triggers it."""
    from guarduq.calibration.drift import DriftMonitor, Reference
    from guarduq.calibration.drift_groups import group_reference

    centres = {"arc": (0.0, 0.10, -1.0), "boolq": (1.5, 0.05, -0.3), "nq-open": (-1.5, 0.15, -2.0)}
    rng = np.random.default_rng(0)
    recs = [r for g, c in centres.items() for r in _scores(c, 300, rng, g)]
    features = ("log_epistemic", "aleatoric", "mean_logprob")
    grouped = group_reference(recs, features, "synthetic")
    ref = Reference({f: grouped.sample()[f] for f in features}, "synthetic", grouped)
    p = policy(on_drift={"unseen": {"action": "escalate", "review_rate": 1.0}, "slice": {"action": "abstain"}})
    cal = SimpleNamespace(group_thresholds_={"arc": [_threshold(0.5)]})

    def stream(traffic: list[dict]) -> list[Any]:
        mon = DriftMonitor(ref, window=100, min_n=50, case_every=1)
        out = []
        for s in traffic:
            case = mon.case()
            out.append(in_force(p, cal, None, case.label if case is not None else None))
            mon.observe(s)
        return out

    sst2 = stream(_scores((3.0, 0.22, -4.0), 300, rng))  # like no group
    after = sst2[51:]  # once the window holds min_n replies
    assert all(c.drift == "unseen" and c.rule is not None and c.rule.action == "escalate" for c in after)
    assert all(c.review_rate == 1.0 for c in after)
    held_out = stream(_scores(centres["arc"], 300, rng))  # one calibration group alone: a slice
    named = [c for c in held_out[60:] if c.drift == "slice:arc"]
    assert len(named) >= 0.8 * len(held_out[60:])  # the slice is named (a window may cross its threshold)
    assert all(c.rule is None for c in named)  # arc has its own certificate: the rules decide
    assert sum(c.rule is not None for c in held_out) <= 0.1 * len(held_out)
    boolq_slice = stream(_scores(centres["boolq"], 300, rng))
    acting = [c for c in boolq_slice[60:] if c.drift == "slice:boolq"]
    assert len(acting) >= 0.8 * len(boolq_slice[60:])
    assert all(c.rule is not None and c.rule.action == "abstain" for c in acting)  # an uncertified slice
    mixed = [r for _ in range(100) for g in centres for r in _scores(centres[g], 1, rng)]
    acted = [c for c in stream(mixed) if c.rule is not None]
    assert len(acted) / len(mixed) <= 0.1  # in-distribution: the drift action rarely fires


def test_a_client_names_its_group_only_where_the_policy_trusts_it() -> None:
    """A client that may name its group may name the loosest certificate: off unless opted in."""
    closed = policy(groups={"default": "support"})
    assert group_of(closed, "legal") == "support" and group_of(closed) == "support"
    assert group_of(policy(groups={}), "legal") is None  # pooled
    trusting = policy(groups={"default": "support", "from_metadata": True})
    assert group_of(trusting, "legal") == "legal" and group_of(trusting) == "support"
    with pytest.raises(PolicyError):
        group_of(trusting, "x" * 65)
