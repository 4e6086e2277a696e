"""A risk model per traffic group (``Calibrator(per_group=True)``): each group's model ranks its
own traffic where a pooled fit is misled by differences between groups, requests without a
modelled group get exactly the pooled risk, the certificate is taken on the risk as served, and
the artifact, the decider and a Guard inside ``traffic_group`` all serve the group's model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from guarduq.calibration import Calibrator
from guarduq.calibration.analysis import bootstrap_auroc
from guarduq.calibration.group_models import MIN_GROUP_FIT
from guarduq.calibration.groups import certify_groups, group_starts
from guarduq.calibration.thresholds import select_threshold
from guarduq.decider import calibrated_signals
from guarduq.errors import ArtifactError, CalibrationError
from guarduq.policy.context import risk_group

FEATURES = "likelihood"


def confounded(n: int, seed: int, groups: dict[str, tuple[float, float]] | None = None
               ) -> tuple[list[dict[str, Any]], np.ndarray, list[str]]:
    """Groups whose error rates differ and whose worse groups' answers look *more* likely (a pooled
    fit's Simpson's paradox); inside each group a lower log p̄ means a likelier wrong answer."""
    rng = np.random.default_rng(seed)
    scores, labels, names = [], [], []
    for name, (base, shift) in (groups or {"easy": (-1.1, -1.0), "mid": (0.0, 0.0), "hard": (1.7, 1.0)}).items():
        for _ in range(n):
            z = rng.normal()
            wrong = rng.uniform() < 1 / (1 + math.exp(-(base - 1.5 * z)))
            lp = -1.0 + 0.3 * z + shift
            scores.append({"mean_logprob": lp, "min_token_prob": math.exp(lp) / 2, "n_tokens": int(rng.integers(1, 30)),
                           "mean_entropy": float(rng.uniform(0, 3)), "valid": True})
            labels.append(int(not wrong))
            names.append(name)
    return scores, np.array(labels), names


def sure_wrong_model(k: int) -> dict[str, Any]:
    """An artifact's group model over ``k`` features that calls every reply wrong (risk ~ 1)."""
    return {"scaler": {"mean": [0.0] * k, "scale": [1.0] * k},
            "logistic": {"coef": [0.0] * k, "intercept": 30.0, "C": 1.0}, "n_fit": 50}


def replies(guard: Any) -> tuple[Any, Any, Any]:
    """The same reply guarded with no group, inside ``legal`` and inside ``support``."""
    from guarduq.policy import traffic_group

    plain = guard.guarded("hello", "a reply")
    with traffic_group("legal"):
        legal = guard.guarded("hello", "a reply")
    with traffic_group("support"):
        support = guard.guarded("hello", "a reply")
    return plain, legal, support


def within_auroc(risk: np.ndarray, labels: np.ndarray, names: list[str]) -> float:
    g = np.array(names)
    return float(np.mean([bootstrap_auroc(1 - labels[g == n], risk[g == n], n_boot=0)[0] for n in set(names)]))


def test_each_group_model_ranks_its_own_traffic_and_no_group_gets_the_pooled_risk_exactly() -> None:
    scores, labels, names = confounded(400, seed=0)
    test_scores, test_labels, test_names = confounded(400, seed=1)
    pooled = Calibrator(FEATURES).fit(scores, labels)
    grouped = Calibrator(FEATURES, per_group=True).fit(scores, labels, groups=names)
    assert sorted(grouped.group_models_) == ["easy", "hard", "mid"] and grouped.group_fallback_ == {}
    served = grouped.predict_risk(test_scores, test_names)
    plain = pooled.predict_risk(test_scores)
    assert within_auroc(served, test_labels, test_names) > within_auroc(plain, test_labels, test_names) + 0.1
    wrong = 1 - test_labels
    assert bootstrap_auroc(wrong, served, n_boot=0)[0] > bootstrap_auroc(wrong, plain, n_boot=0)[0] + 0.05
    # No group, an unknown group or None: the pooled model, identical to a plain fit's.
    np.testing.assert_array_equal(grouped.predict_risk(test_scores), plain)
    np.testing.assert_array_equal(grouped.predict_risk(test_scores, ["other"] * len(test_scores)), plain)
    np.testing.assert_array_equal(grouped.predict_risk(test_scores, [None] * len(test_scores)), plain)
    # One group's rows: its own model, fitted as a plain calibrator on its items alone.
    own = Calibrator(FEATURES).fit([s for s, n in zip(scores, names, strict=True) if n == "hard"],
                                   labels[np.array(names) == "hard"])
    hard = [s for s, n in zip(test_scores, test_names, strict=True) if n == "hard"]
    np.testing.assert_allclose(grouped.predict_risk(hard, ["hard"] * len(hard)), own.predict_risk(hard), rtol=1e-12)
    assert grouped.risk(hard[0], group="hard") == pytest.approx(own.risk(hard[0]), rel=1e-12)


