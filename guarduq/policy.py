"""YAML policies: ordered rules over uncertainty signals that decide what the user sees.

A policy file (see ``policies/*.yaml``) lists rules; the first rule whose ``when`` holds fires and
its action decides: ``allow`` the answer, ``abstain`` with a message, ``escalate`` to a named sink
(holding or releasing the answer), or ask for a ``second_opinion`` and apply a nested rule list
to its result. Conditions are data, never code: comparison operators over named signals,
combined with ``all`` / ``any`` / ``not``. Nothing from the file is ever evaluated.

Signals (higher = more uncertain, except the probabilities that keep their own names):
``risk`` (calibrated P(wrong), needs a calibrator), ``epistemic``, ``aleatoric``,
``mean_token_prob``, ``min_token_prob``, ``mean_logprob``, ``mean_entropy``, ``n_tokens``,
``epistemic_z`` / ``aleatoric_z`` (log-epistemic and aleatoric in standard deviations from the
mean of the calibration data; raw epistemic values are model-specific, these are not); inside a
second-opinion rule list also ``so.mean_prob``, ``so.variance``, ``so.mutual_information`` and
``so.agrees``. The word ``threshold`` stands for the risk threshold that ``alpha`` selects from
the calibrator (the loosest one whose accepted answers are wrong at most ``alpha`` of the time).

Failures fail closed: when a signal is not finite, the second opinion or a sink fails, the
``on_error`` action applies (default: abstain). Misconfiguration (unknown keys, a second-opinion
rule without a provider, a callable sink outside the allow-list) raises ``PolicyError`` early.

This module knows nothing of torch; it receives plain numbers.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import string
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from guarduq._logging import get_logger
from guarduq.errors import EscalationError, PolicyError
from guarduq.escalation import SinkConfig, make_sink

log = get_logger("policy")

# ---------------------------------------------------------------- signals

BASE_SIGNALS = (
    "risk",
    "epistemic",
    "aleatoric",
    "mean_token_prob",
    "min_token_prob",
    "mean_logprob",
    "mean_entropy",
    "n_tokens",
    "epistemic_z",
    "aleatoric_z",
)
# Signals that only a calibrator can provide (the z-scores use its scaler: standard deviations
# above the mean of this model's calibration data, a scale that means the same for every model).
CALIBRATED_SIGNALS = ("risk", "epistemic_z", "aleatoric_z")
SO_NUMERIC = ("so.mean_prob", "so.variance", "so.mutual_information")
SO_BOOL = ("so.agrees",)
THRESHOLD = "threshold"  # the word a policy writes; the signal carrying its value:
THRESHOLD_SIGNAL = "risk_threshold"

# Names a message template may cite: {risk:.0%}, {threshold:.0%}, {so_mean_prob:.2f}, ...
TEMPLATE_NAMES = frozenset(
    [*BASE_SIGNALS, THRESHOLD, *(s.replace(".", "_") for s in SO_NUMERIC + SO_BOOL)]
)

DEFAULT_ABSTAIN = "I'm not confident enough to answer this reliably."
DEFAULT_HOLD = "This answer needs a review before it can be shown; it has been passed on."
DEFAULT_ERROR = "I can't answer right now: the safety check could not run."


def make_signals(scores: Any, **calibrated: float | None) -> dict[str, Any]:
    """The signal dict ``decide`` reads: the score attributes plus calibrated values
    (``risk``, ``risk_threshold``, ``epistemic_z``, ``aleatoric_z``) given by keyword."""
    out: dict[str, Any] = {
        name: getattr(scores, name)
        for name in BASE_SIGNALS
        if name not in CALIBRATED_SIGNALS and hasattr(scores, name)
    }
    out.update(calibrated)
    return out


# ---------------------------------------------------------------- schema (the YAML boundary)


def _bound(value: Any, *, allow_bool: bool) -> float | bool | str:
    if isinstance(value, bool):
        if allow_bool:
            return value
        raise ValueError("expected a number or 'threshold', got a boolean")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value}")
        return float(value)
    if value == THRESHOLD:
        return THRESHOLD
    raise ValueError(f"expected a number or 'threshold', got {value!r}")


Bound = Annotated[float | str, PlainValidator(lambda v: _bound(v, allow_bool=False))]
EqBound = Annotated[float | bool | str, PlainValidator(lambda v: _bound(v, allow_bool=True))]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Comparison(_Strict):
    """Operators on one signal; several operators in one mapping must all hold."""

    lt: Bound | None = None
    le: Bound | None = None
    gt: Bound | None = None
    ge: Bound | None = None
    eq: EqBound | None = None
    ne: EqBound | None = None
    between: tuple[Bound, Bound] | None = Field(None, description="lo <= x <= hi")
    outside: tuple[Bound, Bound] | None = Field(None, description="x < lo or x > hi")

    @model_validator(mode="after")
    def _not_empty(self) -> Comparison:
        if not self.operators():
            raise ValueError(f"needs at least one operator ({', '.join(OPERATORS)})")
        return self

    def operators(self) -> list[tuple[str, Any]]:
        return [(op, getattr(self, op)) for op in OPERATORS if getattr(self, op) is not None]


OPERATORS = ("lt", "le", "gt", "ge", "eq", "ne", "between", "outside")


class Condition(_Strict):
    """A mapping of signal comparisons and combinators; all entries must hold."""

    all_: list[Condition] | None = Field(None, alias="all", min_length=1)
    any_: list[Condition] | None = Field(None, alias="any", min_length=1)
    not_: Condition | None = Field(None, alias="not")
    risk: Comparison | None = None
    epistemic: Comparison | None = None
    aleatoric: Comparison | None = None
    mean_token_prob: Comparison | None = None
    min_token_prob: Comparison | None = None
    mean_logprob: Comparison | None = None
    mean_entropy: Comparison | None = None
    n_tokens: Comparison | None = None
    epistemic_z: Comparison | None = None
    aleatoric_z: Comparison | None = None
    so_mean_prob: Comparison | None = Field(None, alias="so.mean_prob")
    so_variance: Comparison | None = Field(None, alias="so.variance")
    so_mutual_information: Comparison | None = Field(None, alias="so.mutual_information")
    so_agrees: Comparison | None = Field(None, alias="so.agrees")

    @model_validator(mode="after")
    def _not_empty(self) -> Condition:
        if all(getattr(self, name) is None for name in type(self).model_fields):
            raise ValueError("empty condition: name a signal or all/any/not")
        return self

    def comparisons(self) -> Iterator[tuple[str, Comparison]]:
        """(signal name as written in YAML, comparison) pairs, in schema order."""
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if isinstance(value, Comparison):
                yield info.alias or name, value


def _check_template(template: str) -> str:
    """Accept plain ``{name:spec}`` placeholders over known numbers only (no attribute access)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"bad message template: {exc}") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in TEMPLATE_NAMES:
            raise ValueError(
                f"unknown placeholder {{{name}}} in message; allowed: {', '.join(sorted(TEMPLATE_NAMES))}"
            )
        if conversion or "{" in (spec or ""):
            raise ValueError(f"placeholder {{{name}}} may only carry a format spec like :.2f")
        if not any(_formats(sample, spec or "") for sample in (0.5, 1)):
            raise ValueError(f"bad format spec {spec!r} for {{{name}}}")
    return template


