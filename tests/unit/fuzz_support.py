"""Shared pieces of the property-based fuzz tests (``tests/unit/test_fuzz_*.py``).

Every boundary test runs its input through :func:`clean`: the call either returns, or raises a
``GuardUQError`` with a message; any other exception fails the test, and a call that runs past
its alarm is a hang. :data:`COUNTS` tallies generated inputs per boundary; ``tests/conftest.py``
prints the tally at the end of the session. Example budgets scale with the hypothesis profile:
``ci`` (the default, for ``make test``) and ``fuzz`` (``make fuzz``, ``FUZZ_SCALE``x more).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st

from guarduq.errors import GuardUQError

COUNTS: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()  # how inputs ended, per boundary ("cli.main: rc=0", ...)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
FUZZ_SCALE = int(os.environ.get("FUZZ_SCALE", "20"))


def examples(n: int) -> settings:
    """``n // 2`` examples under the ``ci`` profile (a smoke level that keeps ``make test`` under
    its 10 minutes), ``FUZZ_SCALE * n`` under ``fuzz``."""
    return settings(max_examples=n * FUZZ_SCALE if PROFILE == "fuzz" else max(1, n // 2))


class Hang(AssertionError):
    """A boundary call ran past its alarm."""


@contextlib.contextmanager
def alarm(seconds: int) -> Iterator[None]:
    """Fail a call that runs longer than ``seconds`` (SIGALRM; the main thread only)."""

    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"call did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def clean(boundary: str, fn: Callable[..., Any], *args: Any, seconds: int = 60, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``'s result, or the ``GuardUQError`` it raised (never anything else)."""
    COUNTS[boundary] += 1
    with alarm(seconds):
        try:
            out = fn(*args, **kwargs)
        except GuardUQError as exc:
            assert str(exc).strip(), f"{type(exc).__name__} raised with an empty message"
            OUTCOMES[f"{boundary}: {type(exc).__name__}"] += 1
            return exc
    OUTCOMES[f"{boundary}: ok"] += 1
    return out


# ---------------------------------------------------------------- strategies

SPECIAL_STRINGS = [
    "", " ", "\n", "\t \r\n", "\x00", "\x1b[31m", "\ufeff", "\u200b", "\ud800", "a\udfffb",
    "<|im_start|>", "<|im_end|>", "</s>", "<pad>", "{{ messages }}", "{% endfor %}", "é", "😀" * 3,
    "null", "~", "- a", "key: value", "[1, 2", "{", "0x1F", ".nan", "-.inf", "yes", "NO",
]
MEGABYTE = "x" * 1_000_000

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
controls = st.characters(max_codepoint=0x9F, categories=["Cc"])
wild_chars = st.one_of(st.characters(), surrogates, controls)

texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=wild_chars, max_size=40),
    st.sampled_from(SPECIAL_STRINGS),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.binary(max_size=8), texts,
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(texts, st.integers()), inner, max_size=3),
    ),
    max_leaves=8,
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "", "USER", "bot"]), scalars)
messages = st.one_of(
    st.fixed_dictionaries({"role": roles, "content": st.one_of(texts, junk)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": texts}),
    st.dictionaries(st.sampled_from(["role", "content", "name", "extra"]), st.one_of(texts, junk), max_size=3),
    junk,
)
prompts = st.one_of(
    texts,
    texts,
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": texts}), min_size=1,
             max_size=3),
    st.lists(messages, max_size=4),
    st.lists(st.lists(messages, max_size=2), max_size=2),  # nested lists
    junk,
)
responses = st.one_of(texts, texts, junk)