def test_a_group_too_small_for_a_model_is_served_by_the_pooled_one_and_says_why() -> None:
    scores, labels, names = confounded(400, seed=2)
    small = MIN_GROUP_FIT - 1
    scores, labels, names = scores[:800] + scores[800:800 + small], labels[:800 + small], names[:800 + small]
    cal = Calibrator(FEATURES, per_group=True).fit(scores, labels, groups=names)
    assert sorted(cal.group_models_) == ["easy", "mid"]
    assert f"{small} valid items" in cal.group_fallback_["hard"]
    rows = scores[800:]
    np.testing.assert_array_equal(cal.predict_risk(rows, ["hard"] * small), cal.predict_risk(rows))


def test_invalid_rows_stay_fail_closed_and_bad_settings_are_refused() -> None:
    scores, labels, names = confounded(100, seed=3)
    cal = Calibrator(FEATURES, per_group=True).fit(scores, labels, groups=names)
    bad = {**scores[0], "mean_logprob": float("nan")}
    assert cal.risk(bad, group="easy") == 1.0
    with pytest.raises(CalibrationError, match="exclusive"):
        Calibrator(FEATURES, per_group=True, within_groups=True)
    with pytest.raises(CalibrationError, match="pass groups="):
        Calibrator(FEATURES, per_group=True).fit(scores, labels)
    before = cal.predict_risk(scores, names)
    with pytest.raises(CalibrationError, match="pass groups="):  # refused before anything is replaced
        cal.fit(scores[::-1], labels[::-1])
    np.testing.assert_array_equal(cal.predict_risk(scores, names), before)
    with pytest.raises(CalibrationError, match="groups for"):
        cal.predict_risk(scores[:3], ["easy"])


def test_each_certificate_covers_the_risk_it_is_applied_to() -> None:
    """The pooled thresholds on the pooled risk (what replies without a certified group model get);
    each modelled group's own thresholds on its items' risk from its own model."""
    scores, labels, names = confounded(300, seed=4)
    held, held_labels, held_names = confounded(300, seed=5)
    cal = Calibrator(FEATURES, per_group=True).fit(scores, labels, groups=names)
    alphas, delta = (0.2, 0.3, 0.5), 0.1
    got = cal.fit_thresholds(held, held_labels, alphas=alphas, delta=delta, groups=held_names)
    pooled = cal.predict_risk(held)
    assert got == [select_threshold(pooled, 1 - held_labels, a, delta, start=cal._start(a, delta)) for a in alphas]
    served, g = cal.predict_risk(held, held_names), np.array(held_names)
    fit_served = cal.predict_risk(scores, names)
    starts = group_starts(fit_served, 1 - labels, names, alphas, delta)
    assert cal.group_thresholds_ == certify_groups(served, 1 - held_labels, held_names, alphas, delta, starts)
    easy = cal.group_thresholds_["easy"]
    assert [t.n for t in easy] == [int((g == "easy").sum())] * len(alphas)
    assert any(t.threshold is not None for t in easy)
    # A group model serves a reply under a policy only where its group is certified at the policy's alpha.
    policy = SimpleNamespace(config=SimpleNamespace(alpha=0.2))
    certified = {n for n, ts in cal.group_thresholds_.items() if ts[0].threshold is not None}
    assert certified == {"easy"}  # at 0.2, the groups that err more are not
    for name in ("easy", "mid", "hard", "other", None):
        want = name if name in certified else None
        assert risk_group(policy, cal, name) == want
    assert risk_group(None, cal, "hard") == "hard"  # no policy, no decision: the group's estimate
    assert risk_group(policy, Calibrator(FEATURES).fit(scores, labels), "easy") is None


def test_the_artifact_keeps_the_group_models_and_refuses_broken_ones(tmp_path: Path) -> None:
    scores, labels, names = confounded(200, seed=6)
    cal = Calibrator(FEATURES, per_group=True, model_name="m", model_fingerprint="f" * 32).fit(
        scores[:450], labels[:450], groups=names[:450])  # "hard" has 50 items: a model of its own
    cal.fit_thresholds(scores[450:], labels[450:], alphas=(0.3,), groups=names[450:])
    path = tmp_path / "cal.json"
    cal.save(path)
    doc = json.loads(path.read_text())
    assert doc["format_version"] == 4 and sorted(doc["group_models"]) == ["easy", "hard", "mid"]
    back = Calibrator.load(path)
    assert back.per_group and back.group_fallback_ == cal.group_fallback_
    np.testing.assert_allclose(back.predict_risk(scores, names), cal.predict_risk(scores, names), rtol=1e-12)
    np.testing.assert_allclose(back.predict_risk(scores), cal.predict_risk(scores), rtol=1e-12)
    for breakage, message in ((lambda g: g["logistic"]["coef"].pop(), "parameter lengths"),
                              (lambda g: g["scaler"]["scale"].__setitem__(0, -1.0), "invalid parameters"),
                              (lambda g: g.update(extra=1), "corrupt calibrator")):
        broken = json.loads(path.read_text())
        breakage(broken["group_models"]["mid"])
        (tmp_path / "broken.json").write_text(json.dumps(broken))
        with pytest.raises(ArtifactError, match=message):
            Calibrator.load(tmp_path / "broken.json")


