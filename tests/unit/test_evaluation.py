"""Running a guard over a dataset: labelling flow, the resumable cache, and the calibration CLI.

A fake guard (deterministic, no model) checks the per-kind flow; a tiny random Llama saved to a
folder runs the real ``Guard`` in a subprocess that is killed midway, and the CLI end to end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from guarduq.batching import chunked
from guarduq.calibration.datasets import load_dataset
from guarduq.calibration.evaluation import ScoreCache, score_dataset
from guarduq.cli import main
from guarduq.errors import CacheCorruptError, InputError
from guarduq.scoring.uncertainty import Scores
from tests.conftest import make_tokenizer, tiny_llama

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class _Info:
    name: str = "fake"
    fingerprint: str = "f" * 32


@dataclass(frozen=True)
class _Reply:
    text: str
    scores: Scores
    ended: bool = True


def _scores(x: float) -> Scores:
    return Scores(x, x / 4, 1 - x / 2, -x, 0.5, 1.0, 3, (0.5, 0.5, 0.5), 100)


class FakeGuard:
    """Answers from a lookup table; option probabilities from a table; records every call."""

    def __init__(self, answers: dict[str, str] | None = None, option_probs: dict[str, list[float]] | None = None,
                 fingerprint: str = "f" * 32) -> None:
        self.info = _Info(fingerprint=fingerprint)
        self.answers = answers or {}
        self.table = option_probs or {}
        self.calls: list[tuple[str, Any]] = []
        self.tokenizer = None

    def generate(self, prompt: str, **kwargs: Any) -> _Reply:
        self.calls.append(("generate", kwargs))
        if "TOO LONG" in prompt:
            raise InputError("prompt is longer than the model's context")
        text = next((a for q, a in self.answers.items() if q in prompt), "no idea")
        return _Reply(text, _scores(len(text) / 10))

    def score(self, prompt: str, response: str, *, ended: bool = True) -> Scores:
        self.calls.append(("score", response) if ended else ("score", response, "open"))
        return _scores(len(response) / 10)

    def generate_batch(self, prompts: list[str], *, batch_size: int | None = None, **kwargs: Any) -> list[_Reply]:
        return [self.generate(p, **kwargs) for p in prompts]

    def score_batch(self, pairs: list[tuple[str, str]], *, ended: bool | list[bool] = True) -> list[Scores]:
        flags = [ended] * len(pairs) if isinstance(ended, bool) else ended
        return [self.score(p, r, ended=e) for (p, r), e in zip(pairs, flags, strict=True)]

    def option_probs(self, prompt: str, options: list[str], *, ended: bool = True) -> list[float]:
        self.calls.append(("option_probs", tuple(options)) if ended else
                          ("option_probs", tuple(options), "open"))
        return next((p for q, p in self.table.items() if q in prompt), [0.1] * len(options))


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- per-kind flow


def test_qa_items_are_generated_then_labelled(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"id": "1", "question": "Who wrote Hamlet?", "answers": ["William Shakespeare", "Shakespeare"]},
        {"id": "2", "question": "Capital of Peru?", "answers": ["Lima"]},
        {"id": "3", "question": "TOO LONG question", "answers": ["x"]},
    ])
    guard = FakeGuard({"Hamlet": "It was Shakespeare.", "Peru": "Cusco"})
    recs = score_dataset(guard, load_dataset("triviaqa", path).items, progress=False, max_new_tokens=24)
    assert [r.label for r in recs] == [1, 0, None]
    assert recs[0].response == "It was Shakespeare." and recs[0].scores["epistemic"] == pytest.approx(1.9)
    assert guard.calls[0] == ("generate", {"max_new_tokens": 24})
    # The item the model could not take is recorded with its reason, not raised.
    assert recs[2].error and "context" in recs[2].error and not recs[2].usable


def test_mc_items_choose_the_argmax_and_score_that_option(tmp_path: Path) -> None:
    row = {"id": "m", "question": {"stem": "Which is a mammal?", "choices": [
        {"label": "A", "text": "shark"}, {"label": "B", "text": "whale"}, {"label": "C", "text": "trout"}]},
        "answerKey": "B"}
    path = write_jsonl(tmp_path / "a.jsonl", [row, {**row, "id": "n"}])
    items = load_dataset("arc", path).items
    guard = FakeGuard(option_probs={"mammal": [0.2, 0.7, 0.1]})
    recs = score_dataset(guard, items[:1], progress=False)
    assert recs[0].choice == 1 and recs[0].response == "whale" and recs[0].label == 1
    assert ("score", "whale") in guard.calls
    guard.table = {"mammal": [0.6, 0.3, 0.1]}
    rec = score_dataset(guard, items[1:], progress=False)[0]
    assert rec.choice == 0 and rec.label == 0 and rec.option_probs == [0.6, 0.3, 0.1]


def test_fewshot_mc_options_end_with_the_stop_string_not_end_of_turn(tmp_path: Path) -> None:
    row = {"id": "m", "question": {"stem": "Which is a mammal?", "choices": [
        {"label": "A", "text": "shark"}, {"label": "B", "text": "whale"}]}, "answerKey": "B"}
    path = write_jsonl(tmp_path / "a.jsonl", [row])
    guard = FakeGuard(option_probs={"mammal": [0.2, 0.7]})
    (rec,) = score_dataset(guard, load_dataset("arc", path, prompt_style="fewshot").items,
                           progress=False)
    # As generation would end the answer: a leading space (continuing "A:"), then the newline.
    assert ("option_probs", (" shark\n", " whale\n"), "open") in guard.calls
    assert ("score", " whale\n", "open") in guard.calls
    assert rec.response == " whale\n" and rec.ended is False and rec.label == 1


def test_labelled_items_are_scored_as_given(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "2+2?", "response": "4", "label": 1},
                                              {"prompt": "2+3?", "response": "six", "label": 0}])
    guard = FakeGuard()
    recs = score_dataset(guard, load_dataset("jsonl", path).items, progress=False)
    assert [(r.response, r.label) for r in recs] == [("4", 1), ("six", 0)]
    assert [c for c in guard.calls if c[0] != "score"] == []


# --------------------------------------------------------------------------- the cache


def _labelled(tmp_path: Path, n: int) -> Path:
    return write_jsonl(tmp_path / "l.jsonl", [
        {"id": str(i), "prompt": f"question {i}?", "response": f"answer {i}", "label": i % 2} for i in range(n)
    ])


def test_rerun_skips_cached_items_and_new_model_rescoring(tmp_path: Path) -> None:
    items = load_dataset("jsonl", _labelled(tmp_path, 6)).items
    cache = tmp_path / "cache.jsonl"
    first = FakeGuard()
    score_dataset(first, items[:4], cache, progress=False, batch_size=2)
    second = FakeGuard()
    recs = score_dataset(second, items, cache, progress=False, batch_size=2)
    assert len(second.calls) == 2 and len(recs) == 6
    assert [r.id for r in recs] == [i.id for i in items]
    # Another model (fingerprint) scores everything again, into the same file.
    other = FakeGuard(fingerprint="0" * 32)
    score_dataset(other, items, cache, progress=False)
    assert len(other.calls) == 6
    lines = [json.loads(x) for x in cache.read_text().splitlines()]
    assert len(lines) == 12 and len({(x["id"], x["model_fingerprint"]) for x in lines}) == 12
    for key in ("id", "prompt_hash", "model_fingerprint", "response", "label", "scores"):
        assert key in lines[0]


def test_a_partly_cached_batch_is_scored_whole_and_appends_only_what_was_missing(tmp_path: Path) -> None:
    """Batches are fixed slices of the items, so a resumed run pads (and rounds) as an uninterrupted one."""
    items = load_dataset("jsonl", _labelled(tmp_path, 6)).items
    cache = tmp_path / "cache.jsonl"
    score_dataset(FakeGuard(), items[:2], cache, progress=False, batch_size=2)
    before = cache.read_text()
    g = FakeGuard()
    recs = score_dataset(g, items, cache, progress=False, batch_size=4)
    assert [c[1] for c in g.calls] == [f"answer {i}" for i in range(6)]  # slices [0..3] and [4, 5]
    assert [r.id for r in recs] == [i.id for i in items]
    lines = cache.read_text().splitlines()
    assert cache.read_text().startswith(before) and len(lines) == 6
    assert len({json.loads(x)["id"] for x in lines}) == 6


def test_one_id_in_two_prompt_styles_gets_two_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": "1", "question": "Capital of Peru?", "answers": ["Lima"]}])
    items = [*load_dataset("triviaqa", path).items, *load_dataset("triviaqa", path, prompt_style="fewshot").items]
    recs = score_dataset(FakeGuard(), items, tmp_path / "c.jsonl", progress=False)
    assert [r.prompt_hash for r in recs] == [i.prompt_hash for i in items]
    assert recs[0].prompt_hash != recs[1].prompt_hash  # two prompts, two records


def test_changed_prompt_is_rescored(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": "1", "question": "Capital of Peru?", "answers": ["Lima"]}])
    cache = tmp_path / "c.jsonl"
    score_dataset(FakeGuard(), load_dataset("triviaqa", path).items, cache, progress=False)
    g = FakeGuard()
    score_dataset(g, load_dataset("triviaqa", path, prompt_style="fewshot").items, cache, progress=False)
    assert len(g.calls) == 1


def test_torn_last_line_is_dropped_and_the_file_repaired(tmp_path: Path) -> None:
    items = load_dataset("jsonl", _labelled(tmp_path, 3)).items
    cache = tmp_path / "cache.jsonl"
    score_dataset(FakeGuard(), items[:2], cache, progress=False, batch_size=1)
    with open(cache, "a") as f:
        f.write('{"id": "jsonl:2", "prompt_ha')  # killed mid-write
    g = FakeGuard()
    recs = score_dataset(g, items, cache, progress=False, batch_size=1)
    assert len(g.calls) == 1 and len(recs) == 3
    lines = cache.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(x) for x in lines)


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    items = load_dataset("jsonl", _labelled(tmp_path, 2)).items
    cache = tmp_path / "cache.jsonl"
    score_dataset(FakeGuard(), items, cache, progress=False)
    cache.write_bytes(cache.read_bytes().rstrip(b"\n"))
    assert len(ScoreCache(cache).entries) == 2 and cache.read_bytes().endswith(b"\n")


def test_read_only_cache_leaves_a_line_in_flight_alone(tmp_path: Path) -> None:
    items = load_dataset("jsonl", _labelled(tmp_path, 2)).items
    cache = tmp_path / "cache.jsonl"
    score_dataset(FakeGuard(), items[:1], cache, progress=False)
    with open(cache, "a") as f:
        f.write('{"id": "jsonl:1", "prompt_ha')  # a writer is half-way through this line
    before = cache.read_bytes()
    reader = ScoreCache(cache, read_only=True)
    assert len(reader.entries) == 1 and cache.read_bytes() == before
    with pytest.raises(RuntimeError):
        reader.append(next(iter(reader.entries.values())))


def test_corruption_inside_the_cache_is_an_error(tmp_path: Path) -> None:
    items = load_dataset("jsonl", _labelled(tmp_path, 3)).items
    cache = tmp_path / "cache.jsonl"
    score_dataset(FakeGuard(), items, cache, progress=False)
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    with pytest.raises(CacheCorruptError, match="line 2"):
        ScoreCache(cache)


# --------------------------------------------------------------------------- real tiny model


WORKER = textwrap.dedent(
    """
    import sys, time
    from guarduq import Guard
    from guarduq.calibration.datasets import load_dataset
    from guarduq.calibration.evaluation import score_dataset

    model, data, cache, delay, batch_size = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
    guard = Guard(model)
    real_score_batch = guard.score_batch
    def slow_score_batch(pairs, **k):  # slow enough that the test can kill it midway
        time.sleep(delay * len(pairs))
        return real_score_batch(pairs, **k)
    guard.score_batch = slow_score_batch
    score_dataset(guard, load_dataset("jsonl", data).items, cache, progress=False, batch_size=batch_size)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])
