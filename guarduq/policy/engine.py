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
A cascade names a ``second_calibrator`` (a second stage fitted on a band of first-stage risk:
``guarduq.calibration.cascade``): then ``so.risk`` is its risk from the first-stage risk and the
second opinion, ``so.threshold`` its certified threshold at ``alpha``, and ``band`` the upper edge
of the band it was fitted in.

Failures fail closed: when a signal is not finite, the second opinion or a sink fails, the
``on_error`` action applies (default: abstain). Misconfiguration (unknown keys, a second-opinion
rule without a provider, a callable sink outside the allow-list) raises ``PolicyError`` early.

This module knows nothing of torch; it receives plain numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from guarduq._logging import get_logger
from guarduq.errors import EscalationError, PolicyError
from guarduq.policy.conditions import Check, _evaluate, _fmt, _signals_in
from guarduq.policy.escalation import make_sink
from guarduq.policy.schema import (
    BAND_SIGNAL,
    DEFAULT_ABSTAIN,
    SO_THRESHOLD_SIGNAL,
    THRESHOLD,
    THRESHOLD_SIGNAL,
    AbstainRule,
    AllowRule,
    PolicyConfig,
    SecondOpinionRule,
    render_template,
)
from guarduq.policy.second_opinion import (
    SecondOpinion,
    SecondOpinionProvider,
    as_provider,
    ask,
    summary,
)
from guarduq.policy.second_stage import check_second_stage, second_stage_row
from guarduq.policy.validation import _raise_issues, validate_policy_text

log = get_logger("policy")

# A reply withheld because no threshold is certified at the policy's alpha gets this text, never
# the rule's own message: that message may quote the risk, which is not the reason here.
UNCERTIFIED = ("This answer is withheld: the guardrail has no certified risk threshold at alpha "
               "{alpha:g}, so it cannot let any answer through until its calibrator is refitted "
               "with enough labelled answers.")

# ---------------------------------------------------------------- decisions


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


