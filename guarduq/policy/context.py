"""What is in force for one reply besides its scores: its traffic group and the drift case.

A certificate is a statement about the traffic it was computed on. Two things can make the
pooled one the wrong statement for a reply, and the policy says what happens then:

- **the reply's group** (``groups``): a group with a certificate of its own (``calibrate
  --dataset reviews`` certifies per group) is decided with its own threshold; any other group
  falls back (``groups.fallback``: the pooled threshold, or escalate/abstain); a per-group
  calibrator's group model gives that group's risk only where the group is certified
  (:func:`risk_group`), so every threshold is applied to the risk it was certified on;
- **the live drift case** (``on_drift``): while the window reads ``unseen``, or
  ``slice:<group>`` for a group with no certificate of its own, the policy's drift action
  replaces the rules (and may raise review, up to every reply).

The group of a request is set around the Guard call with :func:`traffic_group` (``guarduq
serve`` does so from the API key's name or ``metadata.group``, by :func:`group_of`); the Guard reads it with
:func:`current_group`. The calibrator is read by attribute (``group_thresholds_``), as
``certified.py`` reads ``thresholds_``, so this layer imports no numpy.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from guarduq.errors import PolicyError
from guarduq.policy.schema import AbstainRule, EscalateRule, Override

MAX_GROUP = 64
_GROUP: ContextVar[str | None] = ContextVar("guarduq_traffic_group", default=None)


def check_group(name: Any) -> str | None:
    """A group name as requests may give it: a non-empty string of at most 64 characters."""
    if name is None:
        return None
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_GROUP or "\0" in name:
        raise PolicyError(f"a traffic group is a non-empty name of at most {MAX_GROUP} characters, got {name!r}")
    return name.strip()


@contextlib.contextmanager
def traffic_group(name: str | None) -> Iterator[None]:
    """Replies decided inside this block belong to traffic group ``name``."""
    token = _GROUP.set(check_group(name))
    try:
        yield
    finally:
        _GROUP.reset(token)


def current_group() -> str | None:
    return _GROUP.get()


def group_of(policy: Any, metadata_group: str | None = None, key_name: str | None = None) -> str | None:
    """A request's group, first found of: the name of the API key that authenticated it, where the
    policy's ``groups.from_key`` says so (the operator's assignment, which a client cannot
    override); its ``metadata.group``, where ``groups.from_metadata`` trusts clients to say it;
    the policy's ``groups.default`` (None: pooled traffic)."""
    settings = getattr(getattr(policy, "config", None), "groups", None)
    if settings is None:
        return None
    if key_name is not None and settings.from_key:
        return check_group(key_name)
    if metadata_group is not None and settings.from_metadata:
        return check_group(metadata_group)
    return settings.default


def group_threshold(calibrator: Any, alpha: float | None, group: str | None) -> float | None:
    """The group's own certified threshold at ``alpha`` (None: it has none)."""
    if group is None or alpha is None:
        return None
    for t in (getattr(calibrator, "group_thresholds_", None) or {}).get(group, ()):
        if math.isclose(t.alpha, alpha):
            return None if t.threshold is None else float(t.threshold)
    return None


def risk_group(policy: Any, calibrator: Any, group: str | None) -> str | None:
    """The group whose own risk model serves a reply of ``group`` (``Calibrator(per_group=True)``),
    or None for the pooled risk. A group model's risk is covered by that group's own certificate
    only, so under a policy it serves only where the group has one at the policy's alpha; any
    other reply gets the pooled risk, which the pooled certificate covers."""
    if group is None or group not in (getattr(calibrator, "group_models_", None) or {}):
        return None
    cfg = getattr(policy, "config", None)
    if cfg is None:  # no decision: the best risk estimate
        return group
    return group if group_threshold(calibrator, cfg.alpha, group) is not None else None


@dataclass(frozen=True)
class InForce:
    """One reply's group, the drift case, which certificate decides it, and any override."""

    group: str | None = None
    drift: str | None = None  # ok / slice:<group> / unseen; None: no drift monitor, or still filling
    certificate: str = "pooled"  # "group": the group's own threshold; "pooled"; "override"
    threshold: float | None = None  # the group's own threshold (None: the policy's pooled one)
    rule: AbstainRule | EscalateRule | None = None  # replaces the rules when set
    reason: str | None = None  # why an override or fallback is in force
    review_rate: float = 0.0  # review at least this share of these replies (the drift action's)

    def signals(self) -> dict[str, float]:
        """What goes into the policy's signals: the group's own threshold, where it has one."""
        return {"risk_threshold": self.threshold} if self.threshold is not None else {}

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "drift": self.drift, "certificate": self.certificate,
                "override": self.rule.name if self.rule is not None else None, "reason": self.reason,
                "review_rate": self.review_rate}


def in_force(policy: Any, calibrator: Any, group: str | None, drift: str | None) -> InForce:
    """What decides a reply of ``group`` while the drift window reads ``drift``.

    A group without a certificate of its own gets ``groups.fallback``; a drift case that calls
    for it gets ``on_drift``'s action. Where both force an action, the drift one wins (it says
    the traffic itself is unmeasured); review rates take the larger of the two."""
    cfg = getattr(policy, "config", None)
    if cfg is None:
        return InForce(group, drift)
    own = group_threshold(calibrator, cfg.alpha, group)
    found: list[tuple[str, Override, str]] = []
    if group is not None and calibrator is not None and own is None:
        found.append(("group_fallback", cfg.groups.fallback,
                      f"group {group!r} has no certificate of its own at alpha={cfg.alpha}"))
    drift_action = _drift_override(cfg, calibrator, cfg.alpha, drift)
    if drift_action is not None:
        found.append((*drift_action, f"drift case {drift}"))
    rate = max((float(o.review_rate or 0.0) for _, o, _ in found), default=0.0)
    forcing = [(name, o, why) for name, o, why in reversed(found) if o.action != "rules"]
    if forcing:
        name, o, why = forcing[0]
        return InForce(group, drift, "override", None, _as_rule(name, o), why, rate)
    why = found[-1][2] if found else None
    return InForce(group, drift, "group" if own is not None else "pooled", own, None, why, rate)


def _drift_override(cfg: Any, calibrator: Any, alpha: float | None, drift: str | None) -> tuple[str, Override] | None:
    """The policy's drift action for this case, if the case calls for one."""
    if drift == "unseen":
        return "on_drift_unseen", cfg.on_drift.unseen
    uncertified = drift is not None and group_threshold(calibrator, alpha, drift.removeprefix("slice:")) is None
    if drift is not None and drift.startswith("slice:") and uncertified:
        return "on_drift_slice", cfg.on_drift.slice
    return None


def _as_rule(name: str, o: Override) -> AbstainRule | EscalateRule | None:
    """The override as a rule the engine finishes like any other (sinks, shadow mode)."""
    if o.action == "abstain":
        return AbstainRule(name=name, action="abstain", message=o.message)
    if o.action == "escalate":
        return EscalateRule(name=name, action="escalate", sink=o.sink or "", hold=o.hold, message=o.message)
    return None
