"""CLI contract on a tiny model folder: JSON output, one-line errors, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from guarduq.cli import main
from tests.conftest import tiny_llama


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_score_json_contract(model_dir, capsys):
    assert main(["score", "--model", model_dir, "--prompt", "Hi", "--response", "Hello", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    for key in ("epistemic", "aleatoric", "mean_token_prob", "n_tokens", "valid", "model_fingerprint"):
        assert key in row
    assert row["aleatoric"] == pytest.approx(row["mean_token_prob"] * (1 - row["mean_token_prob"]))


def test_score_jsonl_one_line_per_request(model_dir, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi", "response": "Yo"}\n\n{"id": "b", "prompt": "Q", "response": "A"}\n')
    assert main(["score", "--model", model_dir, "--input", str(src)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]


def test_bad_jsonl_line_reports_line_number(model_dir, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Hi", "response": "Yo"}\n{"prompt": "Hi"}\n')
    assert main(["score", "--model", model_dir, "--input", str(src)]) == 2
    assert f"{src}:2: response" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt", "", "--response", "x"], "prompt is empty"),
        (["--prompt", "Hi", "--response", " "], "response is empty"),
        (["--prompt", "x" * 400, "--response", "y"], "longer than the model's context"),
    ],
)
def test_cli_bad_input_is_one_line_without_traceback(model_dir, args, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "guarduq", "score", "--model", model_dir, *args],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_cli_unknown_model_is_one_line(capsys):
    assert main(["score", "--model", "no-such-model", "--prompt", "a", "--response", "b"]) == 2
    err = capsys.readouterr().err
    assert "unknown model spec" in err and "Traceback" not in err


def test_score_input_batches_give_the_rows_of_batch_1(model_dir, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"Q{i}" * (i + 1), "response": "A" * (i + 1),
                                       "ended": i % 2 == 0}) + "\n" for i in range(5)))
    rows = {}
    for size in ("1", "3"):
        assert main(["score", "--model", model_dir, "--input", str(src), "--batch-size", size]) == 0
        rows[size] = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows["3"]] == list(range(5))
    for a, b in zip(rows["1"], rows["3"], strict=True):
        assert b["n_tokens"] == a["n_tokens"] and b["epistemic"] == pytest.approx(a["epistemic"], rel=1e-6)


@pytest.mark.parametrize(("flags", "needle"), [(["--device", "tpu"], "unknown device"),
                                               (["--dtype", "int4"], "unknown dtype"),
                                               (["--batch-size", "0"], "--batch-size must be >= 1")])
def test_bad_run_flags_are_one_line(model_dir, flags, needle, capsys):
    assert main(["score", "--model", model_dir, "--prompt", "a", "--response", "b", *flags]) == 2
    assert needle in capsys.readouterr().err
