"""The policy, the store and the review page import without torch, sklearn or transformers, and the
package's public names still resolve (``guarduq/_lazy.py``)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import guarduq
import guarduq.calibration

HEAVY = ("torch", "sklearn", "transformers", "scipy")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_policy_store_and_review_load_no_torch_sklearn_or_scipy() -> None:
    loaded = _run(
        f"""
        import sys
        import guarduq.review, guarduq.policy, guarduq.store
        from guarduq import Policy, GuardUQError
        from guarduq.calibration.sizing import labels_needed
        print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
        """
    )
    assert loaded.strip() == "[]"


def test_a_heavy_name_loads_its_module_on_first_read() -> None:
    loaded = _run(
        """
        import sys
        import guarduq
        before = "sklearn" in sys.modules
        from guarduq import Calibrator
        print(before, "sklearn" in sys.modules, "torch" in sys.modules, Calibrator.__module__)
        """
    )
    # the calibrator is sklearn's: reading its parameter selection's name loads no torch
    assert loaded.split() == ["False", "True", "False", "guarduq.calibration.calibrator"]


def test_the_scorer_loads_no_transformers() -> None:
    """The CLI loads the scorer to register its commands; transformers (~1.5 s) loads with a model."""
    loaded = _run(
        """
        import sys
        import guarduq.scoring.uncertainty, guarduq.sve
        print("transformers" in sys.modules)
        """
    )
    assert loaded.strip() == "False"


@pytest.mark.parametrize("package", [guarduq, guarduq.calibration], ids=lambda p: p.__name__)
def test_every_public_name_resolves_and_is_listed(package) -> None:
    for name in package.__all__:
        assert getattr(package, name) is not None
    assert set(package.__all__) <= set(dir(package))
    public = {n for n in dir(package) if not n.startswith("_") and not inspect.ismodule(getattr(package, n))}
    assert public - {"TYPE_CHECKING", "annotations", "attach"} == set(package.__all__) - {"__version__"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        package.nope  # noqa: B018


def test_old_import_paths_still_work() -> None:
    from guarduq import Guard, GuardedResponse, SVEnsemble, load_model
    from guarduq.calibration import Calibrator, Threshold, ece
    from guarduq.calibration.metrics import ece as metrics_ece
    from guarduq.guard import Guard as G
    from guarduq.guard import GuardedResponse as R

    assert Guard is G and ece is metrics_ece and callable(load_model)
    assert GuardedResponse is R and GuardedResponse.__module__ == "guarduq.response" and SVEnsemble.__module__ == "guarduq.sve.ensemble"
    assert Calibrator.__module__ == "guarduq.calibration.calibrator"
    assert Threshold.__module__ == "guarduq.calibration.thresholds"
