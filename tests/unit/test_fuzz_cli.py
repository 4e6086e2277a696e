"""Fuzz ``guarduq.cli.main(argv)`` in-process: argument vectors built from the parsers' own flags.

Each argv gets the real flags of a random (sub)command with values drawn from good ones (the
tiny model folder, small valid files), missing paths and junk. The CLI must return 0 or 2 with
one ``guarduq: error:`` line, or exit through argparse (status 0 for --help, 2 for usage);
never a traceback, and never a half-written output file.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guarduq.cli import build_parser, main
from tests.conftest import make_tokenizer, tiny_llama
from tests.unit.fuzz_support import COUNTS, OUTCOMES, alarm, examples, texts

pytestmark = pytest.mark.fuzz

# Flags left out: --ray starts a Ray cluster (tests/integration/test_distributed_real.py covers it).
SKIPPED_FLAGS = {"ray", "ray_cpus_per_actor"}
# Commands whose valid runs are long by design (8 prompts; SVE training): fuzzed with small settings.
BOUNDED = {("demo",): ["--max-new-tokens", "2"], ("sve", "train"): ["--steps", "1", "--members", "2"]}


@functools.cache
def files() -> dict[str, str]:
    """Small valid inputs for every kind of file argument, in a scratch folder."""
    d = Path(tempfile.mkdtemp(prefix="guarduq-fuzz-cli-"))
    tiny_llama().save_pretrained(d / "tiny")
    make_tokenizer().save_pretrained(d / "tiny")
    rows = [{"id": str(i), "prompt": f"p{i}", "response": "r" * (1 + i % 3), "label": i % 2} for i in range(12)]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "pairs.jsonl").write_text('{"prompt": "Hi", "response": "Yo"}\n')
    (d / "policy.yaml").write_text("name: p\nversion: 1\nrules:\n  - name: ok\n    action: allow\n")
    (d / "sst2.tsv").write_text("sentence\tlabel\ngood film\t1\nbad film\t0\n")
    return {k: str(d / k) for k in ("tiny", "data.jsonl", "pairs.jsonl", "policy.yaml", "sst2.tsv")} | {
        "dir": str(d), "missing": str(d / "no" / "such.file")}


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _parsers(sub, (*path, name))


COMMANDS = sorted(_parsers(build_parser()), key=lambda x: x[0])
numbers = st.one_of(st.integers(-3, 50).map(str), st.floats().map(str), st.sampled_from(["1e999", "0x10", ""]))


@st.composite
def value(draw: st.DrawFn, action: argparse.Action) -> str:
    """Mostly a plausible value for this flag; a quarter of the time a bad one."""
    f = files()
    if draw(st.integers(0, 3)) == 0:
        return draw(st.one_of(numbers, st.sampled_from([f["missing"], f["dir"], "no-such-model", "-"]),
                              texts.filter(lambda s: "\x00" not in s)))
    if action.choices is not None:
        return str(draw(st.sampled_from(sorted(action.choices))))
    if action.type is int:
        return str(draw(st.integers(1, 3)))
    if action.type is float:
        return draw(st.sampled_from(["0.2", "0.3", "0.5"]))
    if action.dest == "model":
        return f["tiny"]
    if action.dest == "data":
        return f["data.jsonl"]
    if action.type is not None:  # Path arguments
        return draw(st.sampled_from([f["data.jsonl"], f["pairs.jsonl"], f["policy.yaml"], f["sst2.tsv"], "-"]))
    return draw(texts.filter(lambda s: "\x00" not in s and not s.startswith("-")))


@st.composite
def argv(draw: st.DrawFn) -> tuple[list[str], tuple[str, ...]]:
    path, parser = draw(st.sampled_from(COMMANDS))
    out: list[str] = list(path)
    for action in parser._actions:
        if action.dest in SKIPPED_FLAGS:
            continue
        if isinstance(action, argparse._HelpAction):
            if draw(st.integers(0, 60)) == 0:
                out.append("--help")
            continue
        if not draw(st.integers(0, 30 if action.required or not action.option_strings else 2)):
            continue
        if action.option_strings:
            out.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0:
            n = 2 if action.nargs in ("+", "*") and draw(st.booleans()) else 1
            out += [draw(value(action)) for _ in range(n)]
    if draw(st.integers(0, 4)) == 0:
        out.insert(draw(st.integers(0, len(out))), draw(st.sampled_from(["--bogus", "-x", "--", "-v"]) | texts))
    out_files = []
    if any("--out" in a.option_strings for a in parser._actions):  # outputs go to fresh paths
        out_files = ["--out", str(Path(files()["dir"]) / "out" / draw(st.sampled_from(["cal.json", "sve.safetensors",
                                                                                       "rep"])))]
    model = ["--model", files()["tiny"]] if any(a.dest == "model" for a in parser._actions) else []
    return out + out_files + model + BOUNDED.get(path, []), path


@pytest.fixture(scope="module", autouse=True)
def _scratch_cwd() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(files()["dir"])
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("GUARDUQ_RUNS", str(Path(files()["dir"]) / "runs"))
        # `guarduq serve` validates, loads the model and builds the app, then would serve forever:
        # fuzz everything up to the bind (tests/unit/test_serve.py and the integration test serve).
        uvicorn = pytest.importorskip("uvicorn")
        mp.setattr(uvicorn, "run", lambda app, **kwargs: None)
        yield


def _leftovers(root: Path) -> list[Path]:
    """Temp files of an atomic write that a failure left behind."""
    return [p for p in root.rglob(".*") if p.is_file() and p.name.count(".") >= 2]


@examples(800)
@given(case=argv(), stdin=st.one_of(texts, st.just('{"prompt": "Hi", "response": "Yo"}\n')))
def test_cli_argv(case: tuple[list[str], tuple[str, ...]], stdin: str) -> None:
    args, path = case
    out_dir = Path(files()["dir"]) / "out"
    before = set(out_dir.rglob("*")) if out_dir.exists() else set()
    err, out = io.StringIO(), io.StringIO()
    COUNTS["cli.main"] += 1
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with alarm(120), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = main(args)
            except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
                rc = exc.code
                assert rc in (0, 2), f"argparse exit {rc}"
                OUTCOMES[f"cli.main: argparse exit {rc}"] += 1
                return
    finally:
        sys.stdin = old_stdin
    assert rc in (0, 2), f"{args} -> {rc}"
    OUTCOMES[f"cli.main: {' '.join(path)} rc={rc}"] += 1
    text = err.getvalue()
    assert "Traceback" not in text
    if rc == 2 and path == ("policy", "check"):  # a linter: one line per problem found
        assert text.strip()
    elif rc == 2:
        errors = [line for line in text.splitlines() if line.startswith("guarduq: error:")]
        assert len(errors) == 1 and len(errors[0]) > len("guarduq: error: "), text
        after = set(out_dir.rglob("*")) if out_dir.exists() else set()
        new = {p for p in after - before if p.is_file() and p.suffix in (".json", ".safetensors")}
        assert not new, f"a failed run left output files {new}"
    assert not _leftovers(Path(files()["dir"])), "a temp file of an atomic write was left behind"