def _formats(value: float, spec: str) -> bool:
    try:
        format(value, spec)
    except (ValueError, TypeError):
        return False
    return True


def render_template(template: str, values: Mapping[str, Any]) -> str:
    """Fill a checked template; a value that is unknown prints as ``n/a``."""
    out: list[str] = []
    for literal, name, spec, _ in string.Formatter().parse(template):
        out.append(literal)
        if name is None:
            continue
        value = values.get(name)
        if value is None:
            out.append("n/a")
        elif _formats(value, spec or ""):
            out.append(format(value, spec or ""))
        else:
            out.append(str(value))
    return "".join(out)


Message = Annotated[str, PlainValidator(lambda v: _check_template(_as_str(v)))]


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


class _Rule(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    description: str = ""
    when: Condition | None = Field(None, description="omitted: the rule always matches")


class AllowRule(_Rule):
    action: Literal["allow"]


class AbstainRule(_Rule):
    action: Literal["abstain"]
    message: Message = DEFAULT_ABSTAIN


class EscalateRule(_Rule):
    action: Literal["escalate"]
    sink: str
    hold: bool = Field(True, description="true: show `message` instead of the answer")
    message: Message = DEFAULT_HOLD


NestedRule = Annotated[AllowRule | AbstainRule | EscalateRule, Field(discriminator="action")]


class SecondOpinionRule(_Rule):
    action: Literal["second_opinion"]
    rules: list[NestedRule] = Field(min_length=1)


Rule = Annotated[
    AllowRule | AbstainRule | EscalateRule | SecondOpinionRule, Field(discriminator="action")
]
ACTIONS = ("allow", "abstain", "escalate", "second_opinion")


class OnError(_Strict):
    """What the user sees when a signal, the second opinion or a sink fails."""

    action: Literal["abstain", "allow"] = "abstain"
    message: Message = DEFAULT_ERROR

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"action": data} if isinstance(data, str) else data