def test_resume_after_killed_run_scores_no_item_twice(tmp_path: Path, tiny_model_dir: Path, batch_size: int) -> None:
    """A kill loses at most the batch in flight; the rerun scores exactly the missing items."""
    from guarduq import Guard

    n = 16
    data = _labelled(tmp_path, n)
    cache = tmp_path / "cache.jsonl"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(tiny_model_dir), str(data), str(cache), "0.3", str(batch_size)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        # A whole first batch, so a kill mid-append of a batch still leaves one slice complete.
        if cache.exists() and cache.read_text().count("\n") >= max(3, batch_size):
            break
        if proc.poll() is not None:
            pytest.fail(f"worker ended early: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(ScoreCache(cache).entries)
    assert 3 <= done_before < n, "the kill should land midway"

    guard = Guard(str(tiny_model_dir))
    scored: list[str] = []
    real_score_batch = guard.score_batch

    def counting_score_batch(pairs: list[tuple[Any, str]], **kw: Any) -> list[Scores]:
        scored.extend(r for _, r in pairs)
        return real_score_batch(pairs, **kw)

    guard.score_batch = counting_score_batch  # type: ignore[method-assign]
    items = load_dataset("jsonl", data).items
    before = ScoreCache(cache)
    # Only the fixed slices with a missing item are scored again (whole, so they pad as before).
    expected = sum(len(b) for b in chunked(items, batch_size)
                   if any(before.get(i, guard.info.fingerprint) is None for i in b))
    recs = score_dataset(guard, items, cache, progress=False, batch_size=batch_size)
    assert len(scored) == expected < n and len(recs) == n
    ids = [json.loads(x)["id"] for x in cache.read_text().splitlines()]
    assert len(ids) == n and max(Counter(ids).values()) == 1
    # The resumed run and the killed one scored with the same model (same fingerprint).
    assert len({json.loads(x)["model_fingerprint"] for x in cache.read_text().splitlines()}) == 1


@pytest.mark.slow
def test_cli_calibrate_evaluate_report(tmp_path: Path, tiny_model_dir: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # Labels follow the response length, so the tiny model's scores carry some signal.
    rows = [{"id": str(i), "prompt": f"Say something {i}", "response": "ok" if i % 3 else "a much longer reply " * 2,
             "label": int(i % 3 != 0)} for i in range(45)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "cal.json"
    common = ["--dataset", "jsonl", "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    rc = main(["calibrate", "--model", str(tiny_model_dir), *common, "--alpha", "0.2", "--alpha", "0.4",
               "--delta", "0.2", "--out", str(out), "--report", str(tmp_path / "rep")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "auc_risk" in text and "calibrator written" in text
    assert (tmp_path / "rep" / "report.html").exists()
    assert len(list((tmp_path / "runs" / "cache").rglob("*.jsonl"))) == 1

    rc = main(["evaluate", "--calibrator", str(out), "--model", str(tiny_model_dir), *common, "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 45
    assert set(res["auroc"]) >= {"epistemic", "aleatoric", "combined", "mean_logprob", "risk"}
    for key in ("accuracy", "ece_before", "ece_after", "brier", "aurc", "prr"):
        assert key in res
    assert res["accuracy"] == pytest.approx(30 / 45)
    assert [g["alpha"] for g in res["guarantees"]] == [0.2, 0.4]
    for g in res["guarantees"]:
        assert set(g) >= {"alpha", "delta", "threshold", "coverage", "error_rate", "held"}

    rc = main(["report", str(out), "--out", str(tmp_path / "rep2")])
    assert rc == 0 and (tmp_path / "rep2" / "risk_coverage.png").exists()


def test_cli_refuses_another_models_calibrator(tmp_path: Path, tiny_model_dir: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"id": str(i), "prompt": f"p{i}", "response": "r" * (1 + i % 5), "label": int(i % 5 > 1)} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    other = tmp_path / "other-model"
    tiny_llama(seed=1).save_pretrained(other)
    make_tokenizer().save_pretrained(other)
    common = ["--dataset", "jsonl", "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    cal = tmp_path / "cal.json"
    assert main(["calibrate", "--model", str(tiny_model_dir), *common, "--out", str(cal), "--json",
                 "--test-fraction", "0.25", "--threshold-fraction", "0.25", "--allow-uncertified"]) == 0
    n_test = json.loads(capsys.readouterr().out)["split_sizes"]["test"]
    # --split test re-uses the calibrator's own split fractions, so it sees exactly its test items.
    assert main(["evaluate", "--calibrator", str(cal), "--model", str(tiny_model_dir), *common, "--json",
                 "--split", "test"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == n_test
    # Without --model the calibrator finds its model again from where it records it (an absolute
    # path), whatever the working directory.
    assert json.loads(cal.read_text())["model"]["source"] == str(tiny_model_dir.resolve())
    monkeypatch.chdir(tmp_path / "runs")
    assert main(["evaluate", "--calibrator", str(cal), *common, "--json", "--split", "test"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == n_test
    assert main(["evaluate", "--calibrator", str(cal), "--model", str(other), *common, "--json"]) == 2
    err = capsys.readouterr().err  # names both models
    assert f"fitted for model '{tiny_model_dir.name}'" in err and "not for model 'other-model'" in err
    assert not (tmp_path / "runs" / "cache" / "other-model").exists()  # refused before scoring
    assert main(["evaluate", "--calibrator", str(cal), "--model", str(other), *common, "--json",
                 "--allow-mismatch"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset", "jsonl", "--dataset", "arc", "--data", "x.jsonl"], "come in pairs"),
        (["--dataset", "jsonl", "--data", "missing.jsonl"], "not found"),
        (["--dataset", "jsonl", "--data", "x.jsonl", "--alpha", "1.5"], "alpha"),
        (["--dataset", "jsonl", "--data", "x.jsonl", "--features", "vibes"], "unknown feature"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path: Path, argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "response": "r", "label": 1}])
    assert main(["calibrate", "--model", "no-such-model", *argv, "--out", "c.json"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_malformed_data_needs_the_flag(tmp_path: Path, tiny_model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.jsonl"
    good = [json.dumps({"id": str(i), "prompt": f"p{i}", "response": "r" * (1 + i % 4), "label": int(i % 4 > 1)})
            for i in range(40)]
    data.write_text("\n".join(good[:5] + ["{oops"] + good[5:]) + "\n")
    common = ["--dataset", "jsonl", "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--no-progress",
              "--model", str(tiny_model_dir), "--out", str(tmp_path / "c.json"),
              "--test-fraction", "0.25", "--threshold-fraction", "0.25"]
    assert main(["calibrate", *common]) == 2
    assert "line 6: malformed JSON" in capsys.readouterr().err
    assert main(["calibrate", *common, "--skip-malformed", "--allow-uncertified"]) == 0
