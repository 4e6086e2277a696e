"""Fuzz policy YAML: random text and documents, and mutations of the shipped policies."""

from __future__ import annotations

import copy
import functools
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from guarduq.errors import GuardUQError
from guarduq.policy import Decision, Policy
from tests.unit.fuzz_support import clean, examples, json_values, junk, texts

pytestmark = pytest.mark.fuzz

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "policies").glob("*.yaml"))
SIGNALS = ["risk", "risk_threshold", "epistemic", "aleatoric", "mean_token_prob", "mean_logprob",
           "min_token_prob", "mean_entropy", "n_tokens", "epistemic_z", "aleatoric_z", "valid"]


@functools.cache
def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="guarduq-fuzz-policy-"))


class MemorySink:
    def __init__(self) -> None:
        self.cases: list[Any] = []

    def send(self, case: Any) -> None:
        self.cases.append(case)


class FakeOpinion:
    def __init__(self, mean_prob: Any) -> None:
        self.mean_prob, self.variance, self.mutual_information, self.agrees = mean_prob, 0.01, 0.02, None

    def second_opinion(self, prompt: Any, response: str) -> Any:
        return self


def _load(raw: bytes) -> Policy | GuardUQError:
    path = workdir() / "policy.yaml"
    path.write_bytes(raw)
    return clean("policy.from_yaml", Policy.from_yaml, path)


def _exercise(policy: Policy, signals: dict[str, Any], so: Any) -> None:
    """A policy that loaded decides any signals: a Decision, or a GuardUQError naming the fault."""
    assert policy.name and isinstance(policy.identity(), dict)
    sinks = {name: MemorySink() for name in policy.config.sinks}
    bound = clean("policy.bind", policy.bind, sinks=sinks, second_opinion=FakeOpinion(so))
    if isinstance(bound, GuardUQError):
        return
    d = clean("policy.decide", bound.decide, signals, prompt="q", response="a")
    if not isinstance(d, GuardUQError):
        assert isinstance(d, Decision) and isinstance(d.text, str)
        assert d.action in {"allow", "abstain", "escalate"}


signal_values = st.dictionaries(
    st.sampled_from(SIGNALS),
    st.one_of(st.floats(), st.floats(0, 1), st.integers(), st.booleans(), st.none(), texts),
    max_size=6,
)


@examples(500)
@given(text=texts, encoding=st.sampled_from(["utf-8", "utf-16", "latin-1", "surrogatepass"]))
@example(text="a: &a [*a, *a]\nb: *a\n", encoding="utf-8")
@example(text="a: &a [1,2]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
         "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n", encoding="utf-8")
@example(text="[" * 10_000, encoding="utf-8")
@example(text="\ud800: x", encoding="surrogatepass")
def test_random_text(text: str, encoding: str) -> None:
    if encoding == "surrogatepass":
        raw = text.encode("utf-8", "surrogatepass")
    else:
        raw = text.encode(encoding, "replace") if encoding == "latin-1" else text.encode(encoding, "surrogatepass")
    _load(raw)


@examples(500)
@given(doc=json_values, signals=signal_values, so=st.floats())
def test_random_documents(doc: Any, signals: dict[str, Any], so: float) -> None:
    policy = _load(yaml.safe_dump(doc, allow_unicode=True).encode("utf-8", "surrogatepass"))
    if isinstance(doc, dict):
        clean("policy.from_dict", Policy.from_dict, doc)
    if isinstance(policy, Policy):
        _exercise(policy, signals, so)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        node = node[p]
    return node


@st.composite
def mutated_policies(draw: st.DrawFn) -> tuple[Any, str]:
    path = draw(st.sampled_from(SHIPPED))
    doc = copy.deepcopy(yaml.safe_load(path.read_text()))
    for _ in range(draw(st.integers(1, 2))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        target = draw(st.sampled_from(paths))
        parent, key = _get(doc, target[:-1]), target[-1]
        op = draw(st.sampled_from(["delete", "replace", "swap", "unicode", "wrap", "number"]))
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = draw(junk.filter(lambda v: not isinstance(v, bytes | tuple)) | json_values)
        elif op == "swap":
            other = draw(st.sampled_from(paths))
            try:
                a, b = _get(doc, target), _get(doc, other)
                parent[key], _get(doc, other[:-1])[other[-1]] = copy.deepcopy(b), copy.deepcopy(a)
            except (KeyError, IndexError, TypeError):
                pass  # the other path vanished with an earlier mutation
        elif op == "unicode":
            parent[key] = draw(texts) + str(parent[key]) + draw(texts)
        elif op == "wrap":
            parent[key] = [parent[key]]
        else:
            parent[key] = draw(st.sampled_from([math.nan, math.inf, -1, 0, 1e308, 10**30, -0.5, True]))
    return doc, path.name


@examples(400)
@given(case=mutated_policies(), signals=signal_values, so=st.floats(0, 1))
def test_mutated_shipped_policies(case: tuple[Any, str], signals: dict[str, Any], so: float) -> None:
    doc, _ = case
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    policy = _load(text.encode("utf-8", "surrogatepass"))
    if isinstance(policy, Policy):
        _exercise(policy, signals, so)


@examples(300)
@given(which=st.sampled_from(SHIPPED), cut=st.floats(0, 1), insert=texts,
       encoding=st.sampled_from(["utf-8", "utf-16", "utf-8-sig", "latin-1"]))
def test_truncated_and_spliced_shipped_policies(which: Path, cut: float, insert: str, encoding: str) -> None:
    text = which.read_text()
    at = int(cut * len(text))
    spliced = text[:at] + insert + text[at:]
    raw = spliced.encode(encoding, "surrogatepass" if encoding.startswith("utf") else "replace")
    _load(raw)
    _load(raw[: int(cut * len(raw))])


@functools.cache
def shipped(path: Path) -> Policy:
    return Policy.from_yaml(path)


@examples(400)
@given(which=st.sampled_from(SHIPPED), signals=signal_values, so=st.one_of(st.floats(), junk))
def test_shipped_policies_decide_any_signals(which: Path, signals: dict[str, Any], so: Any) -> None:
    _exercise(shipped(which), signals, so)


def test_shipped_policies_load_unchanged() -> None:
    for path in SHIPPED:
        assert isinstance(_load(path.read_bytes()), Policy), path


@examples(100)
@given(name=texts)
def test_any_path(name: str) -> None:
    clean("policy.from_yaml", Policy.from_yaml, workdir() / "odd" / name)