class AuditSettings(_Strict):
    log_text: bool = Field(False, description="store prompt/response text, not just hashes")


class PolicyConfig(_Strict):
    """The whole policy file."""

    name: str = Field(min_length=1)
    version: str = Field(min_length=1)
    description: str = ""
    model: str | None = Field(None, description="expected model name or fingerprint (prefix)")
    calibrator: str | None = Field(None, description="artifact path, relative to the policy file")
    alpha: float | None = Field(None, gt=0, lt=1, description="selects `threshold`")
    mode: Literal["enforce", "shadow"] = "enforce"
    on_error: OnError = OnError()
    audit: AuditSettings = AuditSettings()
    sinks: dict[str, SinkConfig] = Field(default_factory=dict)
    rules: list[Rule] = Field(min_length=1)

    @field_validator("version", mode="before")
    @classmethod
    def _version_str(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


# ---------------------------------------------------------------- validation with file:line:field


@dataclass(frozen=True)
class PolicyIssue:
    """One problem in a policy file, located by line and field path."""

    source: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        return f"{where}: {self.field or '<top>'}: {self.message}"


Loc = tuple[str | int, ...]


def _all_keys() -> list[str]:
    models: list[type[BaseModel]] = [
        PolicyConfig, OnError, AuditSettings, Condition, Comparison,
        AllowRule, AbstainRule, EscalateRule, SecondOpinionRule,
    ]
    from guarduq.escalation import CallableSinkConfig, JsonlSinkConfig, WebhookSinkConfig

    models += [JsonlSinkConfig, WebhookSinkConfig, CallableSinkConfig]
    return sorted({info.alias or name for m in models for name, info in m.model_fields.items()})


class _Locator:
    """Maps a pydantic error location to a YAML line and a readable field path."""

    def __init__(self, root: yaml.Node | None, source: str) -> None:
        self.root = root
        self.source = source

    def issue(self, loc: Loc, message: str, *, keep_last: bool = False) -> PolicyIssue:
        node, line, path = self.root, 1, ""
        for i, part in enumerate(loc):
            child = self._child(node, part)
            if child is None:
                if keep_last and i == len(loc) - 1:
                    path = _join(path, part)
                continue  # a pydantic union tag or a missing key: no YAML node for it
            key_line, node = child
            line = key_line
            path = _join(path, part)
        return PolicyIssue(self.source, line if self.root is not None else None, path, message)

    @staticmethod
    def _child(node: yaml.Node | None, part: str | int) -> tuple[int, yaml.Node] | None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    return key.start_mark.line + 1, value
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            item = node.value[part]
            return item.start_mark.line + 1, item
        return None


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else str(part)


def _pydantic_issues(exc: ValidationError, locator: _Locator) -> list[PolicyIssue]:
    issues = []
    known = _all_keys()
    for err in exc.errors(include_url=False):
        loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
        if kind == "extra_forbidden":
            key = str(loc[-1])
            hint = difflib.get_close_matches(key, known, n=1)
            msg = f"unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            issues.append(locator.issue(loc, msg, keep_last=True))
        elif kind == "missing":
            issues.append(locator.issue(loc, f"missing required key {loc[-1]!r}", keep_last=True))
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            tag = str(ctx.get("discriminator", "'type'")).strip("'")
            if kind == "union_tag_not_found":
                msg = f"missing required key {tag!r}"
            else:
                msg = f"unknown {tag} {ctx.get('tag')!r} (expected one of {ctx.get('expected_tags')})"
            issues.append(locator.issue((*loc, tag), msg, keep_last=True))
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            if kind == "string_type" and isinstance(err.get("input"), bool):
                msg += " (YAML reads bare yes/no/on/off/true/false as booleans: quote the word)"
            issues.append(locator.issue(loc, msg))
    return issues


def _semantic_issues(cfg: PolicyConfig, locator: _Locator) -> list[PolicyIssue]:
    """Checks that span fields: references, ordering, which signals may appear where."""
    issues: list[PolicyIssue] = []

    def add(loc: Loc, msg: str) -> None:
        issues.append(locator.issue(loc, msg, keep_last=True))

    if cfg.alpha is not None and cfg.calibrator is None:
        add(("alpha",), "alpha selects a threshold from a calibrator, but no 'calibrator' is set")
    seen: dict[str, Loc] = {}

    def check_rules(rules: Sequence[Any], base: Loc, nested: bool) -> None:
        for i, rule in enumerate(rules):
            loc = (*base, i)
            if rule.name in seen:
                add((*loc, "name"), f"rule name {rule.name!r} is used twice")
            seen[rule.name] = loc
            if rule.when is None and i < len(rules) - 1:
                later = rules[i + 1].name
                add(loc, f"rule {rule.name!r} has no 'when' so it always matches; "
                    f"rule {later!r} after it can never fire")
            if rule.when is not None:
                check_condition(rule.when, (*loc, "when"), nested)
            if isinstance(rule, EscalateRule) and rule.sink not in cfg.sinks:
                declared = ", ".join(sorted(cfg.sinks)) or "none declared"
                add((*loc, "sink"), f"sink {rule.sink!r} is not declared under 'sinks' ({declared})")
            if isinstance(rule, SecondOpinionRule):
                check_rules(rule.rules, (*loc, "rules"), nested=True)

    def check_condition(cond: Condition, loc: Loc, nested: bool) -> None:
        for key in ("all", "any"):
            for j, sub in enumerate(getattr(cond, f"{key}_") or ()):
                check_condition(sub, (*loc, key, j), nested)
        if cond.not_ is not None:
            check_condition(cond.not_, (*loc, "not"), nested)
        for signal, comp in cond.comparisons():
            sloc = (*loc, signal)
            if signal.startswith("so.") and not nested:
                add(sloc, f"{signal} is only known inside a second_opinion rule list")
            if signal in CALIBRATED_SIGNALS and cfg.calibrator is None:
                add(sloc, f"{signal} comes from the calibrator: set 'calibrator' to use it")
            for op, bound in comp.operators():
                check_bound(signal, op, bound, (*sloc, op))

    def check_bound(signal: str, op: str, bound: Any, loc: Loc) -> None:
        values = bound if isinstance(bound, tuple) else (bound,)
        if signal in SO_BOOL:
            if op not in ("eq", "ne") or not isinstance(bound, bool):
                add(loc, f"{signal} is true/false: compare it with eq/ne and a boolean")
            return
        if any(isinstance(v, bool) for v in values):
            add(loc, f"{signal} is a number: compare it with a number")
        if THRESHOLD in values:
            if signal != "risk":
                add(loc, "'threshold' is a risk threshold: compare it with risk only")
            elif cfg.alpha is None:
                add(loc, "'threshold' needs 'alpha' (the target error rate that selects it)")
        numbers = all(isinstance(v, float) for v in values)
        if op in ("between", "outside") and numbers and values[0] > values[1]:
            add(loc, f"{op} needs [low, high], got [{values[0]:g}, {values[1]:g}]")

    check_rules(cfg.rules, ("rules",), nested=False)
    return issues


def _duplicate_keys(node: yaml.Node | None, locator: _Locator) -> list[PolicyIssue]:
    """safe_load keeps the last of two equal keys silently; a policy must not hide a rule so."""
    issues: list[PolicyIssue] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    issues.append(PolicyIssue(locator.source, key.start_mark.line + 1, key.value,
                                              f"duplicate key {key.value!r}"))
                seen.add(key.value)
            issues += _duplicate_keys(value, locator)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            issues += _duplicate_keys(item, locator)
    return issues


def validate_policy_text(text: str, source: str = "<string>") -> tuple[PolicyConfig | None, list[PolicyIssue]]:
    """Parse and validate; return the config (None if invalid) and every problem found."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        return None, [PolicyIssue(source, line, "", f"not valid YAML: {problem}")]
    locator = _Locator(root, source)
    if not isinstance(data, dict):
        return None, [PolicyIssue(source, 1, "", "a policy file must be a YAML mapping")]
    issues = _duplicate_keys(root, locator)
    try:
        cfg = PolicyConfig.model_validate(data)
    except ValidationError as exc:
        return None, issues + _pydantic_issues(exc, locator)
    issues += _semantic_issues(cfg, locator)
    return (None if issues else cfg), issues


def _raise_issues(issues: list[PolicyIssue]) -> None:
    more = f" (and {len(issues) - 1} more problem(s); see `guarduq policy check`)" if len(issues) > 1 else ""
    raise PolicyError(f"invalid policy: {issues[0]}{more}")


# ---------------------------------------------------------------- second opinion interface


@dataclass(frozen=True)
class SecondOpinion:
    """What a second opinion (e.g. the SVE ensemble) says about one response."""

    mean_prob: float
    variance: float
    mutual_information: float
    agrees: bool | None = None
    member_mean_probs: tuple[float, ...] = ()

    @classmethod
    def coerce(cls, obj: Any) -> SecondOpinion:
        """Read the attributes off any provider's result; reject non-finite or missing ones."""
        try:
            numbers = {k: float(getattr(obj, k)) for k in ("mean_prob", "variance", "mutual_information")}
            agrees = getattr(obj, "agrees", None)
            members = tuple(float(p) for p in getattr(obj, "member_mean_probs", ()) or ())
        except (AttributeError, TypeError, ValueError) as exc:
            raise PolicyError(f"second opinion result is malformed: {exc}") from exc
        bad = [k for k, v in numbers.items() if not math.isfinite(v)]
        if bad:
            raise PolicyError(f"second opinion returned non-finite {', '.join(bad)}")
        if agrees is not None and not isinstance(agrees, bool):
            raise PolicyError(f"second opinion 'agrees' must be true/false/None, got {agrees!r}")
        return cls(numbers["mean_prob"], numbers["variance"], numbers["mutual_information"], agrees, members)

    def signals(self) -> dict[str, Any]:
        return {
            "so.mean_prob": self.mean_prob,
            "so.variance": self.variance,
            "so.mutual_information": self.mutual_information,
            "so.agrees": self.agrees,
        }


@runtime_checkable
class SecondOpinionProvider(Protocol):
    """Anything with ``second_opinion(prompt, response)``, e.g. ``guarduq.sve.SVEnsemble``."""

    def second_opinion(self, prompt: Any, response: str) -> Any: ...


# ---------------------------------------------------------------- decisions


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


@dataclass(frozen=True)
class EscalationInfo:
    sink: str
    hold: bool
    delivered: bool
    error: str | None = None


@dataclass(frozen=True)
class Decision:
    """What the policy decided and why. ``text`` is what the user sees."""

    action: str  # "allow" | "abstain" | "escalate" (second_opinion resolves to one of these)
    text: str
    shown: bool  # True when ``text`` is the model's answer
    rule: str | None  # "name", or "outer/inner" for a nested rule; "on_error"; None: no rule matched
    explanation: str
    checks: tuple[Check, ...] = ()
    risk: float | None = None
    threshold: float | None = None
    escalation: EscalationInfo | None = None
    second_opinion: SecondOpinion | None = None
    shadow: bool = False
    errors: tuple[str, ...] = ()
    policy: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = [str(c) for c in self.checks]
        return d


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
    if raw == THRESHOLD:
        return values[THRESHOLD_SIGNAL], f"threshold {_fmt(values[THRESHOLD_SIGNAL])}"
    return raw, _fmt(raw)


def _signals_in(cond: Condition | None) -> set[str]:
    if cond is None:
        return set()
    used: set[str] = set()
    for signal, comp in cond.comparisons():
        used.add(signal)
        if any(THRESHOLD in (b if isinstance(b, tuple) else (b,)) for _, b in comp.operators()):
            used.add(THRESHOLD_SIGNAL)
    for sub in (cond.all_ or []) + (cond.any_ or []) + ([cond.not_] if cond.not_ else []):
        used |= _signals_in(sub)
    return used


class _Failure(Exception):
    """Internal: a runtime failure that the policy's on_error handles."""

    def __init__(self, stage: str, error: BaseException | str) -> None:
        super().__init__(f"{stage}: {error if isinstance(error, str) else _describe(error)}")
        self.stage = stage
        self.escalation: EscalationInfo | None = None  # set when delivery to a sink failed


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the policy


class Policy:
    """A validated policy plus (after ``bind``) its sinks and second-opinion provider."""

    def __init__(
        self,
        config: PolicyConfig,
        *,
        source: str = "<memory>",
        base_dir: str | os.PathLike[str] | None = None,
        sha256: str | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
        self.sha256 = sha256 or hashlib.sha256(
            json.dumps(config.model_dump(mode="json", by_alias=True), sort_keys=True).encode()
        ).hexdigest()
        self._provider: SecondOpinionProvider | None = None
        self._sinks: dict[str, Any] | None = None
        self._calibrated = False  # bound with a calibrator: risk_threshold below is meaningful
        self.risk_threshold: float | None = None
        self._lock = threading.Lock()

    # -- loading

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Policy:
        """Load and validate a policy file; ``PolicyError`` names the file, line and field."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise PolicyError(f"cannot read policy file {path}: {exc.strerror or exc}") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(f"{path}: not UTF-8 text ({exc.reason})") from exc
        config, issues = validate_policy_text(text, str(path))
        if config is None:
            _raise_issues(issues)
        return cls(config, source=str(path), base_dir=path.parent, sha256=hashlib.sha256(raw).hexdigest())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: str | os.PathLike[str] | None = None) -> Policy:
        """Validate an in-memory policy (no line numbers; field paths only)."""
        text = yaml.safe_dump(json.loads(json.dumps(dict(data))), sort_keys=False)
        config, issues = validate_policy_text(text, "<dict>")
        if config is None:
            _raise_issues(issues)
        return cls(config, source="<dict>", base_dir=base_dir)

    # -- properties a caller needs

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> str:
        return self.config.version

    @property
    def shadow(self) -> bool:
        return self.config.mode == "shadow"

    @property
    def alpha(self) -> float | None:
        return self.config.alpha

    @property
    def log_text(self) -> bool:
        return self.config.audit.log_text

    @property
    def calibrator_path(self) -> Path | None:
        if self.config.calibrator is None:
            return None
        path = Path(self.config.calibrator)
        return path if path.is_absolute() else self.base_dir / path

    @property
    def uses_second_opinion(self) -> bool:
        return any(isinstance(r, SecondOpinionRule) for r in self.config.rules)

    @property
    def needs_risk(self) -> bool:
        return "risk" in self.signals_used()

    def identity(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256}

    def signals_used(self) -> set[str]:
        used: set[str] = set()
        for rule in self.config.rules:
            used |= _signals_in(rule.when)
            for inner in getattr(rule, "rules", ()):
                used |= _signals_in(inner.when)
        return used

    def check_model(self, names: str | Collection[str] | None, fingerprint: str | None) -> None:
        """Refuse a model the policy was not written for (its thresholds assume that model).

        ``model`` in the file matches one of ``names`` exactly, or is a prefix (>= 8 hex digits)
        of the fingerprint.
        """
        expected = self.config.model
        if expected is None:
            return
        names = {names} if isinstance(names, str) else set(names or ())
        fp = (fingerprint or "").lower()
        if expected not in names and not (len(expected) >= 8 and fp.startswith(expected.lower())):
            raise PolicyError(
                f"policy {self.name!r} ({self.source}) is for model {expected!r}, "
                f"but the model is {sorted(names)} (fingerprint {fingerprint})"
            )

    # -- binding the runtime pieces

    def bind(
        self,
        *,
        second_opinion: SecondOpinionProvider | Callable[[Any, str], Any] | None = None,
        allow_callables: Collection[str] = (),
        sinks: Mapping[str, Any] | None = None,
        calibrator: Any = None,
    ) -> Policy:
        """A copy with its sinks built, its second-opinion provider attached and, given the
        calibrator (``guarduq.calibration.Calibrator``), the risk threshold ``alpha`` selects.

        Raises ``PolicyError`` when a rule asks for a second opinion and none is given, when a
        callable sink is not in ``allow_callables``, when ``sinks`` names an undeclared sink, or
        when the rules need a calibrated signal the calibrator cannot give.
        """
        threshold = self._threshold_from(calibrator)
        if self.uses_second_opinion and second_opinion is None:
            names = [r.name for r in self.config.rules if isinstance(r, SecondOpinionRule)]
            raise PolicyError(
                f"policy {self.name!r} asks for a second opinion (rule {', '.join(names)}) but no "
                f"second-opinion provider is configured: pass second_opinion=<an SVEnsemble>"
            )
        overrides = dict(sinks or {})
        unknown = sorted(set(overrides) - set(self.config.sinks))
        if unknown:
            raise PolicyError(f"sinks {unknown} are not declared in policy {self.name!r}")
        built = {
            name: overrides.get(name) or make_sink(cfg, base_dir=self.base_dir, allow_callables=allow_callables)
            for name, cfg in self.config.sinks.items()
        }
        bound = Policy(self.config, source=self.source, base_dir=self.base_dir, sha256=self.sha256)
        bound._provider = _as_provider(second_opinion) if second_opinion is not None else None
        bound._sinks = built
        bound._calibrated = calibrator is not None
        bound.risk_threshold = threshold
        return bound

    def _threshold_from(self, calibrator: Any) -> float | None:
        used = self.signals_used()
        if calibrator is None:  # the caller passes risk (and risk_threshold) in the signals
            return None
        features = set(getattr(calibrator, "features", ()))
        for signal, feature in (("epistemic_z", "log_epistemic"), ("aleatoric_z", "aleatoric")):
            if signal in used and feature not in features:
                raise PolicyError(
                    f"policy {self.name!r} uses {signal}, but the calibrator was fitted without "
                    f"the {feature!r} feature (it has {sorted(features)})"
                )
        if self.alpha is None:
            return None
        alphas = [t.alpha for t in getattr(calibrator, "thresholds_", ())]
        if not any(math.isclose(a, self.alpha) for a in alphas):
            raise PolicyError(
                f"policy {self.name!r} asks for alpha={self.alpha}, but the calibrator has thresholds "
                f"for {alphas} only: refit it with --alpha {self.alpha} or change the policy"
            )
        threshold = calibrator.threshold_for(self.alpha)
        if threshold is None:
            log.warning(
                "no_certified_threshold", policy=self.name, alpha=self.alpha,
                detail="no risk threshold met the target on the calibration data; rules comparing "
                "risk with 'threshold' will not match (fail-closed)",
            )
        return None if threshold is None else float(threshold)

    def _bound_sinks(self) -> dict[str, Any]:
        with self._lock:
            if self._sinks is None:  # never bound: build file-declared sinks, no callables allowed
                self._sinks = {
                    name: make_sink(cfg, base_dir=self.base_dir) for name, cfg in self.config.sinks.items()
                }
            return self._sinks

    # -- deciding

    def decide(
        self,
        signals: Mapping[str, Any],
        second_opinion: SecondOpinionProvider | None = None,
        *,
        prompt: Any = None,
        response: str = "",
        request_id: str | None = None,
        model_fingerprint: str | None = None,
    ) -> Decision:
        """Apply the rules to ``signals`` (see ``make_signals``); first match wins.

        Runtime failures (a non-finite signal, a failing second opinion or sink) give the
        ``on_error`` decision; configuration mistakes raise ``PolicyError``.
        """
        provider = _as_provider(second_opinion) if second_opinion is not None else self._provider
        if self.uses_second_opinion and provider is None:
            self.bind()  # raises the clear "no provider" error
        sinks = self._bound_sinks()
        values = self._checked_values(signals)
        risk, threshold = values.get("risk"), values.get(THRESHOLD_SIGNAL)
        try:
            _check_finite(values, self.signals_used())
            lines: list[str] = []
            rule, checks = self._first_match(self.config.rules, values, lines, prefix="")
            so, outer_name = None, None
            if isinstance(rule, SecondOpinionRule):
                assert provider is not None  # checked above
                try:
                    so = SecondOpinion.coerce(provider.second_opinion(prompt, response))
                except Exception as exc:  # a provider failure is a runtime failure, not a crash
                    raise _Failure("second_opinion", exc) from exc
                values.update(so.signals())
                lines.append(f"second opinion: {_so_summary(so)}")
                outer, outer_name = rule, rule.name
                rule, inner_checks = self._first_match(outer.rules, values, lines, prefix=f"{outer.name}/")
                checks += inner_checks
            return self._finish(rule, outer_name, values, checks, lines, so, response=response, prompt=prompt,
                                ids={"request_id": request_id, "model_fingerprint": model_fingerprint},
                                sinks=sinks, risk=risk, threshold=threshold)
        except _Failure as failure:
            return self._error_decision(str(failure), response=response, risk=risk, threshold=threshold,
                                        escalation=failure.escalation)

    def on_error_decision(self, stage: str, error: BaseException | str, *, response: str = "") -> Decision:
        """The decision when a step before ``decide`` failed (e.g. scoring)."""
        return self._error_decision(str(_Failure(stage, error)), response=response)

    # -- internals

    def _checked_values(self, signals: Mapping[str, Any]) -> dict[str, Any]:
        values = dict(signals)
        if self._calibrated:
            values.setdefault(THRESHOLD_SIGNAL, self.risk_threshold)
        missing = sorted(s for s in self.signals_used() if not s.startswith("so.") and s not in values)
        if missing:
            raise PolicyError(f"policy {self.name!r} needs signal(s) {missing} that were not provided")
        return values

    def _first_match(
        self, rules: Sequence[Any], values: Mapping[str, Any], lines: list[str], prefix: str
    ) -> tuple[Any, list[Check]]:
        for rule in rules:
            checks: list[Check] = []
            result = True if rule.when is None else _evaluate(rule.when, values, checks)
            detail = "; ".join(str(c) for c in checks) or "no condition"
            lines.append(f"{'match' if result else 'skip '} {prefix}{rule.name}: {detail}")
            if result is True:
                return rule, checks
        return None, []

    def _finish(self, rule: Any, outer_name: str | None, values: Mapping[str, Any], checks: list[Check], lines: list[str],
                so: SecondOpinion | None, *, response: str, prompt: Any, ids: Mapping[str, Any],
                sinks: Mapping[str, Any], risk: float | None, threshold: float | None) -> Decision:
        template_values = {k.replace(".", "_"): v for k, v in values.items()}
        template_values[THRESHOLD] = values.get(THRESHOLD_SIGNAL)
        name = None if rule is None else "/".join(n for n in (outer_name, rule.name) if n)
        escalation = None
        if rule is None:
            action, shown, text = "abstain", False, DEFAULT_ABSTAIN
            lines.append("no rule matched: abstain (fail-closed)")
        elif isinstance(rule, AllowRule):
            action, shown, text = "allow", True, response
        elif isinstance(rule, AbstainRule):
            action, shown, text = "abstain", False, render_template(rule.message, template_values)
        else:  # EscalateRule
            action, shown = "escalate", not rule.hold
            text = render_template(rule.message, template_values) if rule.hold else response
            escalation = EscalationInfo(rule.sink, rule.hold, delivered=False)
        decision = Decision(
            action=action, text=text, shown=shown, rule=name, explanation="", checks=tuple(checks),
            risk=risk, threshold=threshold, escalation=escalation, second_opinion=so,
            shadow=self.shadow, policy=f"{self.name}@{self.version}",
        )
        if escalation is not None and not self.shadow:
            try:
                self._deliver(sinks[escalation.sink], decision, values, prompt, response, ids)
            except _Failure as failure:
                failure.escalation = replace(escalation, error=str(failure))
                raise
            escalation = EscalationInfo(escalation.sink, escalation.hold, delivered=True)
            lines.append(f"escalated to sink {escalation.sink!r}")
        elif escalation is not None:
            lines.append(f"shadow mode: escalation to {escalation.sink!r} not sent")
        if self.shadow:
            lines.append(f"shadow mode: would {action}; the answer is shown")
            text, shown = response, True
        return replace(decision, text=text, shown=shown, escalation=escalation,
                        explanation=_explain(name, action, lines))

    def _deliver(self, sink: Any, decision: Decision, values: Mapping[str, Any], prompt: Any,
                 response: str, ids: Mapping[str, Any]) -> None:
        """Hand the case to its sink; a failure becomes the on_error decision."""
        case = {
            **ids,
            "policy": self.identity(),
            "prompt": prompt,
            "response": response,
            "scores": dict(values),
            "decision": {
                "action": decision.action,
                "rule": decision.rule,
                "hold": decision.escalation.hold if decision.escalation else None,
                "text": decision.text,
                "checks": [str(c) for c in decision.checks],
            },
        }
        try:
            sink.send(case)
        except EscalationError as exc:
            raise _Failure("escalation", exc) from exc
        except Exception as exc:  # a user-supplied sink object that broke its contract
            raise _Failure("escalation", exc) from exc

    def _error_decision(self, error: str, *, response: str, risk: float | None = None,
                        threshold: float | None = None, escalation: EscalationInfo | None = None) -> Decision:
        on_error = self.config.on_error
        if on_error.action == "allow":
            log.warning("policy_fail_open", policy=self.name, error=error)
            text, shown = response, True
        else:
            text, shown = render_template(on_error.message, {}), False
        lines = [f"error: {error}", f"on_error: {on_error.action}"]
        if self.shadow:
            lines.append(f"shadow mode: would {on_error.action}; the answer is shown")
            text, shown = response, True
        return Decision(
            action=on_error.action, text=text, shown=shown, rule="on_error",
            explanation=_explain("on_error", on_error.action, lines), risk=risk, threshold=threshold,
            escalation=escalation, shadow=self.shadow, errors=(error,), policy=f"{self.name}@{self.version}",
        )


def _as_provider(obj: Any) -> SecondOpinionProvider:
    if isinstance(obj, SecondOpinionProvider):
        return obj
    if callable(obj):
        return _CallableProvider(obj)
    raise PolicyError(f"second_opinion must have a second_opinion(prompt, response) method, got {obj!r}")


@dataclass(frozen=True)
class _CallableProvider:
    fn: Callable[[Any, str], Any]

    def second_opinion(self, prompt: Any, response: str) -> Any:
        return self.fn(prompt, response)


def _check_finite(values: Mapping[str, Any], used: Collection[str]) -> None:
    for name in sorted(used):
        value = values.get(name)
        if name.startswith("so.") or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Failure("signals", f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise _Failure("signals", f"{name} is {value}")


def _so_summary(so: SecondOpinion) -> str:
    return (f"mean_prob={_fmt(so.mean_prob)} variance={_fmt(so.variance)} "
            f"mutual_information={_fmt(so.mutual_information)} agrees={_fmt(so.agrees)}")


def _explain(rule: str | None, action: str, lines: list[str]) -> str:
    head = f"rule {rule!r} -> {action}" if rule else f"no rule matched -> {action}"
    return "\n".join([head, *("  " + line for line in lines)])


__all__ = [
    "ACTIONS",
    "BASE_SIGNALS",
    "OPERATORS",
    "Check",
    "Decision",
    "EscalationInfo",
    "Policy",
    "PolicyConfig",
    "PolicyIssue",
    "SecondOpinion",
    "SecondOpinionProvider",
    "make_signals",
    "render_template",
    "validate_policy_text",
]
