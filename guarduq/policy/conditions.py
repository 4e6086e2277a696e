"""Conditions evaluated over signal values in three-valued (Kleene) logic: unknown is not false."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from guarduq.policy.schema import WORDS, Condition

# ---------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """One comparison as evaluated: the value, the operator, the bound and the outcome."""

    signal: str
    op: str
    value: Any
    bound: str  # as people read it: "0.5", "threshold 0.31", "[threshold 0.31, 0.75]"
    result: bool | None  # None: the value or the bound is unknown

    def __str__(self) -> str:
        verdict = {True: "yes", False: "no", None: "unknown"}[self.result]
        return f"{self.signal}={_fmt(self.value)} {self.op} {self.bound}: {verdict}"


def _fmt(value: Any) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ---------------------------------------------------------------- evaluation

Tri = bool | None  # Kleene logic: None = unknown (e.g. so.agrees when the ensemble cannot tell)


def _compare(op: str, value: Any, bound: Any) -> bool:
    if op == "between":
        return bound[0] <= value <= bound[1]
    if op == "outside":
        return value < bound[0] or value > bound[1]
    return {
        "lt": value < bound, "le": value <= bound, "gt": value > bound,
        "ge": value >= bound, "eq": value == bound, "ne": value != bound,
    }[op]


def _all(results: Sequence[Tri]) -> Tri:
    if any(r is False for r in results):
        return False
    return None if any(r is None for r in results) else True


def _any(results: Sequence[Tri]) -> Tri:
    if any(r is True for r in results):
        return True
    return None if any(r is None for r in results) else False


def _evaluate(cond: Condition, values: Mapping[str, Any], checks: list[Check]) -> Tri:
    results: list[Tri] = []
    for signal, comp in cond.comparisons():
        value = values[signal]
        for op, raw in comp.operators():
            bound, label = _resolve(raw, values)
            known = value is not None and None not in (bound if isinstance(bound, tuple) else (bound,))
            result = _compare(op, value, bound) if known else None
            checks.append(Check(signal, op, value, label, result))
            results.append(result)
    if cond.all_:
        results.append(_all([_evaluate(c, values, checks) for c in cond.all_]))
    if cond.any_:
        results.append(_any([_evaluate(c, values, checks) for c in cond.any_]))
    if cond.not_ is not None:
        inner = _evaluate(cond.not_, values, checks)
        results.append(None if inner is None else not inner)
    return _all(results)


def _resolve(raw: Any, values: Mapping[str, Any]) -> tuple[Any, str]:
    """A bound as a plain value (None: an uncertified threshold) and as people read it."""
    if isinstance(raw, tuple):
        parts = [_resolve(r, values) for r in raw]
        return tuple(p for p, _ in parts), "[" + ", ".join(label for _, label in parts) + "]"
    if isinstance(raw, str) and raw in WORDS:
        value = values.get(WORDS[raw])
        return value, f"{raw} {_fmt(value)}"
    return raw, _fmt(raw)


def _signals_in(cond: Condition | None) -> set[str]:
    if cond is None:
        return set()
    used: set[str] = set()
    for signal, comp in cond.comparisons():
        used.add(signal)
        for _, b in comp.operators():
            used |= {WORDS[w] for w in (b if isinstance(b, tuple) else (b,)) if isinstance(w, str) and w in WORDS}
    for sub in (cond.all_ or []) + (cond.any_ or []) + ([cond.not_] if cond.not_ else []):
        used |= _signals_in(sub)
    return used