# ---------------------------------------------------------------- failures


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
        self._second: Any = None  # a cascade's second-stage calibrator, when bound
        self.second_threshold: float | None = None
        self.band_upper: float | None = None
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
        except ValueError as exc:  # a NUL or a lone surrogate in the path
            raise PolicyError(f"cannot read policy file {str(path)!r}: {exc}") from exc
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
        return self._from_file(self.config.calibrator)

    @property
    def second_calibrator_path(self) -> Path | None:
        return self._from_file(self.config.second_calibrator)

    def _from_file(self, name: str | None) -> Path | None:
        """A path the policy names, relative to the policy file's folder."""
        if name is None:
            return None
        path = Path(name)
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
        second_calibrator: Any = None,
    ) -> Policy:
        """A copy with its sinks built, its second-opinion provider attached and, given the
        calibrator (``guarduq.calibration.Calibrator``), the risk threshold ``alpha`` selects.

        Raises ``PolicyError`` when a rule asks for a second opinion and none is given, when a
        callable sink is not in ``allow_callables``, when ``sinks`` names an undeclared sink, or
        when the rules need a calibrated signal the calibrator cannot give. A cascade also needs
        its ``second_calibrator``, fitted above this calibrator's threshold at ``alpha``.
        """
        threshold = self._threshold_from(calibrator)
        second_threshold, band_upper = self.second_stage(second_calibrator, calibrator, threshold)
        if second_calibrator is not None and second_threshold is None:
            log.warning("no_certified_second_threshold", policy=self.name, alpha=self.alpha,
                        detail="the second stage certifies no threshold at alpha: so.risk <= so.threshold never holds")
        if self.uses_second_opinion and second_opinion is None:
            names = [r.name for r in self.config.rules if isinstance(r, SecondOpinionRule)]
            raise PolicyError(
                f"policy {self.name!r} asks for a second opinion (rule {', '.join(names)}) but no "
                f"second-opinion provider is configured: pass second_opinion=<an SVEnsemble> "
                "(on the command line: --sve FILE)"
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
        bound._provider = as_provider(second_opinion) if second_opinion is not None else None
        bound._sinks = built
        bound._calibrated = calibrator is not None
        bound.risk_threshold = threshold
        bound._second, bound.second_threshold, bound.band_upper = second_calibrator, second_threshold, band_upper
        return bound

    def second_stage(self, second: Any, first: Any, threshold: float | None) -> tuple[float | None, float | None]:
        """(so.threshold, band) of a cascade's second stage, checked against the first stage and
        its ``threshold``; ``PolicyError`` for one fitted for another first stage, alpha or band."""
        if self.config.second_calibrator is None:
            if second is not None:
                raise PolicyError(f"policy {self.name!r} names no second_calibrator, but one was given")
            return None, None
        if second is None:
            if first is None:  # an unbound policy (decide passes the signals itself)
                return None, None
            raise PolicyError(f"policy {self.name!r} is a cascade: load its second_calibrator "
                              f"({self.config.second_calibrator}) with its calibrator")
        return check_second_stage(self.name, self.alpha, second, first, threshold)

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
        ended: bool = True,
        override: Any = None,
        override_reason: str | None = None,
    ) -> Decision:
        """Apply the rules to ``signals`` (see ``make_signals``); first match wins.

        ``ended`` (whether the reply closed its turn) is handed to a second-opinion provider
        that accepts it. ``override``: a rule that replaces the rules for this reply (a drift
        action, a group's fallback: ``guarduq.policy.context``), ``override_reason`` why.

        Runtime failures (a non-finite signal, a failing second opinion or sink) give the
        ``on_error`` decision; configuration mistakes raise ``PolicyError``.
        """
        provider = as_provider(second_opinion) if second_opinion is not None else self._provider
        if self.uses_second_opinion and provider is None:
            self.bind()  # raises the clear "no provider" error
        sinks = self._bound_sinks()
        values = self._checked_values(signals)
        risk, threshold = values.get("risk"), values.get(THRESHOLD_SIGNAL)
        try:
            _check_finite(values, self.signals_used())
            lines: list[str] = []
            waiting: list[str] = []  # rules left undecided by an uncertified threshold
            if override is not None:
                rule, checks = override, []
                lines.append(f"in force: {override_reason or override.name} (the rules are not applied)")
            else:
                rule, checks = self._first_match(self.config.rules, values, lines, prefix="", waiting=waiting)
            so, outer_name = None, None
            if isinstance(rule, SecondOpinionRule):
                assert provider is not None  # checked above
                try:
                    so = SecondOpinion.coerce(ask(provider, prompt, response, ended))
                except Exception as exc:  # a provider failure is a runtime failure, not a crash
                    raise _Failure("second_opinion", exc) from exc
                values.update(so.signals())
                values["so.risk"] = self._second_risk(risk, so)
                lines.append(f"second opinion: {summary(so)}"
                             + (f" risk={_fmt(values['so.risk'])}" if self._second is not None else ""))
                outer, outer_name = rule, rule.name
                rule, inner_checks = self._first_match(outer.rules, values, lines, prefix=f"{outer.name}/",
                                                       waiting=waiting)
                checks += inner_checks
            return self._finish(rule, outer_name, values, checks, lines, so, response=response, prompt=prompt,
                                ids={"request_id": request_id, "model_fingerprint": model_fingerprint},
                                sinks=sinks, risk=risk, threshold=threshold, waiting=waiting)
        except _Failure as failure:
            return self._error_decision(str(failure), response=response, risk=risk, threshold=threshold,
                                        escalation=failure.escalation)

    def _second_risk(self, risk: float | None, so: SecondOpinion) -> float | None:
        """The second stage's risk from the first stage's and the second opinion's numbers."""
        if self._second is None or risk is None:
            return None
        row = second_stage_row(risk, so.mean_prob, so.variance, so.mutual_information, so.agrees)
        try:
            return float(self._second.risk(row))
        except Exception as exc:  # a failing second stage is a runtime failure: on_error decides
            raise _Failure("second_stage", exc) from exc

    def on_error_decision(self, stage: str, error: BaseException | str, *, response: str = "") -> Decision:
        """The decision when a step before ``decide`` failed (e.g. scoring)."""
        return self._error_decision(str(_Failure(stage, error)), response=response)

    # -- internals

    def _checked_values(self, signals: Mapping[str, Any]) -> dict[str, Any]:
        values = dict(signals)
        if self._calibrated:
            values.setdefault(THRESHOLD_SIGNAL, self.risk_threshold)
        if self._second is not None:
            values.setdefault(BAND_SIGNAL, self.band_upper)
            values.setdefault(SO_THRESHOLD_SIGNAL, self.second_threshold)
        missing = sorted(s for s in self.signals_used() if not s.startswith("so.") and s not in values)
        if missing:
            raise PolicyError(f"policy {self.name!r} needs signal(s) {missing} that were not provided")
        return values

    def _first_match(
        self, rules: Sequence[Any], values: Mapping[str, Any], lines: list[str], prefix: str,
        waiting: list[str] | None = None,
    ) -> tuple[Any, list[Check]]:
        """The first rule that holds; rules that stay unknown because a threshold they compare
        with is not certified are added to ``waiting``."""
        for rule in rules:
            checks: list[Check] = []
            result = True if rule.when is None else _evaluate(rule.when, values, checks)
            detail = "; ".join(str(c) for c in checks) or "no condition"
            lines.append(f"{'match' if result else 'skip '} {prefix}{rule.name}: {detail}")
            if result is True:
                return rule, checks
            if result is None and waiting is not None and any(
                    c.result is None and f"{THRESHOLD} unknown" in c.bound for c in checks):  # so.threshold too
                waiting.append(f"{prefix}{rule.name}")
        return None, []

    def _finish(self, rule: Any, outer_name: str | None, values: Mapping[str, Any], checks: list[Check], lines: list[str],
                so: SecondOpinion | None, *, response: str, prompt: Any, ids: Mapping[str, Any],
                sinks: Mapping[str, Any], risk: float | None, threshold: float | None,
                waiting: Sequence[str] = ()) -> Decision:
        template_values = {k.replace(".", "_"): v for k, v in values.items()}
        template_values[THRESHOLD] = values.get(THRESHOLD_SIGNAL)
        template_values["so_threshold"] = values.get(SO_THRESHOLD_SIGNAL)
        template_values["band"] = values.get(BAND_SIGNAL)
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
            # an override without a sink: withheld for the review queue only (no delivery)
            escalation = EscalationInfo(rule.sink, rule.hold, delivered=False) if rule.sink else None
        if waiting and not shown:  # withheld for want of a certificate: say so, quote no risk
            text = UNCERTIFIED.format(alpha=self.alpha)
            lines.append(f"withheld because no threshold is certified at alpha {self.alpha:g} "
                         f"({', '.join(waiting)} could not decide); the reply says so")
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


def _check_finite(values: Mapping[str, Any], used: Collection[str]) -> None:
    for name in sorted(used):
        value = values.get(name)
        if name.startswith("so.") or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Failure("signals", f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise _Failure("signals", f"{name} is {value}")


def _explain(rule: str | None, action: str, lines: list[str]) -> str:
    head = f"rule {rule!r} -> {action}" if rule else f"no rule matched -> {action}"
    return "\n".join([head, *("  " + line for line in lines)])
