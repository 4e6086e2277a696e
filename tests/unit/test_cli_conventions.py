"""CLI conventions: ``--input -`` reads standard input; every command's ``--help`` has an example."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from guarduq.cli import build_parser, main
from tests.conftest import tiny_llama

PAIRS = '{"id": "a", "prompt": "Hi", "response": "Yo"}\n\n{"id": "b", "prompt": "Q", "response": "A"}\n'


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_score_input_dash_reads_stdin_like_a_file(model_dir, tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(PAIRS)
    assert main(["score", "--model", model_dir, "--input", str(src)]) == 0
    from_file = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    monkeypatch.setattr(sys, "stdin", io.StringIO(PAIRS))
    assert main(["score", "--model", model_dir, "--input", "-"]) == 0
    from_stdin = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in from_stdin] == ["a", "b"]
    for a, b in zip(from_file, from_stdin, strict=True):
        assert a["epistemic"] == pytest.approx(b["epistemic"], rel=1e-9)


@pytest.mark.parametrize(("text", "needle"), [("", "<stdin> has no requests"),
                                               ('{"prompt": "Hi"}\n', "<stdin>:1: response")])
def test_bad_stdin_is_one_line(text, needle, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["score", "--model", "no-such-model", "--input", "-"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_score_input_dash_in_a_pipe(model_dir):
    proc = subprocess.run([sys.executable, "-m", "guarduq", "score", "--model", model_dir, "--input", "-"],
                          input=PAIRS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x)["id"] for x in proc.stdout.splitlines()] == ["a", "b"]


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_command_help_shows_an_example():
    found = list(_parsers(build_parser()))
    names = {" ".join(p) for p, _ in found}
    assert {"", "score", "generate", "demo", "calibrate", "evaluate", "report", "policy",
            "policy check", "policy explain", "sve", "sve train"} <= names
    for path, parser in found:
        text = parser.format_help()
        assert "example" in text, f"guarduq {' '.join(path)} --help has no example"
        examples = text.split("example", 1)[1].splitlines()[1:]
        # Each example is a runnable command of this very (sub)command, not just any text.
        assert examples and examples[0].strip().startswith(" ".join(("guarduq", *path)))


def test_help_exits_zero_and_prints_the_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", "--help"])
    assert exit_.value.code == 0
    assert "guarduq calibrate --dataset" in capsys.readouterr().out


def test_cli_logging_follows_stderr_after_the_first_stream_is_closed(monkeypatch):
    """A host calling main() repeatedly (or test capture) replaces sys.stderr; the handler set up
    under the first one must not write to it once it is closed (a "Logging error" traceback)."""
    import contextlib
    import logging

    from guarduq import _logging

    monkeypatch.setattr(_logging._STDLIB, "handlers", [])
    first, second = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(first):
        _logging.configure_cli_logging(logging.WARNING)
    first.close()
    with contextlib.redirect_stderr(second):
        _logging.get_logger("test").warning("still_heard")
    assert "still_heard" in second.getvalue() and "Traceback" not in second.getvalue()


MODEL_COMMANDS = (["score"], ["generate"], ["demo"], ["calibrate"], ["evaluate"], ["policy", "explain"],
                  ["serve"], ["sve", "train"])


def _subparser(parser: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", MODEL_COMMANDS, ids=" ".join)
def test_every_command_that_runs_a_model_takes_threads(path):
    flags = {s for a in _subparser(build_parser(), path)._actions for s in a.option_strings}
    assert "--threads" in flags and "--model" in flags


def test_threads_sets_torchs_threads_and_refuses_zero(model_dir, capsys):
    import torch

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        assert main(["score", "--model", model_dir, "--prompt", "Hi", "--response", "Yo",
                     "--threads", str(want)]) == 0
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
    assert main(["score", "--model", model_dir, "--prompt", "Hi", "--response", "Yo", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_a_calibrator_names_the_model_to_load(tmp_path):
    """serve, demo and policy explain load the model a calibrator was fitted for, without --model."""
    from guarduq.aliases import DEFAULT_MODEL
    from guarduq.calibration import Calibrator
    from guarduq.cli._run import model_of

    def saved(name: str, **kw: str) -> Path:
        cal = Calibrator("paper", model_name=name, model_fingerprint="f" * 32, **kw)
        cal.fit([{"epistemic": float(e), "aleatoric": 0.1 + e / 100} for e in range(1, 41)], [i % 2 for i in range(40)])
        path = tmp_path / f"{name}.json"
        cal.save(path)
        return path

    gguf = saved("my-model", model_source="/models/my-model.gguf")
    assert model_of(None, calibrator=gguf) == "/models/my-model.gguf"
    assert model_of("explicit", calibrator=gguf) == "explicit"
    policy = tmp_path / "p.yaml"
    policy.write_text(f"name: p\nversion: 2\ncalibrator: {saved('qwen2.5-coder-1.5b-instruct').name}\nalpha: 0.3\n"
                      "rules:\n  - name: all\n    action: allow\n")
    assert model_of(None, policy=policy) == "qwen2.5-coder-1.5b-instruct"  # an alias, recorded by name
    assert model_of(None, calibrator=saved("some-gguf-stem")) == DEFAULT_MODEL  # neither: the default
    assert model_of(None) == DEFAULT_MODEL


def test_the_command_table_names_the_module_that_registers_each_command():
    import importlib

    from guarduq.cli import COMMANDS

    registered = {}
    for module in dict.fromkeys(COMMANDS.values()):
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        registered.update(dict.fromkeys(sub.choices, module))
    assert registered == COMMANDS


def test_the_review_command_starts_without_torch_or_sklearn():
    code = ("import sys\nfrom guarduq.cli import main\n"
            "try:\n    main(['review', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'sklearn', 'transformers', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "--store URL" in out.stdout
