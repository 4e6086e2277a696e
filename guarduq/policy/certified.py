"""Which certified threshold a policy's ``alpha`` selects on its calibrator, rule by rule.

A rule that compares ``risk`` with ``threshold`` can only hold when the calibrator certified a
threshold at the policy's alpha (``Policy.bind`` leaves it unknown otherwise, and an unknown
comparison never holds). Validation cannot see that: it needs the calibrator. This module reads
the calibrator and says, for ``guarduq policy check``, what each such rule will compare with, or
why it can never match. Pure: no printing, no exit codes (the CLI formats the report).

The calibrator is read through the interface ``Policy.bind`` uses (``thresholds_`` records and
``threshold_for``); it is passed in, so this layer never imports numpy or scikit-learn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from guarduq._logging import get_logger
from guarduq.errors import GuardUQError
from guarduq.policy.engine import Policy
from guarduq.policy.schema import THRESHOLD, Comparison, Condition, PolicyConfig, SecondOpinionRule

log = get_logger("policy")

_SYMBOLS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


@dataclass(frozen=True)
class ThresholdUse:
    """One rule whose condition compares ``risk`` with ``threshold``.

    ``comparisons`` are as people read them (``"risk > threshold"``, ``"not (risk <= threshold)"``);
    ``needs_threshold`` is True when the rule cannot match at all while the threshold is unknown
    (False: another branch of an ``any`` / ``not`` can still make it match).
    """

    rule: str  # "name", or "outer/inner" for a rule inside a second_opinion rule list
    comparisons: tuple[str, ...]
    needs_threshold: bool


@dataclass(frozen=True)
class CertifiedThreshold:
    """What the calibrator records for one alpha (``guarduq.calibration.Threshold``'s fields)."""

    alpha: float
    delta: float | None
    threshold: float | None
    n: int | None  # calibration items the threshold was chosen on
    n_accepted: int | None
    coverage: float | None
    error_rate: float | None
    upper_bound: float | None
    message: str | None  # the calibrator's own reason when nothing was certified


@dataclass(frozen=True)
class ThresholdReport:
    """The threshold a policy's rules will compare risk with, or why they cannot.

    ``warning`` is None when every threshold rule has a certified threshold (or there are none).
    """

    policy: str
    alpha: float | None
    calibrator: str | None  # as the policy names it (relative to the policy file)
    uses: tuple[ThresholdUse, ...]
    threshold: float | None = None  # the certified value ``Policy.bind`` will use
    record: CertifiedThreshold | None = None  # the calibrator's record for alpha, if any
    fitted_alphas: tuple[float, ...] = ()  # every alpha the calibrator holds a record for
    certified_alphas: tuple[float, ...] = ()  # those with a certified threshold
    readable: bool = True  # False: the calibrator could not be read, so nothing is known
    warning: str | None = None

    @property
    def ok(self) -> bool:
        return self.warning is None

    @property
    def smallest_certified_alpha(self) -> float | None:
        return min(self.certified_alphas, default=None)


# ---------------------------------------------------------------- finding the rules


def threshold_rules(config: PolicyConfig) -> tuple[ThresholdUse, ...]:
    """Every rule, nested ones included, whose condition compares risk with ``threshold``."""
    found: list[ThresholdUse] = []
    for rule in config.rules:
        found += _uses(rule, prefix="")
        if isinstance(rule, SecondOpinionRule):
            for inner in rule.rules:
                found += _uses(inner, prefix=f"{rule.name}/")
    return tuple(found)


def _uses(rule: Any, prefix: str) -> list[ThresholdUse]:
    if rule.when is None:
        return []
    comparisons = tuple(_threshold_comparisons(rule.when, negated=False))
    if not comparisons:
        return []
    can_be_true, _ = _possible(rule.when)
    return [ThresholdUse(f"{prefix}{rule.name}", comparisons, needs_threshold=not can_be_true)]


def _as_tuple(bound: Any) -> tuple[Any, ...]:
    return bound if isinstance(bound, tuple) else (bound,)


def _mentions_threshold(comp: Comparison) -> bool:
    return any(THRESHOLD in _as_tuple(b) for _, b in comp.operators())


def _threshold_comparisons(cond: Condition, negated: bool) -> Iterator[str]:
    """The risk comparisons of ``cond`` (recursively) that mention ``threshold``, readable."""
    for signal, comp in cond.comparisons():
        if signal == "risk" and _mentions_threshold(comp):
            ops = sorted(comp.operators(), key=lambda ob: THRESHOLD not in _as_tuple(ob[1]))
            text = " and ".join(_render(signal, op, bound) for op, bound in ops)
            yield f"not ({text})" if negated else text
    for sub in (cond.all_ or []) + (cond.any_ or []):
        yield from _threshold_comparisons(sub, negated)
    if cond.not_ is not None:
        yield from _threshold_comparisons(cond.not_, not negated)


def _render(signal: str, op: str, bound: Any) -> str:
    if op in ("between", "outside"):
        lo, hi = (_bound_text(b) for b in bound)
        return f"{signal} in [{lo}, {hi}]" if op == "between" else f"{signal} outside [{lo}, {hi}]"
    return f"{signal} {_SYMBOLS[op]} {_bound_text(bound)}"


def _bound_text(bound: Any) -> str:
    return bound if isinstance(bound, str) else f"{bound:g}"


def _possible(cond: Condition) -> tuple[bool, bool]:
    """(can be true, can be false) when ``threshold`` is unknown and any other value is possible.

    Kleene logic as ``conditions._evaluate`` applies it: a comparison with an unknown bound is
    unknown, neither true nor false; a mapping holds when all its entries do.
    """
    parts: list[tuple[bool, bool]] = []
    for _, comp in cond.comparisons():
        known = not _mentions_threshold(comp)
        parts.append((known, known))
    if cond.all_:
        subs = [_possible(c) for c in cond.all_]
        parts.append((all(t for t, _ in subs), any(f for _, f in subs)))
    if cond.any_:
        subs = [_possible(c) for c in cond.any_]
        parts.append((any(t for t, _ in subs), all(f for _, f in subs)))
    if cond.not_ is not None:
        true, false = _possible(cond.not_)
        parts.append((false, true))
    return all(t for t, _ in parts), any(f for _, f in parts)


# ---------------------------------------------------------------- reading the calibrator


def certified_thresholds(policy: Policy, calibrator: Any) -> ThresholdReport:
    """The threshold the policy's alpha selects on ``calibrator`` for each threshold rule.

    ``calibrator`` is a loaded ``guarduq.calibration.Calibrator`` (or anything with its
    ``thresholds_`` and ``threshold_for``). The value is read as ``Policy.bind`` reads it, so
    the report says what serving will do.
    """
    cfg = policy.config
    uses = threshold_rules(cfg)
    base = ThresholdReport(policy=cfg.name, alpha=cfg.alpha, calibrator=cfg.calibrator, uses=uses)
    if not uses or cfg.alpha is None:
        return base  # validation already demands alpha wherever 'threshold' appears
    records = [_record(t) for t in getattr(calibrator, "thresholds_", ())]
    fitted, certified = fitted_alphas(calibrator), certified_alphas(calibrator)
    record = next((r for r in records if math.isclose(r.alpha, cfg.alpha)), None)
    threshold = calibrator.threshold_for(cfg.alpha) if record is not None else None
    report = ThresholdReport(
        policy=cfg.name, alpha=cfg.alpha, calibrator=cfg.calibrator, uses=uses,
        threshold=None if threshold is None else float(threshold), record=record,
        fitted_alphas=fitted, certified_alphas=certified,
    )
    if report.threshold is None:
        warning = _uncertified(report)
    else:
        empty = empty_band_rules(cfg, report.threshold)
        warning = (f"with threshold = {report.threshold:g} (alpha {cfg.alpha:g}), {_rule_names(empty)} "
                   f"{'asks' if len(empty) == 1 else 'ask'} for an empty risk band and can never match") if empty else None
    log.debug("threshold_check", policy=cfg.name, alpha=cfg.alpha, threshold=report.threshold,
              certified_alphas=list(certified), warning=warning)
    return _with_warning(report, warning)


def fitted_alphas(calibrator: Any) -> tuple[float, ...]:
    """The alphas the calibrator was fitted for, certified or not, smallest first."""
    return tuple(sorted({float(t.alpha) for t in getattr(calibrator, "thresholds_", ())}))


def certified_alphas(calibrator: Any) -> tuple[float, ...]:
    """The alphas with a certified threshold, smallest (strictest) first."""
    return tuple(sorted({float(t.alpha) for t in getattr(calibrator, "thresholds_", ())
                         if getattr(t, "threshold", None) is not None}))


def check_policy_thresholds(
    policy: Policy, load: Callable[[Path], Any]
) -> ThresholdReport:
    """:func:`certified_thresholds` on the calibrator the policy names, read with ``load``
    (``Calibrator.load``); a calibrator that cannot be read is a warning, not an error, since
    ``policy check`` also checks policies whose calibrator is fitted later."""
    cfg = policy.config
    uses = threshold_rules(cfg)
    base = ThresholdReport(policy=cfg.name, alpha=cfg.alpha, calibrator=cfg.calibrator, uses=uses)
    path = policy.calibrator_path
    if not uses or path is None or cfg.alpha is None:
        return base
    try:
        calibrator = load(path)
    except (GuardUQError, OSError) as exc:
        log.debug("threshold_check_unreadable", policy=cfg.name, calibrator=str(path), error=str(exc))
        return replace(base, readable=False, warning=(
            f"cannot tell whether alpha {cfg.alpha:g} is certified: calibrator {cfg.calibrator} "
            f"could not be read ({exc}); {_rule_list(uses)} compare risk with its threshold"
        ))
    return certified_thresholds(policy, calibrator)


def _record(t: Any) -> CertifiedThreshold:
    def get(name: str) -> Any:
        return getattr(t, name, None)

    threshold = get("threshold")
    return CertifiedThreshold(
        alpha=float(t.alpha), delta=get("delta"),
        threshold=None if threshold is None else float(threshold),
        n=get("n"), n_accepted=get("n_accepted"), coverage=get("coverage"),
        error_rate=get("error_rate"), upper_bound=get("upper_bound"), message=get("message"),
    )


def _uncertified(report: ThresholdReport) -> str:
    """Why the threshold rules cannot rely on a threshold, and what the calibrator does certify."""
    assert report.alpha is not None
    if report.record is None:  # Policy.bind refuses this pair outright
        head = (f"calibrator {report.calibrator} holds no threshold for alpha {report.alpha:g} "
                f"(it was fitted for {format_alphas(report.fitted_alphas) or 'no alpha'}), so binding "
                f"this policy to it raises PolicyError")
    else:  # Policy.bind accepts it; the threshold stays unknown and fails closed
        never = [u for u in report.uses if u.needs_threshold]
        partly = [u for u in report.uses if not u.needs_threshold]
        effects = [f"{_rule_list(never)} can never match"] if never else []
        if partly:
            effects.append(f"{_rule_list(partly)} can match only through conditions other than "
                           f"the threshold")
        head = (f"no threshold is certified at alpha {report.alpha:g} on calibrator "
                f"{report.calibrator}, so {' and '.join(effects)}")
    fitted = f" (fitted for {format_alphas(report.fitted_alphas)})" if report.fitted_alphas else ""
    if len(report.certified_alphas) == 1:
        certified = f"it certifies alpha {report.certified_alphas[0]:g} only{fitted}"
    elif report.certified_alphas:
        certified = (f"it certifies alpha {format_alphas(report.certified_alphas)}{fitted}; the smallest "
                     f"certified alpha is {report.smallest_certified_alpha:g}")
    else:
        certified = f"it certifies no alpha{fitted}"
    parts = [head, certified]
    if report.record is not None and report.record.message:
        parts.append(f"the calibrator says: {report.record.message}")
    return "; ".join(parts)


def empty_band_rules(config: PolicyConfig, threshold: float) -> list[str]:
    """Rules (nested ones included) whose risk bounds no value satisfies once ``threshold`` is
    known, e.g. ``risk: {gt: threshold, le: 0.75}`` when the certified threshold is 0.775."""
    out = []
    for rule in config.rules:
        rules = [(rule.name, rule)]
        if isinstance(rule, SecondOpinionRule):
            rules += [(f"{rule.name}/{inner.name}", inner) for inner in rule.rules]
        out += [name for name, r in rules if r.when is not None and _empty_band(r.when, threshold)]
    return out


def _empty_band(cond: Condition, threshold: float) -> bool:
    """Whether the conjunction of ``cond``'s risk bounds (its own and its ``all`` parts) is empty."""
    lows: list[tuple[float, bool]] = []  # (bound, strict)
    highs: list[tuple[float, bool]] = []

    def collect(c: Condition) -> None:
        for signal, comp in c.comparisons():
            if signal != "risk":
                continue
            for op, bound in comp.operators():
                value = threshold if bound == THRESHOLD else bound
                if op in ("gt", "ge", "lt", "le") and isinstance(value, int | float):
                    (lows if op in ("gt", "ge") else highs).append((float(value), op in ("gt", "lt")))
        for sub in c.all_ or []:
            collect(sub)

    collect(cond)
    if not lows or not highs:
        return False
    lo, lo_strict = max(lows, key=lambda b: (b[0], b[1]))
    hi, hi_strict = min(highs, key=lambda b: (b[0], not b[1]))
    return lo > hi or (lo == hi and (lo_strict or hi_strict))


def _rule_names(names: Sequence[str]) -> str:
    return f"rule {names[0]}" if len(names) == 1 else f"rules {', '.join(names)}"


def _with_warning(report: ThresholdReport, warning: str | None) -> ThresholdReport:
    return replace(report, warning=warning)


def _rule_list(uses: Sequence[ThresholdUse]) -> str:
    names = ", ".join(u.rule for u in uses)
    return f"rule {names}" if len(uses) == 1 else f"rules {names}"


def format_alphas(values: Sequence[float]) -> str:
    """Alphas as a reader sees them: ``0.5, 0.7``."""
    return ", ".join(f"{a:g}" for a in values)
