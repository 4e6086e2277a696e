"""benchmarks/drift.py --quick: the drift-case evidence pipeline on synthetic pools (no model).

Asserts what the synthetic data is built to show (each group's windows mostly read as that group's
slice, the shifted left-out pool reads ``unseen`` and degrades), that the page, figure and JSON
are written, and never a timing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.spec_from_file_location("drift_bench", ROOT / "benchmarks" / "drift.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["drift_bench"] = mod
    spec.loader.exec_module(mod)
    d = tmp_path_factory.mktemp("drift")
    assert mod.main(["--quick", "--out-dir", str(d), "--count", "30"]) == 0
    return d


def _summaries(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "drift_quick.json").read_text())["summaries"]


def test_writes_page_figure_and_json(out: Path) -> None:
    page = (out / "drift_quick.md").read_text()
    assert "<!-- BEGIN GENERATED -->" in page and "drift_quick.png" in page and "False alarms" in page
    assert (out / "drift_quick.png").stat().st_size > 1000


def test_left_out_pool_reads_unseen_and_its_degraded_windows_alarm(out: Path) -> None:
    for s in _summaries(out):
        left = s["per_source"]["left-out"]
        assert left["expected"] == "unseen" and left["correct"] >= 0.9
        assert s["degraded_n"] > 0 and s["detected"] / s["degraded_n"] >= 0.9


def test_group_windows_without_replacement_read_their_slice(out: Path) -> None:
    small = _summaries(out)[1]  # windows drawn without replacement
    for g in "bcd":
        v = small["per_source"][g]
        assert v["expected"] == f"slice:{g}" and v["alarm"] == 1.0
        assert v["correct"] >= 0.5
    # "a" sits at the centre of the mix: with thresholds that hold given the stored reference,
    # small windows of it may read ok (close to the mix), never unseen
    a = small["per_source"]["a"]
    assert a["correct"] == a["alarm"] and a["correct"] >= 0.3


def test_leave_one_dataset_out_refits(out: Path) -> None:
    res = json.loads((out / "drift_quick.json").read_text())["lodo"]
    assert set(res["folds"]) == set("abcde")
    for d, f in res["folds"].items():
        assert d not in f["n_ref"] and f["left-out"]["windows"] > 0 and f["mix"]["windows"] > 0
    far = res["folds"]["e"]["left-out"]  # far from every other group, its risk runs backwards
    assert far["cases"].get("unseen", 0) / far["windows"] >= 0.9 and far["auroc"] < 0.5
    assert 0.0 <= res["mix_false_alarm"] <= 1.0 and res["mix_windows"] > 0
    assert "Leave one dataset out" in (out / "drift_quick.md").read_text()


def test_fold_windows_share_no_item_and_count_alarms(out: Path) -> None:
    import numpy as np

    from guarduq.calibration.drift_groups import GroupReference

    folds = sys.modules["_drift_folds"]
    rng = np.random.default_rng(0)
    group = np.array(["a"] * 103 + ["b"] * 60)
    ref = GroupReference(("x",), rng.normal(size=(163, 1)), group, "t")
    which = folds.fold_of(ref, 10, "s")
    for g in "ab":  # every group split evenly over the folds: each item in one fold only
        sizes = np.bincount(which[group == g], minlength=10)
        assert sizes.max() - sizes.min() <= 1 and sizes.sum() == (group == g).sum()
    rows = [{"source": "mix", "n": 9, "label": "slice:a"}, {"source": "a", "n": 5, "label": "slice:a"},
            {"source": "a", "n": 5, "label": "unseen"}, {"source": "b", "n": 5, "label": "slice:a"},
            {"source": "b", "n": 5, "label": "ok"}]
    fa = folds.false_alarms({"rows": rows})
    assert fa["per_source"]["mix"]["alarms"] == 1  # a mix window must read ok
    assert (fa["groups"]["alarms"], fa["groups"]["windows"], fa["groups"]["other_slice"]) == (1, 4, 1)
    page = json.loads((out / "drift_quick.json").read_text())["fold_windows"][0]
    assert {r["source"] for r in page["rows"]} == {"mix", *"abcd"}


def test_held_aside_items_leave_the_drift_reference_once_each(out: Path) -> None:
    bench = sys.modules["drift_bench"]
    row = {"dataset": "truthfulqa-mc", "epistemic": 1.5, "aleatoric": 0.2, "mean_logprob": -1.0}
    other = {**row, "epistemic": 2.5}
    rows = [row, dict(row), other, {**row, "dataset": "arc"}]
    kept = bench._without(rows, [dict(row)])  # one of the two equal rows goes, nothing else
    assert kept == [row, other, {**row, "dataset": "arc"}]
    with pytest.raises(SystemExit, match="1 held-aside items are not in the drift reference"):
        bench._without(rows, [{**row, "aleatoric": 0.3}])


def test_no_fold_window_is_read_by_a_classifier_that_holds_its_items(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from guarduq.calibration.drift_groups import CaseClassifier, GroupReference

    folds = sys.modules["_drift_folds"]
    values = np.arange(240, dtype=float).reshape(-1, 1)  # every item its own value
    ref = GroupReference(("x",), values, np.array(["a"] * 120 + ["b"] * 120), "t")
    built: list[set[float]] = []
    seen: list[tuple[int, set[float]]] = []

    class Recording(CaseClassifier):
        def __init__(self, sub: GroupReference, **kw: Any) -> None:
            built.append(set(sub.matrix[:, 0].tolist()))
            super().__init__(sub, **kw)

        def classify(self, window: Any) -> Any:
            seen.append((len(built) - 1, set(np.asarray(window["x"]).tolist())))
            return super().classify(window)

    monkeypatch.setattr(folds, "CaseClassifier", Recording)
    res = folds.fold_windows(ref, folds=4, draws=20)
    assert len(built) == 4 and all(len(b) == 180 for b in built)
    windows = [w for _, w in seen]
    assert all(not (w & built[k]) for k, w in seen)  # a window's items are never in its reference
    mix = [w for (k, w), r in zip(seen, res["rows"], strict=True) if r["source"] == "mix"]
    assert set().union(*mix) == set(values[:, 0].tolist()) and sum(map(len, mix)) == 240  # each item once
    assert sum(map(len, windows)) == 480  # every item once in a mix window and once in its group's
