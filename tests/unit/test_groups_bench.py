"""``benchmarks/groups.py`` on the shipped artifact's held-out answers: the pooled certificate fails
inside TruthfulQA-MC far more often than δ allows, each group's own certificate does not."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def test_group_certificates_hold_where_the_pooled_one_fails() -> None:
    spec = importlib.util.spec_from_file_location("groups_bench", ROOT / "benchmarks" / "groups.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["groups_bench"] = mod
    spec.loader.exec_module(mod)
    data = mod.load()
    rng = np.random.default_rng(1)
    s = mod.summarize([mod.one_split(data, rng, 600, 40) for _ in range(60)])
    delta = mod.DELTA
    assert s["truthfulqa-mc"]["pooled"]["fails"] > 2 * delta  # the pooled certificate fails in one group
    for g in mod.GROUPS:  # each group's own holds (within delta, plus noise of 60 runs)
        assert s[g]["group"]["fails"] <= delta
    assert s["arc"]["certified"] > 0.9  # the group with a low error rate gets its own certificate
    assert s["arc"]["group"]["coverage"] > s["arc"]["pooled"]["coverage"]  # and answers more of it
    ship = mod.shipped(data)
    assert ship["truthfulqa-mc"]["error_rate"] > mod.ALPHA >= ship["arc"]["error_rate"]
