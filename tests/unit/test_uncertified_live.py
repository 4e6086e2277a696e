"""Nothing uncertified goes live at start either (issue 35): ``guarduq serve`` refuses a pair under
which the policy's allow rule can never match unless ``--allow-uncertified``; ``Guard(...)`` unless
``allow_uncertified=True``; ``Guard.reload`` unless ``force=True``, the old pair serving on."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from guarduq import Guard
from guarduq.decider import check_certified, uncertified
from guarduq.errors import GuardUQError, ReloadError, UncertifiedPairError
from tests.conftest import tiny_llama
from tests.unit import test_reload as rl
from tests.unit.serve_helpers import USER


@pytest.fixture
def model(tokenizer) -> Any:
    return tiny_llama(seed=3), tokenizer


@pytest.fixture
def files(tmp_path: Path, model: Any) -> rl.Files:
    from guarduq.models import fingerprint

    return rl.Files(tmp_path, fingerprint(model[0]))


def test_the_old_import_paths_still_work() -> None:
    from guarduq.serve import reload

    assert reload.uncertified is uncertified and reload.UncertifiedPairError is UncertifiedPairError
    assert issubclass(UncertifiedPairError, ReloadError) and issubclass(UncertifiedPairError, GuardUQError)


def test_guard_refuses_an_uncertified_pair_unless_allowed(model, files, caplog) -> None:
    new = rl.uncertified_files(files)
    with pytest.raises(UncertifiedPairError, match="rule confident can never match") as err:
        Guard(model, policy=files.policy)
    assert "allow_uncertified=True" in str(err.value) and "allow_uncertified" not in err.value.problem
    logger = logging.getLogger("guarduq")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="guarduq"):
            g = Guard(model, policy=files.policy, allow_uncertified=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert g.decider.identity == new
    assert any("guard_uncertified_pair" in r.getMessage() for r in caplog.records)
    r = g.guarded(USER, "Blue")
    assert r.decision is not None and not r.decision.shown  # what --allow-uncertified buys: all withheld


def test_guard_reload_refuses_an_uncertified_pair_and_the_old_one_serves(model, files) -> None:
    g = Guard(model, policy=files.policy, max_new_tokens=4)
    old = g.decider
    new = rl.uncertified_files(files)
    with pytest.raises(UncertifiedPairError, match="can never match") as err:
        g.reload()
    assert "force=True" in str(err.value)
    assert g.decider is old and g.guarded(USER, "Blue").decided_by == old.identity
    assert g.reload(force=True) == new and g.decider.identity == new
    assert g.guarded(USER, "Blue").decided_by == new


def test_check_certified_passes_a_certified_pair_and_a_pair_without_policy(model, files) -> None:
    g = Guard(model, policy=files.policy)
    check_certified(g.decider, force=False, how_to_force="-", event="unused")  # no threshold rule: fine
    g.policy = None
    assert uncertified(g.decider) is None


# --------------------------------------------------------------------------- guarduq serve


def test_serve_refuses_to_start_on_an_uncertified_pair_unless_told(tiny_model_dir: Path, tmp_path: Path,
                                                                   served: dict[str, Any], capsys) -> None:
    from guarduq.cli import main
    from guarduq.models import load_model

    files = rl.Files(tmp_path, load_model(str(tiny_model_dir)).info.fingerprint)
    argv = ["serve", "--model", str(tiny_model_dir), "--policy", str(files.policy), "--port", "8124"]
    assert main(argv) == 0 and served["port"] == 8124  # a certified pair starts
    assert "UNCERTIFIED" not in capsys.readouterr().err
    served.clear()
    rl.uncertified_files(files)
    assert main(argv) == 2 and not served  # refused before uvicorn.run
    err = capsys.readouterr().err
    assert "refusing to serve" in err and "rule confident can never match" in err
    assert "--allow-uncertified" in err and "allow_uncertified=True" not in err
    assert main([*argv, "--allow-uncertified"]) == 0 and served["port"] == 8124
    err = capsys.readouterr().err
    assert "guard_uncertified_pair" in err and "UNCERTIFIED pair (--allow-uncertified;" in err
