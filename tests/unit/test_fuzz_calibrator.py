"""Fuzz calibrator JSON artifacts: mutated, truncated, re-encoded, other models' fingerprints."""

from __future__ import annotations

import copy
import functools
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guarduq.calibration import Calibrator
from guarduq.errors import GuardUQError
from tests.unit.fuzz_support import clean, examples, json_values, texts

pytestmark = pytest.mark.fuzz

FP = "ab" * 16


@functools.cache
def artifact() -> tuple[Path, dict[str, Any]]:
    """A real fitted artifact (with evaluation data) to mutate."""
    rng = np.random.default_rng(0)
    log_e = rng.normal(0, 1, 400)
    wrong = rng.random(400) < 1 / (1 + np.exp(-2 * log_e))
    scores = [{"epistemic": math.exp(v), "aleatoric": float(a), "mean_logprob": -float(a), "valid": True}
              for v, a in zip(log_e, rng.uniform(0, 0.25, 400), strict=True)]
    cal = Calibrator("paper", C=1.0, model_name="tiny", model_fingerprint=FP)
    cal.fit(scores[:200], (~wrong[:200]).astype(int))
    cal.fit_thresholds(scores[200:300], (~wrong[200:300]).astype(int), alphas=(0.3, 0.5), delta=0.2)
    cal.attach_evaluation(cal.evaluate(scores[300:330], (~wrong[300:330]).astype(int), ["d"] * 30))
    d = Path(tempfile.mkdtemp(prefix="guarduq-fuzz-cal-"))
    cal.save(d / "cal.json")
    return d, json.loads((d / "cal.json").read_text())


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path[:-1]:
        doc = doc[p]
    return doc


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(artifact()[1])
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _parent(doc, path), path[-1]
        op = draw(st.sampled_from(["delete", "replace", "number", "wrap", "empty"]))
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = draw(json_values)
        elif op == "number":
            parent[key] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0, -1, 1e308, 10**40, 0.5, True]))
        elif op == "wrap":
            parent[key] = [parent[key]]
        else:
            parent[key] = type(parent[key])() if isinstance(parent[key], list | dict | str) else None
    return doc


def _check(raw: bytes, expected: str | None, allow: bool, scores: dict[str, Any]) -> None:
    d = artifact()[0]
    path = d / "fuzzed.json"
    path.write_bytes(raw)
    cal = clean("calibrator.load", Calibrator.load, path, expected_fingerprint=expected, allow_mismatch=allow)
    if isinstance(cal, GuardUQError):
        return
    if expected not in (None, cal.model_fingerprint, "") and cal.model_fingerprint and not allow:
        pytest.fail("another model's calibrator loaded without allow_mismatch")
    risk = clean("calibrator.risk", cal.risk, scores)
    if not isinstance(risk, GuardUQError):
        assert math.isnan(risk) or 0.0 <= risk <= 1.0
    for t in cal.thresholds_:
        clean("calibrator.threshold_for", cal.threshold_for, t.alpha)
    # What loaded saves and loads back to the same parameters.
    out = d / "roundtrip.json"
    if not isinstance(clean("calibrator.save", cal.save, out), GuardUQError):
        again = Calibrator.load(out)
        assert again.features == cal.features and again.thresholds_ == cal.thresholds_


score_dicts = st.dictionaries(
    st.sampled_from(["epistemic", "aleatoric", "mean_logprob", "mean_token_prob", "valid", "n_tokens"]),
    st.one_of(st.floats(), st.booleans(), st.none(), texts, st.integers()),
    max_size=6,
)
fingerprints = st.one_of(st.none(), st.just(FP), st.text(max_size=40), st.just("0" * 32))


@examples(600)
@given(doc=mutated(), expected=fingerprints, allow=st.booleans(), scores=score_dicts)
def test_mutated_artifacts(doc: dict[str, Any], expected: Any, allow: bool, scores: dict[str, Any]) -> None:
    raw = json.dumps(doc, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
    _check(raw, expected, allow, scores)


@examples(600)
@given(cut=st.floats(0, 1), flip=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=3),
       encoding=st.sampled_from(["utf-8", "utf-16", "utf-8-sig", "utf-32"]), expected=fingerprints,
       scores=score_dicts)
def test_truncated_and_corrupted_bytes(cut: float, flip: list[tuple[float, int]], encoding: str,
                                       expected: Any, scores: dict[str, Any]) -> None:
    raw = bytearray(json.dumps(artifact()[1]).encode(encoding))
    for where, byte in flip:
        raw[int(where * (len(raw) - 1))] = byte
    _check(bytes(raw[: max(0, int(cut * len(raw))) if cut < 0.5 else len(raw)]), expected, False, scores)


@examples(300)
@given(doc=json_values)
def test_random_json_documents(doc: Any) -> None:
    _check(json.dumps(doc, allow_nan=True).encode(), None, False, {})


@examples(100)
@given(name=texts)
def test_any_path(name: str) -> None:
    clean("calibrator.load", Calibrator.load, artifact()[0] / "odd" / name)
