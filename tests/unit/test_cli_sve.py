"""``--sve FILE`` on the commands that build a Guard with a policy (serve, demo, policy explain):
the saved SVE members answer the policy's second_opinion rules, bound to the model's fingerprint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from guarduq.cli import main
from guarduq.cli._run import open_guard
from guarduq.errors import FingerprintMismatchError, InputError
from tests.conftest import make_tokenizer, tiny_llama

PROMPT, RESPONSE = "Name a colour.", "Blue"
USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def sve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A two-member SVE over the tiny model folder, saved (the file) and in memory (the expected)."""
    from guarduq.models import load_model
    from guarduq.sve import SVEnsemble

    ens = SVEnsemble.from_model(load_model(str(tiny_model_dir)), members=2, last_n_blocks=1, sigma_init=0.3)
    return ens.save(tmp_path_factory.mktemp("sve") / "sve.safetensors"), ens


def so_policy(folder: Path, above: float, name: str = "so") -> Path:
    """Allow when the second opinion's mean probability is above ``above``, else abstain."""
    path = folder / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nversion: '1'\nrules:\n"
        "  - name: ask\n    action: second_opinion\n    rules:\n"
        f"      - {{name: confirmed, when: {{so.mean_prob: {{gt: {above!r}}}}}, action: allow}}\n"
        "      - {name: refused, action: abstain, message: Not confirmed.}\n"
    )
    return path


def plain_policy(folder: Path) -> Path:
    path = folder / "plain.yaml"
    path.write_text("name: plain\nversion: '1'\nrules:\n  - {name: all, action: allow}\n")
    return path


def test_open_guard_binds_the_saved_members_and_the_policy_decides_on_them(
    sve: tuple[Path, Any], tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path, ens = sve
    expected = ens.second_opinion(PROMPT, RESPONSE)
    for above, action, rule in ((expected.mean_prob - 1e-6, "allow", "ask/confirmed"),
                                (expected.mean_prob + 1e-6, "abstain", "ask/refused")):
        guard = open_guard(str(tiny_model_dir), sve=path, policy=so_policy(tmp_path, above))
        d = guard.guarded(PROMPT, RESPONSE).decision
        assert d is not None and (d.action, d.rule) == (action, rule)
        assert d.second_opinion is not None and d.second_opinion.mean_prob == pytest.approx(expected.mean_prob)
        assert d.second_opinion.member_mean_probs == pytest.approx(expected.member_mean_probs)
    assert "warning" not in capsys.readouterr().err


def test_an_unused_sve_is_one_warning_line(sve: tuple[Path, Any], tiny_model_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    guard = open_guard(str(tiny_model_dir), sve=sve[0], policy=plain_policy(tmp_path))
    assert guard.guarded(PROMPT, RESPONSE).decision.action == "allow"
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--sve" in line]
    assert warnings == ["warning: --sve is unused: policy 'plain' has no second_opinion rule"]


def test_a_missing_sve_file_is_an_input_error_before_the_model_loads(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(InputError, match="--sve .*nope.safetensors: cannot read it"):
        open_guard("no-such-model", sve=missing, policy=so_policy(tmp_path, 0.5))  # the model is never looked up
    with pytest.raises(InputError, match="cannot read it"):
        open_guard("no-such-model", sve=tmp_path)  # a folder
    for argv in (["serve", "--model", "no-such-model"], ["demo", "--model", "no-such-model"],
                 ["policy", "explain", str(so_policy(tmp_path, 0.5)), "--model", "no-such-model",
                  "--prompt", PROMPT]):
        assert main([*argv, "--sve", str(missing)]) == 2
        err = capsys.readouterr().err
        assert "cannot read it" in err and "Traceback" not in err and err.count("\n") == 1


def test_another_models_members_are_refused(tiny_model_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from guarduq.sve import SVEnsemble

    other = SVEnsemble.from_model(tiny_llama(seed=1), make_tokenizer(), members=2, last_n_blocks=1)
    path = other.save(tmp_path / "other.safetensors")
    with pytest.raises(FingerprintMismatchError, match="trained on model"):
        open_guard(str(tiny_model_dir), sve=path, policy=so_policy(tmp_path, 0.5))
    assert main(["policy", "explain", str(so_policy(tmp_path, 0.5)), "--model", str(tiny_model_dir),
                 "--prompt", PROMPT, "--response", RESPONSE, "--sve", str(path)]) == 2
    assert "trained on model" in capsys.readouterr().err


def test_serve_answers_a_second_opinion_policy_with_sve(sve: tuple[Path, Any], tiny_model_dir: Path,
                                                        tmp_path: Path, served: dict[str, Any],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.serve_helpers import local_client

    path, ens = sve
    expected = ens.second_opinion(USER, RESPONSE)
    policy = so_policy(tmp_path, expected.mean_prob - 1e-6)
    argv = ["serve", "--model", str(tiny_model_dir), "--policy", str(policy), "--port", "8123"]
    assert main(argv) == 2 and not served  # without --sve the policy cannot bind
    assert "no second-opinion provider" in (err := capsys.readouterr().err) and "--sve FILE" in err
    assert main([*argv, "--sve", str(path)]) == 0
    assert served["port"] == 8123 and "policy=so" in capsys.readouterr().err
    with local_client(served["app"]) as client:
        resp = client.post("/v1/guarduq/score", json={"messages": USER, "response": RESPONSE, "ended": True})
    assert resp.status_code == 200, resp.text
    decision = resp.json()["guarduq"]["decision"]
    assert (decision["action"], decision["rule"]) == ("allow", "ask/confirmed")
    assert decision["second_opinion"]["mean_prob"] == pytest.approx(expected.mean_prob)
