"""`guarduq policy check` reports the certified threshold a policy's alpha selects, rule by rule,
warns when none is certified (the rule can never match), and fails under --strict."""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import pytest

from guarduq.calibration import Calibrator
from guarduq.cli import main
from guarduq.policy import Policy
from guarduq.policy.certified import certified_thresholds, threshold_rules
from tests.unit.calibrator_helpers import synthetic_calibrator

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "policies").glob("*.yaml"))
CERTIFIED, UNCERTIFIED, UNFITTED = 0.6, 0.01, 0.25


@pytest.fixture(scope="module")
def calibrator_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small fitted calibrator: alpha 0.6 certified; alpha 0.01 cannot be (100 threshold items
    are fewer than the 161 that even zero errors need at delta 0.2)."""
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    synthetic_calibrator(path, n_fit=200, n_threshold=100, alphas=(UNCERTIFIED, CERTIFIED), delta=0.2)
    return path


def policy_file(folder: Path, calibrator: Path, alpha: float, rules: str, name: str = "p.yaml") -> Path:
    path = folder / name
    path.write_text(f"name: t\nversion: 1\ncalibrator: {calibrator}\nalpha: {alpha}\n"
                    + textwrap.dedent(rules))
    return path


SIMPLE = """\
rules:
  - name: confident
    when: {risk: {le: threshold}}
    action: allow
  - {name: rest, action: abstain}
"""

NESTED = """\
sinks:
  q: {type: jsonl, path: q.jsonl}
rules:
  - name: band
    when:
      all:
        - n_tokens: {ge: 1}
        - risk: {gt: threshold, le: 0.9}
    action: second_opinion
    rules:
      - name: inner
        when:
          not:
            risk: {gt: threshold}
        action: allow
      - name: either
        when:
          any:
            - risk: {le: threshold}
            - so.agrees: {eq: true}
        action: allow
      - {name: held, action: escalate, sink: q}
  - {name: rest, action: abstain}
