"""``guarduq calibrate`` never puts a calibrator that certifies nothing in place of ``--out``.

Every reply in these sets has the same prompt and answer, so every score and every risk is the
same: no risk threshold can set apart answers with fewer errors, and whether an alpha can be
certified depends on the labels alone. Which labels land in the threshold split is known from
the id hash (``split_of``), so the expected counts come from the documented arithmetic
(``sizing.labels_needed``) on the threshold split the test builds.
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from guarduq.calibration.sizing import labels_needed  # noqa: E402
from guarduq.calibration.splits import split_of  # noqa: E402
from guarduq.cli import main  # noqa: E402
from guarduq.store import Store  # noqa: E402
from guarduq.store.records import Sample  # noqa: E402
from tests.review.conftest import reply  # noqa: E402

UNIFORM = Sample(("uniform",), True, 1.0, 0.0, 1.0)
FRACTIONS = {"test_fraction": 0.2, "threshold_fraction": 0.2}
PROMPT = [{"role": "user", "content": "Is it so?"}]


def store_of(path: Path, n: int, wrong_in_threshold: float) -> tuple[str, int, int]:
    """``n`` uniform replies, all alike; in the threshold split a ``wrong_in_threshold`` share is
    labelled wrong, in the fit and test splits every other one. Returns (url, threshold items,
    wrong ones among them)."""
    url = f"sqlite:///{path}"
    store = Store(url)
    in_threshold: list[str] = []
    for i in range(n):
        r = reply(i, prompt=PROMPT, response="Maybe.")
        store.record(r, UNIFORM)
        if split_of(f"reviews:{r.request_id}", **FRACTIONS) == "threshold":
            in_threshold.append(r.request_id)
        else:
            store.add_label(r.request_id, reviewer="ann", label="wrong" if i % 2 else "right")
    n_wrong = round(wrong_in_threshold * len(in_threshold))
    for k, rid in enumerate(in_threshold):
        store.add_label(rid, reviewer="ann", label="wrong" if k < n_wrong else "right")
    store.close()
    return url, len(in_threshold), n_wrong


def calibrate(tmp_path: Path, model: Path, url: str, out: Path, *extra: str) -> list[str]:
    return ["calibrate", "--model", str(model), "--dataset", "reviews", "--store", url, "--alpha", "0.7",
            "--test-fraction", "0.2", "--threshold-fraction", "0.2", "--work", str(tmp_path / "work"),
            "--no-progress", "--json", "--out", str(out), *extra]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_thirty_labels_are_refused_and_the_live_file_is_untouched(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, n_thr, n_wrong = store_of(tmp_path / "s.db", 30, 0.5)
    live = tmp_path / "calibrator.json"
    live.write_text('{"the": "live calibrator"}\n')
    before, mtime = digest(live), live.stat().st_mtime_ns
    rc = main(calibrate(tmp_path, tiny_model_dir, url, live))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert digest(live) == before and live.stat().st_mtime_ns == mtime
    need = labels_needed(0.7, 0.1, FRACTIONS["threshold_fraction"], n_wrong / n_thr)
    assert need is not None and need > 30
    assert f"about {need - 30} more labels of the uniform sample needed" in err
    assert f"{live} is left unchanged" in err and "--allow-uncertified" in err


def test_no_number_of_labels_when_the_error_rate_is_above_alpha(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, n_thr, n_wrong = store_of(tmp_path / "s.db", 30, 1.0)
    assert n_wrong == n_thr > 0
    fresh = tmp_path / "new" / "calibrator.json"
    rc = main(calibrate(tmp_path, tiny_model_dir, url, fresh))
    err = capsys.readouterr().err
    assert rc == 2 and "no number of labels can certify it at this error rate" in err
    assert not fresh.exists() and f"{fresh} is not written" in err  # a fresh file is refused too


def test_allow_uncertified_writes_it_and_says_nothing_is_certified(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = store_of(tmp_path / "s.db", 30, 0.5)
    live = tmp_path / "calibrator.json"
    live.write_text("{}\n")
    rc = main(calibrate(tmp_path, tiny_model_dir, url, live, "--allow-uncertified"))
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["sha256"] == digest(live)
    assert [t["threshold"] for t in res["thresholds"]] == [None]


def test_refusal_holds_for_any_dataset(tmp_path: Path, tiny_model_dir: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A labelled JSONL (not reviews): 40 alike answers, every one in the threshold split wrong."""
    from guarduq.calibration.datasets import load_dataset

    data = tmp_path / "logs.jsonl"
    rows = [{"id": f"a{i}", "prompt": "Is it so?", "response": "Maybe.", "label": i % 2} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = [it.id for it in load_dataset("jsonl", data).items]
    for row, item_id in zip(rows, ids, strict=True):
        if split_of(item_id, test_fraction=0.3, threshold_fraction=0.3) == "threshold":
            row["label"] = 0
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    live = tmp_path / "calibrator.json"
    live.write_text("{}\n")
    rc = main(["calibrate", "--model", str(tiny_model_dir), "--dataset", "jsonl", "--data", str(data),
               "--alpha", "0.5", "--alpha", "0.7", "--work", str(tmp_path / "work"), "--no-progress",
               "--out", str(live)])
    err = capsys.readouterr().err
    assert rc == 2 and live.read_text() == "{}\n"
    assert "alpha=0.5: the threshold split is wrong 100% of the time" in err
    assert "alpha=0.7: the threshold split is wrong 100% of the time" in err


def test_the_reviews_export_is_private_under_the_work_folder(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = store_of(tmp_path / "s.db", 30, 0.5)
    main(calibrate(tmp_path, tiny_model_dir, url, tmp_path / "c.json", "--allow-uncertified"))
    capsys.readouterr()
    folder = tmp_path / "work" / "reviews"
    texts = [p for p in folder.rglob("*") if p.is_file()]
    assert any(p.name.startswith("reviews-") for p in texts)  # the export
    assert any("cache" in p.parts for p in texts)  # the scoring cache, which holds the replies
    for p in texts:
        assert "Maybe." in p.read_text()
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    outside = [p for p in (tmp_path / "work").rglob("*") if p.is_file() and folder not in p.parents]
    assert not [p for p in outside if "Maybe." in p.read_text()]  # no text outside the private folder


def test_calibrate_splits_as_the_policy_review_section_says(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One setting: `calibrate --policy` takes review.threshold_fraction (the fraction the review
    page counts with) and review.test_fraction, and refuses a flag that disagrees."""
    url, _, _ = store_of(tmp_path / "s.db", 30, 0.5)
    policy = tmp_path / "policy.yaml"
    policy.write_text("name: p\nversion: 1\ncalibrator: c.json\nalpha: 0.6\nreview: {rate: 1.0, keep_text: true, "
                      "threshold_fraction: 0.2, test_fraction: 0.2}\nrules:\n  - {name: all, action: allow}\n")
    out = tmp_path / "c.json"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--dataset", "reviews", "--store", url,
            "--policy", str(policy), "--work", str(tmp_path / "work"), "--no-progress", "--json",
            "--out", str(out), "--allow-uncertified"]
    assert main(argv) == 0, capsys.readouterr().err
    res = json.loads(capsys.readouterr().out)
    assert [t["alpha"] for t in res["thresholds"]] == [0.6]  # the policy's alpha
    assert json.loads(out.read_text())["split"] == FRACTIONS
    assert main([*argv, "--threshold-fraction", "0.3"]) == 2
    assert "--threshold-fraction 0.3 disagrees" in capsys.readouterr().err