def test_the_decider_and_a_guard_in_a_traffic_group_serve_that_groups_model(tmp_path: Path) -> None:
    scores, labels, names = confounded(200, seed=7)
    cal = Calibrator(FEATURES, per_group=True).fit(scores, labels, groups=names)
    one = scores[0]
    assert calibrated_signals(cal, one, group="hard")["risk"] == cal.risk(one, group="hard")
    assert calibrated_signals(cal, one)["risk"] == cal.risk(one) != cal.risk(one, group="hard")

    from guarduq import Guard
    from guarduq.models import fingerprint
    from tests.conftest import make_tokenizer, tiny_llama
    from tests.unit.test_reload import fitted_calibrator_doc

    model = tiny_llama()
    doc = fitted_calibrator_doc(fingerprint(model))  # features "paper", pooled
    k = len(doc["features"])
    sure_wrong = sure_wrong_model(k)
    (tmp_path / "cal.json").write_text(json.dumps({**doc, "format_version": 4, "group_models": {"legal": sure_wrong},
                                                   "group_fallback": {}}))
    guard = Guard((model, make_tokenizer()), calibrator=tmp_path / "cal.json")
    plain, legal, support = replies(guard)
    assert legal.risk == pytest.approx(1.0) and plain.risk is not None and plain.risk < 0.99
    assert support.risk == plain.risk


def test_a_refit_drops_stale_certificates_and_a_cascade_refuses_a_per_group_first_stage() -> None:
    from guarduq.calibration.cascade import fit_second_stage
    from guarduq.errors import PolicyError
    from guarduq.policy.second_stage import check_second_stage

    scores, labels, names = confounded(200, seed=8)
    cal = Calibrator(FEATURES, per_group=True).fit(scores, iter(labels.tolist()), groups=names)  # labels read twice
    assert sorted(cal.group_models_) == ["easy", "hard", "mid"]
    cal.fit_thresholds(scores, labels, alphas=(0.5,), groups=names)
    assert cal.thresholds_ and cal.group_thresholds_
    cal.fit(scores[::-1], labels[::-1], groups=names[::-1])  # a new model: its certificates are gone
    assert cal.thresholds_ == [] and cal.group_thresholds_ == {}
    with pytest.raises(CalibrationError, match="pass groups= to fit_thresholds"):
        cal.fit_thresholds(scores, labels, alphas=(0.5,))
    with pytest.raises(CalibrationError, match="pooled first stage"):
        fit_second_stage(cal, scores, labels, scores, labels, alpha=0.5, delta=0.1)
    with pytest.raises(PolicyError, match="pooled first-stage"):
        check_second_stage("p", 0.5, SimpleNamespace(cascade_={"alpha": 0.5}), cal, None)


def test_under_a_policy_a_group_model_serves_only_a_certified_group(tmp_path: Path) -> None:
    """Both groups have a model that calls every reply wrong; only ``legal`` is certified at the
    policy's alpha, so ``support`` gets the pooled risk and the pooled threshold (its fallback)."""
    from dataclasses import asdict

    from guarduq import Guard
    from guarduq.models import fingerprint
    from tests.conftest import make_tokenizer, tiny_llama
    from tests.unit.test_in_force import POLICY, _threshold
    from tests.unit.test_reload import fitted_calibrator_doc

    model = tiny_llama()
    doc = fitted_calibrator_doc(fingerprint(model))
    k = len(doc["features"])
    sure_wrong = sure_wrong_model(k)
    doc |= {"format_version": 4, "group_models": {"legal": sure_wrong, "support": sure_wrong}, "group_fallback": {},
            "thresholds": [asdict(_threshold(1.0))],  # the pooled rule allows everything
            "group_thresholds": {"legal": [asdict(_threshold(0.5))], "support": [asdict(_threshold(None))]}}
    (tmp_path / "cal.json").write_text(json.dumps(doc))
    (tmp_path / "p.yaml").write_text(json.dumps(POLICY))
    guard = Guard((model, make_tokenizer()), policy=tmp_path / "p.yaml")
    plain, legal, support = replies(guard)
    assert legal.risk == pytest.approx(1.0) and legal.decision is not None and legal.decision.action == "abstain"
    assert plain.risk is not None and plain.risk < 0.99
    assert support.risk == plain.risk and support.decision is not None and support.decision.action == "allow"
    assert support.in_force is not None and support.in_force.certificate != "group"
