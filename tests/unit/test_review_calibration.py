"""``guarduq calibrate --dataset reviews --store URL``: the fit takes every label (weighted by
1/pi), the certificate and the test only the uniform sample; too few labels are refused with
how many more are needed; bad flag combinations are one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from guarduq.calibration.splits import split_of  # noqa: E402
from guarduq.cli import main  # noqa: E402
from guarduq.store import Store  # noqa: E402
from guarduq.store.records import Sample  # noqa: E402
from tests.review.conftest import reply  # noqa: E402

UNIFORM = Sample(("uniform",), True, 0.5, 0.0, 0.5)
BAND = Sample(("band",), False, 0.5, 0.5, 0.75)
FRACTIONS = {"test_fraction": 0.3, "threshold_fraction": 0.3}


def labelled_store(path: Path, n_uniform: int, n_band: int, label_uniform_every: int = 1
                   ) -> tuple[str, list[str], list[str]]:
    """Replies with chat prompts; short answers right, long ones wrong (something to learn)."""
    url = f"sqlite:///{path}"
    store = Store(url)
    rng = np.random.default_rng(0)
    uniform, band = [], []
    for i in range(n_uniform + n_band):
        right = bool(rng.random() < 0.5)
        answer = "yes" if right else "it is " + "very " * int(rng.integers(2, 6)) + "unclear"
        r = reply(i, prompt=[{"role": "user", "content": f"question {i}?"}], response=answer)
        s = UNIFORM if i < n_uniform else BAND
        store.record(r, s)
        if i >= n_uniform or i % label_uniform_every == 0:
            store.add_label(r.request_id, reviewer="ann", label="right" if right else "wrong")
            (uniform if i < n_uniform else band).append(r.request_id)
    store.close()
    return url, uniform, band


def test_fit_takes_every_label_and_the_certificate_only_the_uniform_ones(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, uniform, band = labelled_store(tmp_path / "s.db", 60, 30)
    out = tmp_path / "cal.json"
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--dataset", "reviews", "--store", url,
               "--alpha", "0.6", "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--json", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(capsys.readouterr().out)
    in_fit = sum(split_of(f"reviews:{i}", **FRACTIONS) == "fit" for i in uniform)
    assert res["split_sizes"]["fit"] == in_fit + len(band)  # band items only ever fit
    assert res["split_sizes"]["threshold"] + res["split_sizes"]["test"] == len(uniform) - in_fit
    assert res["reviews"]["uniform"] == len(uniform)
    # the drift reference is the uniform sample (the band items over-represent the borderline)
    assert json.loads(out.read_text())["drift_reference"]["dataset"] == ["reviews"] * len(uniform)
    # pi_fit: uniform items rate*f + (1-rate)*0 = 0.2; band items 0.2 + 0.5*0.5 = 0.45
    assert res["reviews"]["weights"]["max_over_min"] == pytest.approx(0.45 / 0.2)
    # evaluate --split test takes the same held-out uniform items (band items were fit on)
    rc = main(["evaluate", "--calibrator", str(out), "--model", str(tiny_model_dir), "--dataset", "reviews",
               "--store", url, "--split", "test", "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--json"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["n"] == res["split_sizes"]["test"]


def test_weights_follow_the_share_of_each_stratum_that_was_labelled(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Half the uniform items labelled, every band item: pi_u = 0.5*0.4*0.5 = 0.1 and
    pi_band = 0.1 + 0.5*0.5*1 = 0.35, so band items weigh 1/3.5 of a uniform one."""
    url, uniform, band = labelled_store(tmp_path / "s.db", 120, 30, label_uniform_every=2)
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--dataset", "reviews", "--store", url,
               "--alpha", "0.6", "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--json",
               "--out", str(tmp_path / "cal.json")])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(capsys.readouterr().out)
    assert len(uniform) == 60 and res["reviews"]["uniform"] == 60
    assert res["reviews"]["weights"]["max_over_min"] == pytest.approx(0.35 / 0.1)


