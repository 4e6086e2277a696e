"""`guarduq policy init`: a first policy at the strictest alpha a calibrator certifies, which then
passes `policy check --strict` and decides as its threshold says; nothing written when no alpha,
or not the one asked for, is certified, or when the file exists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from guarduq.calibration import Calibrator
from guarduq.cli import main
from guarduq.policy import Policy
from tests.unit.calibrator_helpers import synthetic_calibrator

CERTIFIED, LOOSER, UNCERTIFIED = 0.3, 0.4, 0.01


@pytest.fixture(scope="module")
def calibrator_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Alphas 0.3 and 0.4 certified on 300 threshold items (thresholds below 1); 0.01 cannot be
    (fewer items than even zero errors need at delta 0.2)."""
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    cal = synthetic_calibrator(path, n_fit=400, n_threshold=300, alphas=(UNCERTIFIED, CERTIFIED, LOOSER),
                               delta=0.2, seed=1, fingerprint="cd" * 16)
    assert cal.threshold_for(UNCERTIFIED) is None and cal.threshold_for(CERTIFIED) < 1  # some abstain
    return path


def test_init_picks_the_strictest_certified_alpha_and_passes_the_strict_check(
        calibrator_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policies" / "mine.yaml"
    out.parent.mkdir()
    assert main(["policy", "init", "--calibrator", str(calibrator_file), "--out", str(out)]) == 0
    policy = Policy.from_yaml(out)
    assert policy.config.alpha == CERTIFIED and policy.config.name == "mine"
    assert policy.calibrator_path is not None and policy.calibrator_path.resolve() == calibrator_file.resolve()
    assert main(["policy", "check", "--strict", str(out)]) == 0
    # It decides as the threshold says: allow at or below it, abstain above.
    cal = Calibrator.load(calibrator_file)
    t = cal.threshold_for(CERTIFIED)
    bound = policy.bind(calibrator=cal)
    assert bound.decide({"risk": t}).action == "allow"
    assert bound.decide({"risk": t + 1e-6}).action == "abstain"
    assert f"alpha {CERTIFIED:g}" in capsys.readouterr().out


def test_init_takes_a_certified_alpha_and_refuses_others(calibrator_file: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.yaml"
    assert main(["policy", "init", "--calibrator", str(calibrator_file), "--out", str(out), "--alpha", str(LOOSER)]) == 0
    assert Policy.from_yaml(out).config.alpha == LOOSER
    other = tmp_path / "q.yaml"
    assert main(["policy", "init", "--calibrator", str(calibrator_file), "--out", str(other),
                 "--alpha", str(UNCERTIFIED)]) == 2
    err = capsys.readouterr().err
    assert "does not certify alpha 0.01" in err and "0.3, 0.4" in err and not other.exists()


def test_init_never_replaces_a_file_unasked(calibrator_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    out.write_text("mine\n")
    assert main(["policy", "init", "--calibrator", str(calibrator_file), "--out", str(out)]) == 2
    assert out.read_text() == "mine\n"
    assert main(["policy", "init", "--calibrator", str(calibrator_file), "--out", str(out), "--force"]) == 0
    assert Policy.from_yaml(out).config.alpha == CERTIFIED


def test_init_refuses_a_calibrator_that_certifies_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(2)
    scores = [{"epistemic": float(e), "aleatoric": 0.1, "mean_logprob": -0.1, "valid": True}
              for e in rng.uniform(0.1, 1, 120)]
    labels = (rng.random(120) < 0.5).astype(int)
    cal = Calibrator("paper", C=1.0, model_name="tiny", model_fingerprint="ef" * 16)
    cal.fit(scores[:80], labels[:80])
    cal.fit_thresholds(scores[80:], labels[80:], alphas=(0.05,), delta=0.1)
    path = tmp_path / "cal.json"
    cal.save(path, include_evaluation_data=False)
    out = tmp_path / "p.yaml"
    assert main(["policy", "init", "--calibrator", str(path), "--out", str(out)]) == 2
    assert "certifies no alpha" in capsys.readouterr().err and not out.exists()


def test_init_on_a_per_group_calibrator_says_which_kinds_its_own_models_decide(tmp_path: Path) -> None:
    from tests.unit.test_group_models import confounded

    scores, labels, names = confounded(300, seed=9)
    held, held_labels, held_names = confounded(300, seed=10)
    cal = Calibrator("likelihood", per_group=True, model_name="m", model_fingerprint="ef" * 16)
    cal.fit(scores, labels, groups=names).fit_thresholds(held, held_labels, alphas=(0.4, 0.5), groups=held_names)
    cal.save(tmp_path / "cal.json")
    out = tmp_path / "mine.yaml"
    assert main(["policy", "init", "--calibrator", str(tmp_path / "cal.json"), "--out", str(out)]) == 0
    alpha = Policy.from_yaml(out).config.alpha
    own = [g for g, ts in sorted(cal.group_thresholds_.items())
           if any(t.alpha == alpha and t.threshold is not None for t in ts)]
    assert own and len(own) < 3  # some kinds certified on their own at that alpha, not all
    text = out.read_text()
    assert f"# Risk models per kind of traffic: easy, hard, mid; at alpha {alpha:g} {', '.join(own)}" in text
    assert main(["policy", "check", "--strict", str(out)]) == 0
