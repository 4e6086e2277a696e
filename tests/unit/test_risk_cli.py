"""`guarduq calibrate` with feature sets, CV, coefficients, the size warning and P(True), on the
shipped example logs and a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guarduq.calibration import Calibrator
from guarduq.calibration.evaluation import ScoreCache
from guarduq.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "my_logs.jsonl"


def test_example_logs_calibrate_with_a_size_warning(tmp_path: Path, tiny_model_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rows = [json.loads(x) for x in EXAMPLE.read_text().splitlines()]
    assert 10 <= len(rows) <= 20 and {r["label"] for r in rows} == {0, 1}
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--dataset", "jsonl", "--data", str(EXAMPLE),
            "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--out", str(out)]
    assert main(argv) == 2  # too small to certify any alpha: nothing is written
    assert "no alpha asked for (0.1, 0.2, 0.3) has a certified threshold" in capsys.readouterr().err
    assert not out.exists()
    assert main([*argv, "--allow-uncertified"]) == 0
    cap = capsys.readouterr()
    assert "warning: alpha=0.1: cannot be certified" in cap.err and "needs at least 38 accepted" in cap.err and "labelled answers in all" in cap.err
    assert "one-sided" in cap.err and "only 5 of them wrong" in cap.err  # 11-item fit split
    assert "coefficients on P(wrong)" in cap.out and "features: paper+likelihood" in cap.out
    cal = Calibrator.load(out)
    assert cal.feature_set == "paper+likelihood" and cal.cv_ is not None and cal.cv_["folds"] == 5
    for f, c in cal.coefficients().items():
        assert f"{f:>20s}  {c:+.3f}" in cap.out  # every coefficient printed with its sign


def test_feature_set_fixed_C_and_p_true(tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", str(tiny_model_dir), "--dataset", "jsonl", "--data", str(EXAMPLE), "--no-progress",
              "--runs-dir", str(tmp_path / "runs"), "--json", "--allow-uncertified"]
    assert main(["calibrate", *common, "--features", "likelihood", "--C", "0.5", "--out", str(tmp_path / "a.json")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["feature_set"] == "likelihood" and res["C"] == {"chosen": 0.5, "cv": None}
    assert set(res["coefficients"]) == {"mean_logprob", "log_min_token_prob", "mean_entropy", "log_n_tokens"}
    # Opt-in P(True): computed once per answer and cached, then read as a feature.
    assert main(["calibrate", *common, "--features", "aleatoric,p_true", "--out", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    cache = next((tmp_path / "runs" / "cache").rglob("*.jsonl"))
    probs = [r.scores["p_true"] for r in ScoreCache(cache).entries.values()]
    assert len(probs) == 20 and all(0 < p < 1 for p in probs)
    assert Calibrator.load(tmp_path / "b.json").costly_features == ("p_true",)
    assert main(["calibrate", *common, "--C", "-1", "--out", str(tmp_path / "c.json")]) == 2
    assert "--C must be > 0" in capsys.readouterr().err


def _arc_rows(n: int) -> list[dict]:
    words = ["whale", "shark", "trout", "otter", "eagle", "cobra", "moose", "heron", "gecko", "bison"]
    return [{"id": f"q{i}", "question": {"stem": f"Which of these is animal number {i}?", "choices": [
        {"text": words[(i + k) % 10], "label": "ABC"[k]} for k in range(3)]}, "answerKey": "ABC"[i % 3]}
        for i in range(n)]


def test_sign_stable_rule_picks_features_on_the_fit_split(tmp_path: Path, tiny_model_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from guarduq.calibration.analysis import available, select_features
    from guarduq.calibration.features import FEATURE_SETS
    from guarduq.calibration.splits import split_of

    arc = tmp_path / "arc.jsonl"
    arc.write_text("".join(json.dumps(r) + "\n" for r in _arc_rows(60)))
    common = ["--model", str(tiny_model_dir), "--no-progress", "--runs-dir", str(tmp_path / "runs"),
              "--allow-uncertified"]
    one = ["--dataset", "jsonl", "--data", str(EXAMPLE)]
    # One dataset: refused before any scoring, with the reason.
    assert main(["calibrate", *common, *one, "--features", "sign-stable", "--out", str(tmp_path / "x.json")]) == 2
    assert "at least 2 --dataset" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    two = [*one, "--dataset", "arc", "--data", str(arc)]
    # Per-dataset limits: bad ones are refused before any scoring too.
    for bad, msg in (("boolq=5", "no --dataset 'boolq'"), ("arc=0", "must be >= 1"), ("x", "N or DATASET=N")):
        assert main(["calibrate", *common, *two, "--limit", bad, "--out", str(tmp_path / "x.json")]) == 2
        assert msg in capsys.readouterr().err
    assert not list((tmp_path / "runs").rglob("*.jsonl"))  # nothing scored
    out = tmp_path / "cal.json"
    assert main(["calibrate", *common, *two, "--limit", "arc=50", "--features", "sign-stable", "--json",
                 "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    cal = Calibrator.load(out)
    assert res["feature_set"] == cal.feature_set == "sign-stable"
    # The same rule, applied by hand to the fit split of the cached scores, keeps the same features.
    groups: dict[str, tuple[list, list]] = {}
    for cache in (tmp_path / "runs" / "cache").rglob("*.jsonl"):
        for r in ScoreCache(cache).entries.values():
            if r.usable and split_of(r.id) == "fit":
                groups.setdefault(r.dataset, ([], []))[0].append(r.scores)
                groups[r.dataset][1].append(int(r.label))
    assert set(groups) == {"jsonl", "arc"}
    assert {d: v["n"] for d, v in res["datasets"].items()} == {"jsonl": 20, "arc": 50}
    base = available([s for g in groups.values() for s in g[0]], FEATURE_SETS["same-pass"])
    expected = select_features("sign-stable", {k: (v[0], np.array(v[1])) for k, v in groups.items()}, base)
    assert cal.features == expected and set(res["coefficients"]) == set(expected)
    # --within-datasets: refused on one dataset; on two, the artifact is the within fit of the
    # fit split with each item's dataset as its group (same cached scores, nothing rescored).
    assert main(["calibrate", *common, *one, "--within-datasets", "--out", str(tmp_path / "x.json")]) == 2
    assert "--within-datasets compares datasets" in capsys.readouterr().err

    def fitted(flag: str) -> tuple[dict[str, Any], Calibrator]:
        """Calibrate on the two cached datasets with ``flag``: the JSON printed and the artifact."""
        out = tmp_path / f"{flag.strip('-')}.json"
        assert main(["calibrate", *common, *two, "--limit", "arc=50", "--features", "likelihood",
                     flag, "--C", "0.3", "--json", "--out", str(out)]) == 0
        return json.loads(capsys.readouterr().out), Calibrator.load(out)

    res_w, cal_w = fitted("--within-datasets")
    assert res_w["within_datasets"] == cal_w.groups_ == ["arc", "jsonl"]
    fit_scores = [s for g in groups.values() for s in g[0]]
    fit_labels = [y for g in groups.values() for y in g[1]]
    fit_names = [d for d, g in groups.items() for _ in g[0]]
    # (C fixed: CV folds follow row order, which differs between the CLI and this rebuild)
    by_hand = Calibrator("likelihood", C=0.3, within_groups=True).fit(fit_scores, fit_labels, groups=fit_names)
    for f, c in by_hand.coefficients().items():
        assert cal_w.coefficients()[f] == pytest.approx(c, abs=1e-9)
    # --per-dataset: a model per kind where the fit split holds enough of it (here neither does),
    # the reason in the artifact and the JSON; exclusive with --within-datasets.
    assert main(["calibrate", *common, *two, "--per-dataset", "--within-datasets", "--out", str(tmp_path / "x.json")]) == 2
    assert "exclusive" in capsys.readouterr().err
    res_g, cal_g = fitted("--per-dataset")
    assert cal_g.per_group and cal_g.group_models_ == {} and set(cal_g.group_fallback_) == {"arc", "jsonl"}
    assert res_g["per_dataset"] == {"models": {}, "pooled_for": cal_g.group_fallback_, "certified": {}}
    plain = Calibrator("likelihood", C=0.3).fit(fit_scores, fit_labels)
    np.testing.assert_allclose(cal_g.predict_risk(fit_scores, fit_names), plain.predict_risk(fit_scores), rtol=1e-9)


def test_per_dataset_fits_and_certifies_each_kind_on_its_own_answers(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from guarduq.calibration.groups import certify_groups, group_starts
    from guarduq.calibration.splits import split_of

    for name, n in (("arc", 150), ("csqa", 160)):  # one multiple-choice format, two kinds
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({**r, "id": f"{name}{r['id']}"}) + "\n" for r in _arc_rows(n)))
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--model", str(tiny_model_dir), "--no-progress", "--runs-dir", str(tmp_path / "runs"),
                 "--allow-uncertified", "--dataset", "arc", "--data", str(tmp_path / "arc.jsonl"),
                 "--dataset", "commonsenseqa", "--data", str(tmp_path / "csqa.jsonl"), "--alpha", "0.7",
                 "--alpha", "0.8", "--features", "likelihood", "--C", "0.3", "--per-dataset", "--json",
                 "--out", str(out)]) == 0
    res, cal = json.loads(capsys.readouterr().out), Calibrator.load(out)
    assert sorted(cal.group_models_) == ["arc", "commonsenseqa"] and cal.group_fallback_ == {}
    by: dict[str, dict[str, list]] = {"fit": {}, "threshold": {}}
    for cache in (tmp_path / "runs" / "cache").rglob("*.jsonl"):
        for r in ScoreCache(cache).entries.values():
            if r.usable and (part := split_of(r.id)) in by:
                for key, value in (("scores", r.scores), ("wrong", 1 - int(r.label)), ("kind", r.dataset)):
                    by[part].setdefault(key, []).append(value)
    # Each kind's certificate, by hand: the Mondrian test on that kind's threshold-split answers,
    # risk from its own model, each test's start learned on the fit split.
    fit, held = by["fit"], by["threshold"]
    starts = group_starts(cal.predict_risk(fit["scores"], fit["kind"]), np.array(fit["wrong"]), fit["kind"],
                          (0.7, 0.8), 0.1)
    want = certify_groups(cal.predict_risk(held["scores"], held["kind"]), held["wrong"], held["kind"], (0.7, 0.8),
                          0.1, starts)
    assert cal.group_thresholds_ == want
    assert res["per_dataset"]["certified"] == {g: {str(t.alpha): t.threshold for t in ts} for g, ts in want.items()}
    assert [t.n for t in want["arc"]] == [held["kind"].count("arc")] * 2


def test_guard_serves_a_p_true_calibrator(llama, tokenizer) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from guarduq import Guard
    from guarduq.scoring.baselines import PTrue

    guard = Guard((llama, tokenizer), max_new_tokens=4)
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 200)
    dicts = [{"aleatoric": float(a), "p_true": float(v), "valid": True}
             for a, v in zip(rng.uniform(0, 0.25, 200), p, strict=True)]
    labels = (rng.uniform(size=200) < p).astype(int)  # higher P(True), more often right
    guard.calibrator = Calibrator("aleatoric,p_true", C=1.0, model_name="tiny",
                                  model_fingerprint=guard.info.fingerprint).fit(dicts, labels)
    r = guard.guarded("Name a colour.", "Blue")
    expected = guard.calibrator.risk({**r.scores.to_dict(), "p_true": PTrue().true_prob(guard, "Name a colour.", "Blue")})
    assert r.risk == pytest.approx(expected) and r.risk < 1.0
    # A chat-message prompt gives no question string for P(True): the risk fails closed.
    chat = guard.guarded([{"role": "user", "content": "Name a colour."}], "Blue")
    assert chat.risk == 1.0