def test_too_few_uniform_labels_are_refused_with_how_many_more(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = labelled_store(tmp_path / "s.db", 12, 30)
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--dataset", "reviews", "--store", url,
               "--alpha", "0.3", "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "12 labels come from the uniform sample" in err and "label about 28 more" in err
    assert not (tmp_path / "c.json").exists()


def test_an_empty_threshold_split_is_refused_with_how_many_more(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Few uniform labels can leave a split empty by chance (each lands there with probability
    0.3): a refusal that says so and how many more labels fill it, not a bare "split is empty"."""
    url, uniform, _ = labelled_store(tmp_path / "s.db", 5, 30)
    where = [split_of(f"reviews:{i}", **FRACTIONS) for i in uniform]
    assert "threshold" not in where and "test" in where  # these five ids' hashes (the precondition)
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--dataset", "reviews", "--store", url,
               "--alpha", "0.6", "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--allow-uncertified",
               "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "none of the 5 labels of the uniform sample fell in the 'threshold' split" in err, err
    more = math.ceil(math.log(0.05) / math.log(1 - 0.3))  # (1 - 0.3)^k <= 5%
    assert f"probability 0.3): label about {more} more" in err and "'test' split" not in err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--dataset", "reviews"], "give --store URL"),
    (["--dataset", "reviews", "--store", "STORE", "--data", "x.jsonl"], "stands alone"),
    (["--dataset", "reviews", "--data", "x.jsonl", "--data", "x.jsonl"], "stands alone"),
    (["--dataset", "jsonl", "--data", "x.jsonl", "--store", "STORE"], "go with --dataset reviews"),
    (["--dataset", "reviews", "--store", "STORE", "--since", "last week"], "ISO 8601"),
    (["--dataset", "reviews", "--store", "EMPTY"], "no reviewed replies labelled"),
    (["--dataset", "reviews", "--store", "STORE", "--test-fraction", "0"], "must each be in (0, 1)"),
    (["--dataset", "jsonl", "--data", "x.jsonl", "--threshold-fraction", "0.7"], "with a sum below 1"),
])
def test_bad_review_flags_are_one_line(tmp_path: Path, tiny_model_dir: Path, argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    url, _, _ = labelled_store(tmp_path / "s.db", 3, 0)
    empty = Store(f"sqlite:///{tmp_path / 'empty.db'}")
    empty.close()
    (tmp_path / "x.jsonl").write_text('{"prompt": "p", "response": "r", "label": 1}\n')
    argv = [a.replace("STORE", url).replace("EMPTY", f"sqlite:///{tmp_path / 'empty.db'}")
            .replace("x.jsonl", str(tmp_path / "x.jsonl")) for a in argv]
    rc = main(["calibrate", "--model", str(tiny_model_dir), *argv, "--runs-dir", str(tmp_path / "runs"),
               "--no-progress", "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_since_keeps_recent_replies_only(tmp_path: Path, tiny_model_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    url, _, _ = labelled_store(tmp_path / "s.db", 60, 0)  # reply i is T0 + i minutes (March 2025)
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--dataset", "reviews", "--store", url,
               "--since", "2099-01-01", "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--out",
               str(tmp_path / "c.json")])
    assert rc == 2 and "since 2099-01-01" in capsys.readouterr().err


def test_each_traffic_group_with_the_labels_gets_its_own_certificate_and_a_small_one_none(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from guarduq.calibration import Calibrator

    url = f"sqlite:///{tmp_path / 'g.db'}"
    store = Store(url)
    rng = np.random.default_rng(3)
    sizes = {"legal": 150, "support": 150, "rare": 8}  # rare: too few uniform labels to certify
    i = 0
    for group, n in sizes.items():
        for _ in range(n):
            right = bool(rng.random() < 0.9)
            answer = "yes" if right else "it is " + "very " * int(rng.integers(2, 6)) + "unclear"
            r = reply(i, prompt=[{"role": "user", "content": f"question {i}?"}], response=answer, group=group)
            store.record(r, UNIFORM)
            store.add_label(r.request_id, reviewer="ann", label="right" if right else "wrong")
            i += 1
    store.close()
    out = tmp_path / "cal.json"
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--dataset", "reviews", "--store", url,
               "--alpha", "0.5", "--runs-dir", str(tmp_path / "runs"), "--no-progress", "--json", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(capsys.readouterr().out)
    groups = {g: ts[0] for g, ts in res["reviews"]["groups"].items()}
    assert set(groups) == set(sizes)
    assert groups["legal"]["threshold"] is not None and groups["support"]["threshold"] is not None
    assert groups["rare"]["threshold"] is None  # falls back: the policy's groups.fallback decides
    in_threshold = sum(split_of(f"reviews:req{j:04d}", **FRACTIONS) == "threshold" for j in range(150, 300))
    assert groups["support"]["n"] == in_threshold  # certified on its own threshold-split labels only
    cal = Calibrator.load(out)
    assert set(cal.group_thresholds_) == set(sizes) and cal.group_thresholds_["rare"][0].threshold is None
    # the drift reference holds each reply under its traffic group, so the live window can read
    # slice:<group> or unseen against them (under the dataset name alone: one group, no case)
    from collections import Counter

    from guarduq.calibration.drift import reference_from_artifact

    art = json.loads(out.read_text())
    assert Counter(art["drift_reference"]["dataset"]) == sizes
    grouped = reference_from_artifact(art).grouped
    assert grouped is not None and grouped.groups == ("legal", "support")  # rare: under MIN_GROUP items