"""


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["policy", "check", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_calibrator_fixture_has_a_certified_and_an_uncertified_alpha(calibrator_file: Path) -> None:
    cal = Calibrator.load(calibrator_file)
    assert cal.threshold_for(CERTIFIED) is not None
    assert cal.threshold_for(UNCERTIFIED) is None
    assert any(math.isclose(t.alpha, UNCERTIFIED) for t in cal.thresholds_)  # fitted, not certified


def test_certified_alpha_reports_the_calibrators_own_threshold(
    tmp_path: Path, calibrator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = Calibrator.load(calibrator_file).threshold_for(CERTIFIED)  # the public API, read apart
    path = policy_file(tmp_path, calibrator_file, CERTIFIED, SIMPLE)
    policy = Policy.from_yaml(path)
    report = certified_thresholds(policy, Calibrator.load(calibrator_file))
    assert report.ok and report.threshold == expected
    assert report.record is not None and report.record.n == 100 and report.record.delta == 0.2
    assert report.certified_alphas == (CERTIFIED,)
    # What serving will use is the same number.
    assert policy.bind(calibrator=Calibrator.load(calibrator_file)).risk_threshold == expected

    rc, out, err = run(capsys, "--strict", str(path))
    assert rc == 0 and "WARNING" not in err
    line = next(x for x in out.splitlines() if "rule confident" in x)
    assert f"risk <= threshold = {expected:g} (alpha {CERTIFIED:g} certified on {calibrator_file}" in line
    assert "delta 0.2" in line and "n=100" in line


def test_uncertified_alpha_warns_and_fails_only_under_strict(
    tmp_path: Path, calibrator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = policy_file(tmp_path, calibrator_file, UNCERTIFIED, SIMPLE)
    rc, out, err = run(capsys, str(path))
    assert rc == 0
    assert out.startswith(f"ok: {path}")
    assert "rule confident: risk <= threshold: no certified threshold at alpha 0.01" in out
    warning = next(x for x in err.splitlines() if x.startswith("WARNING"))
    assert f"WARNING: {path}: no threshold is certified at alpha 0.01" in warning
    assert "rule confident can never match" in warning
    assert f"it certifies alpha {CERTIFIED:g} only" in warning
    assert "the calibrator says: no risk threshold keeps the error rate <= 0.01" in warning
    assert run(capsys, "--strict", str(path))[0] == 1
    # The engine agrees: bound to this calibrator the threshold is unknown and the rule fails closed.
    bound = Policy.from_yaml(path).bind(calibrator=Calibrator.load(calibrator_file))
    assert bound.risk_threshold is None and bound.decide({"risk": 0.0}).action == "abstain"


def test_alpha_the_calibrator_never_fitted_is_a_warning(
    tmp_path: Path, calibrator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = policy_file(tmp_path, calibrator_file, UNFITTED, SIMPLE)
    rc, _, err = run(capsys, str(path))
    assert rc == 0
    assert "holds no threshold for alpha 0.25 (it was fitted for 0.01, 0.6)" in err
    assert "raises PolicyError" in err
    assert run(capsys, "--strict", str(path))[0] == 1


def test_unreadable_calibrator_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = policy_file(tmp_path, tmp_path / "not-yet.json", CERTIFIED, SIMPLE)
    rc, out, err = run(capsys, str(path))
    assert rc == 0 and "cannot tell whether alpha 0.6 is certified" in err
    assert "rule confident: risk <= threshold: threshold unknown (calibrator not readable)" in out
    assert run(capsys, "--strict", str(path))[0] == 1


def test_an_invalid_file_still_exits_2_under_strict(
    tmp_path: Path, calibrator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    warned = policy_file(tmp_path, calibrator_file, UNCERTIFIED, SIMPLE)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nversion: 1\nrules:\n  - {name: a, action: allow, colour: red}\n")
    assert run(capsys, "--strict", str(warned), str(bad))[0] == 2
    assert run(capsys, "--strict", str(bad), str(warned))[0] == 2


def test_nested_rules_are_found(tmp_path: Path, calibrator_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = policy_file(tmp_path, calibrator_file, UNCERTIFIED, NESTED)
    uses = {u.rule: u for u in threshold_rules(Policy.from_yaml(path).config)}
    assert list(uses) == ["band", "band/inner", "band/either"]
    assert uses["band"].comparisons == ("risk > threshold and risk <= 0.9",)
    assert uses["band/inner"].comparisons == ("not (risk > threshold)",)
    # With the threshold unknown, `band` and `inner` cannot hold; `either` still can (so.agrees).
    assert [u.needs_threshold for u in uses.values()] == [True, True, False]
    rc, out, err = run(capsys, str(path))
    assert rc == 0
    assert "rule band/inner: not (risk > threshold)" in out
    assert "rules band, band/inner can never match" in err
    assert "rule band/either can match only through conditions other than the threshold" in err

    expected = Calibrator.load(calibrator_file).threshold_for(CERTIFIED)
    certified = policy_file(tmp_path, calibrator_file, CERTIFIED, NESTED, name="ok.yaml")
    rc, out, err = run(capsys, "--strict", str(certified))
    # this calibrator's certified threshold accepts every risk (1.0), which empties `band`
    assert expected == 1.0 and rc == 1
    assert "rule band asks for an empty risk band" in err and "inner" not in err
    assert f"rule band/either: risk <= threshold = {expected:g} (" in out
    assert f"rule band: risk > threshold = {expected:g} and risk <= 0.9 (" in out


def test_policies_without_threshold_rules_print_as_before(
    tmp_path: Path, calibrator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"name: t\nversion: 1\ncalibrator: {tmp_path / 'missing.json'}\n"
                     "rules:\n  - {name: a, when: {risk: {le: 0.5}}, action: allow}\n  - {name: b, action: abstain}\n")
    rc, out, err = run(capsys, "--strict", str(plain))
    assert rc == 0 and err == "" and len(out.splitlines()) == 1 and out.startswith(f"ok: {plain}")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_policy_passes_strict(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Except where the truth is a warning: cascade.yaml's second stage certifies no threshold on
    SmolLM2 (docs/cascade/README.md), and the check must say so while that artifact ships."""
    rc, out, err = run(capsys, "--strict", str(path))
    policy = Policy.from_yaml(path)
    second = policy.second_calibrator_path
    if second is not None and Calibrator.load(second).threshold_for(policy.alpha) is None:
        assert rc == 1 and err.count("WARNING") == 1 and "second stage certifies no threshold" in err
        assert "no certified so.threshold" in out
    else:
        assert rc == 0, err
        assert "WARNING" not in err
    if not threshold_rules(policy.config):
        return
    assert policy.calibrator_path is not None and policy.alpha is not None
    expected = Calibrator.load(policy.calibrator_path).threshold_for(policy.alpha)
    assert expected is not None
    shown = re.findall(r"threshold = ([0-9.]+) \(alpha ([0-9.]+) certified", out)
    assert shown and all(float(t) == pytest.approx(expected) and float(a) == policy.alpha for t, a in shown)


def test_a_band_that_the_certified_threshold_empties_is_a_warning(
    tmp_path: Path, calibrator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``risk > threshold and risk <= c`` with c below the certified threshold never matches."""
    t = Calibrator.load(calibrator_file).threshold_for(CERTIFIED)
    rules = f"""\
rules:
  - name: confident
    when: {{risk: {{le: threshold}}}}
    action: allow
  - name: band
    when: {{risk: {{gt: threshold, le: {t - 0.01:.6f}}}}}
    action: abstain
  - name: wide
    when: {{risk: {{gt: threshold, le: {t + 0.01:.6f}}}}}
    action: abstain
  - {{name: rest, action: abstain}}
"""
    path = policy_file(tmp_path, calibrator_file, CERTIFIED, rules)
    rc, _, err = run(capsys, str(path))
    assert rc == 0 and "rule band asks for an empty risk band and can never match" in err
    assert "wide" not in err  # a band the threshold leaves open is fine
    assert run(capsys, "--strict", str(path))[0] == 1
    # The engine agrees: a risk just above the threshold skips the band and falls to `wide`.
    bound = Policy.from_yaml(path).bind(calibrator=Calibrator.load(calibrator_file))
    assert bound.decide({"risk": t + 0.005}).rule == "wide"
