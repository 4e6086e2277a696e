"""The policy file's schema: the signals a rule may read and the pydantic models of the YAML
(the external boundary). Nothing here evaluates anything."""

from __future__ import annotations

import math
import string
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    field_validator,
    model_validator,
)

from guarduq.calibration.splits import TEST_FRACTION, THRESHOLD_FRACTION
from guarduq.policy.escalation import SinkConfig

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
SO_NUMERIC = ("so.mean_prob", "so.variance", "so.mutual_information", "so.risk")
SO_BOOL = ("so.agrees",)
THRESHOLD = "threshold"  # the word a policy writes; the signal carrying its value:
THRESHOLD_SIGNAL = "risk_threshold"
# A cascade (``second_calibrator``): ``so.risk`` is its second stage's risk, ``so.threshold`` the
# threshold certified for it at ``alpha``, and ``band`` the upper edge of the first-stage risk band
# it was fitted and certified in (guarduq.calibration.cascade).
SO_THRESHOLD = "so.threshold"
SO_THRESHOLD_SIGNAL = "so.risk_threshold"
BAND = "band"
BAND_SIGNAL = "band_upper"
# Words a bound may be, and the signal that carries each word's value.
WORDS: dict[str, str] = {THRESHOLD: THRESHOLD_SIGNAL, SO_THRESHOLD: SO_THRESHOLD_SIGNAL, BAND: BAND_SIGNAL}

# Names a message template may cite: {risk:.0%}, {threshold:.0%}, {so_mean_prob:.2f}, ...
TEMPLATE_NAMES = frozenset(
    [*BASE_SIGNALS, THRESHOLD, BAND, "so_threshold", *(s.replace(".", "_") for s in SO_NUMERIC + SO_BOOL)]
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
        raise ValueError(f"expected a number or one of {', '.join(map(repr, WORDS))}, got a boolean")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value}")
        return float(value)
    if isinstance(value, str) and value in WORDS:
        return value
    raise ValueError(f"expected a number or one of {', '.join(map(repr, WORDS))}, got {value!r}")


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
    so_risk: Comparison | None = Field(None, alias="so.risk")

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


class RiskBand(_Strict):
    """Sample more replies whose risk lies in [low, high] (e.g. the borderline band)."""

    low: float = Field(ge=0, le=1)
    high: float = Field(ge=0, le=1)
    rate: float = Field(gt=0, le=1, description="probability that a reply in the band is sampled")

    @model_validator(mode="after")
    def _ordered(self) -> RiskBand:
        if self.low > self.high:
            raise ValueError(f"band low {self.low} is above high {self.high}")
        return self


class ReviewSettings(_Strict):
    """Which replies go to human review (``guarduq serve --store``): every escalation, a uniform
    random sample at ``rate``, and optionally more from risk ``bands``. Only sampled replies keep
    their text, and only with ``keep_text: true`` (the opt-in)."""

    keep_text: bool = Field(False, description="keep prompt and reply text of sampled replies")
    rate: float = Field(0.0, ge=0, le=1, description="uniform sampling rate over all replies")
    escalations: bool = Field(True, description="sample every escalated reply")
    bands: list[RiskBand] = Field(default_factory=list)
    # How `guarduq calibrate --dataset reviews --policy FILE` splits the uniform labels, and so how
    # many the review page's progress line says the alpha needs: one setting for both.
    threshold_fraction: float = Field(THRESHOLD_FRACTION, gt=0, lt=1, description="share of the uniform labels the "
                                      "certificate rests on (calibrate's threshold split)")
    test_fraction: float = Field(TEST_FRACTION, ge=0, lt=1, description="share of the uniform labels held out to "
                                 "measure the calibrator (calibrate's test split)")

    @model_validator(mode="after")
    def _fractions(self) -> ReviewSettings:
        if self.threshold_fraction + self.test_fraction >= 1:
            raise ValueError(f"threshold_fraction + test_fraction must be < 1 (the rest fits the risk "
                             f"model), got {self.threshold_fraction} + {self.test_fraction}")
        return self


DEFAULT_UNMEASURED = ("This question is of a kind the answer checks were not measured on, so the answer "
                      "is held for review.")


class Override(_Strict):
    """What a reply gets while a condition holds, in place of the rules: ``rules`` (decide as
    usual), ``abstain`` or ``escalate`` (to ``sink``, or with no sink, withheld and sent to the
    review queue only, as every escalation is sampled); ``review_rate`` raises review to at least
    that share of these replies. The message never quotes a risk: it is not the reason."""

    action: Literal["rules", "abstain", "escalate"] = "rules"
    sink: str | None = None
    hold: bool = Field(True, description="escalate: true shows `message` instead of the answer")
    message: Message = DEFAULT_UNMEASURED
    review_rate: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if data == "pooled":  # groups.fallback: pooled = the rules with the pooled threshold
            return {"action": "rules"}
        return {"action": data} if isinstance(data, str) else data


class OnDrift(_Strict):
    """What happens while the live drift window reads ``unseen``, or ``slice:<group>`` for a
    group with no certificate of its own (``guarduq.calibration.drift_groups``)."""

    unseen: Override = Override()
    slice: Override = Override()


class GroupSettings(_Strict):
    """Traffic groups: a reply's group is, first found, the name of the API key that authenticated
    its request where ``from_key`` says so (``guarduq serve --api-key-env`` entries ``NAME:KEY``),
    its request's ``metadata.group`` where ``from_metadata`` trusts clients to say it, else
    ``default``; a group with a certificate of its own (``calibrate --dataset reviews``) is
    decided with its own threshold, any other by ``fallback``.

    A key's name wins over the client's metadata: it is the operator's assignment. Both are off by
    default: a client that may name its group may name the one with the loosest certificate,
    which says nothing about its traffic (fail closed)."""

    from_key: bool = False
    from_metadata: bool = False
    default: str | None = Field(None, min_length=1, max_length=64)
    fallback: Override = Override()  # `pooled` (the default), `escalate`, or an Override


class PolicyConfig(_Strict):
    """The whole policy file."""

    name: str = Field(min_length=1)
    version: str = Field(min_length=1)
    description: str = ""
    model: str | None = Field(None, description="expected model name or fingerprint (prefix)")
    calibrator: str | None = Field(None, description="artifact path, relative to the policy file")
    second_calibrator: str | None = Field(
        None, description="a cascade's second stage (guarduq calibrate --cascade-on), relative to the policy "
        "file: gives so.risk, so.threshold and band")
    alpha: float | None = Field(None, gt=0, lt=1, description="selects `threshold`")
    mode: Literal["enforce", "shadow"] = "enforce"
    on_error: OnError = OnError()
    audit: AuditSettings = AuditSettings()
    review: ReviewSettings = ReviewSettings()
    on_drift: OnDrift = OnDrift()
    groups: GroupSettings = GroupSettings()
    sinks: dict[str, SinkConfig] = Field(default_factory=dict)
    rules: list[Rule] = Field(min_length=1)

    @field_validator("version", mode="before")
    @classmethod
    def _version_str(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
