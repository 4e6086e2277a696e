"""Validation of policy text with file:line:field locations, so every problem is reported at once."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from guarduq.errors import PolicyError
from guarduq.policy.schema import (
    BAND,
    CALIBRATED_SIGNALS,
    SO_BOOL,
    SO_THRESHOLD,
    THRESHOLD,
    AbstainRule,
    AllowRule,
    AuditSettings,
    Comparison,
    Condition,
    EscalateRule,
    OnError,
    PolicyConfig,
    SecondOpinionRule,
)

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
    from guarduq.policy.escalation import CallableSinkConfig, JsonlSinkConfig, WebhookSinkConfig

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
    if cfg.second_calibrator is not None and cfg.calibrator is None:
        add(("second_calibrator",), "a cascade's second stage reads the first stage's risk: set 'calibrator' too")
    if cfg.second_calibrator is not None and not any(isinstance(r, SecondOpinionRule) for r in cfg.rules):
        add(("second_calibrator",), "second_calibrator is read by a second_opinion rule, and there is none")
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
            words = {w for _, b in comp.operators() for w in (b if isinstance(b, tuple) else (b,))}
            if (signal == "so.risk" or words & {SO_THRESHOLD, BAND}) and cfg.second_calibrator is None:
                add(sloc, "so.risk, so.threshold and band come from a cascade's second stage: set "
                    "'second_calibrator' to use them")
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
        if SO_THRESHOLD in values and signal != "so.risk":
            add(loc, "'so.threshold' is the second stage's risk threshold: compare it with so.risk only")
        if BAND in values and signal != "risk":
            add(loc, "'band' is an edge of the first-stage risk band: compare it with risk only")
        if (SO_THRESHOLD in values or BAND in values) and cfg.alpha is None:
            add(loc, "'so.threshold' and 'band' need 'alpha' (the target error rate that selects them)")
        numbers = all(isinstance(v, float) for v in values)
        if op in ("between", "outside") and numbers and values[0] > values[1]:
            add(loc, f"{op} needs [low, high], got [{values[0]:g}, {values[1]:g}]")

    check_rules(cfg.rules, ("rules",), nested=False)
    overrides = [(("on_drift", "unseen"), cfg.on_drift.unseen), (("on_drift", "slice"), cfg.on_drift.slice),
                 (("groups", "fallback"), cfg.groups.fallback)]
    for loc, o in overrides:
        if o.sink is not None and o.sink not in cfg.sinks:
            declared = ", ".join(sorted(cfg.sinks)) or "none declared"
            add((*loc, "sink"), f"sink {o.sink!r} is not declared under 'sinks' ({declared})")
        if o.sink is not None and o.action != "escalate":
            add((*loc, "sink"), f"a sink is used by action 'escalate' only, not {o.action!r}")
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
    except RecursionError:
        return None, [PolicyIssue(source, None, "", _TOO_DEEP)]
    try:
        return _validate(root, data, source)
    except RecursionError:  # an alias that contains itself (`a: &a [*a]`) parses to a cycle
        return None, [PolicyIssue(source, None, "", _TOO_DEEP)]


_TOO_DEEP = "nested too deeply, or an alias that refers to itself"


def _validate(root: yaml.Node, data: Any, source: str) -> tuple[PolicyConfig | None, list[PolicyIssue]]:
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
