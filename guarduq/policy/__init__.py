"""YAML policies: ordered rules over uncertainty signals that decide what the user sees (no torch).

``schema`` holds the signals and the pydantic models of the file, ``validation`` reports every
problem with its file:line:field, ``conditions`` evaluates conditions in three-valued logic,
``engine`` holds the :class:`Policy` and the ``Decision`` it returns, ``second_opinion`` the
interface a second opinion offers. ``escalation`` delivers escalated answers to sinks; ``audit`` writes the log.
"""

from guarduq.policy.audit import AuditLog, make_record
from guarduq.policy.conditions import Check
from guarduq.policy.context import InForce, current_group, group_of, in_force, traffic_group
from guarduq.policy.engine import Decision, EscalationInfo, Policy
from guarduq.policy.escalation import (
    CallableSink,
    CallableSinkConfig,
    JsonlSink,
    JsonlSinkConfig,
    Sink,
    SinkConfig,
    WebhookSink,
    WebhookSinkConfig,
    make_sink,
)
from guarduq.policy.schema import (
    ACTIONS,
    BASE_SIGNALS,
    CALIBRATED_SIGNALS,
    OPERATORS,
    SO_BOOL,
    SO_NUMERIC,
    TEMPLATE_NAMES,
    THRESHOLD,
    THRESHOLD_SIGNAL,
    Condition,
    PolicyConfig,
    make_signals,
    render_template,
)
from guarduq.policy.second_opinion import SecondOpinion, SecondOpinionProvider
from guarduq.policy.validation import PolicyIssue, validate_policy_text

__all__ = [
    "ACTIONS",
    "BASE_SIGNALS",
    "CALIBRATED_SIGNALS",
    "OPERATORS",
    "SO_BOOL",
    "SO_NUMERIC",
    "TEMPLATE_NAMES",
    "THRESHOLD",
    "THRESHOLD_SIGNAL",
    "AuditLog",
    "CallableSink",
    "CallableSinkConfig",
    "Sink",
    "Check",
    "Condition",
    "Decision",
    "EscalationInfo",
    "InForce",
    "JsonlSink",
    "JsonlSinkConfig",
    "Policy",
    "PolicyConfig",
    "PolicyIssue",
    "SecondOpinion",
    "SecondOpinionProvider",
    "SinkConfig",
    "WebhookSink",
    "WebhookSinkConfig",
    "current_group",
    "group_of",
    "in_force",
    "make_record",
    "make_signals",
    "make_sink",
    "render_template",
    "traffic_group",
    "validate_policy_text",
]
