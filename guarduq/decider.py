"""The policy and calibrator in force, as one immutable pair, and how a new pair is loaded.

A ``Guard`` reads its ``Decider`` once per response when it decides, so replacing the whole object
(``Guard.reload``; ``guarduq serve``'s ``/admin/reload``, SIGHUP and ``--watch``) can never pair an
old policy with a new calibrator. ``Decider.load`` checks what a Guard checks when it is built
(policy schema, the model the policy is for, the calibrator's fingerprint, binding sinks and the
second opinion) and, for a reload, that the calibrator reads scores over the scorer's parameter set:
a file that fails raises before anything changes.

:func:`check_certified` is the one check, shared by ``Guard(...)``, ``Guard.reload`` and every
reload of ``guarduq serve``, that refuses a pair under which a threshold rule of the policy can
never match (the check ``guarduq policy check --strict`` makes), unless the caller forces it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guarduq._logging import get_logger
from guarduq.calibration import Calibrator, feature_matrix
from guarduq.errors import CalibrationError, FingerprintMismatchError, UncertifiedPairError
from guarduq.policy import Policy
from guarduq.policy.certified import certified_thresholds
from guarduq.store.sampling import ReviewSampler

if TYPE_CHECKING:
    from guarduq.models import ModelInfo
    from guarduq.scoring.uncertainty import Scores

log = get_logger("decider")

PolicySpec = Policy | str | os.PathLike[str] | None
CalibratorSpec = Calibrator | str | os.PathLike[str] | None


@dataclass(frozen=True)
class Binding:
    """What ``Policy.bind`` gets besides the calibrator, kept so that a reload binds alike."""

    second_opinion: Any = None
    allow_callables: tuple[str, ...] = ()
    sinks: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Identity:
    """Which pair decided a reply: ``policy`` is ``name@version``; None where there is none."""

    policy: str | None = None
    policy_sha256: str | None = None
    calibrator_sha256: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)


@dataclass(frozen=True)
class Decider:
    """A bound policy and its calibrator, and where they came from.

    ``policy_source``/``calibrator_source``: a ``Path`` is re-read by ``reloaded``; an object is
    kept as given (a ``Calibrator`` does not remember its file). A ``calibrator_source`` of None
    means the file the policy names, looked up again in each newly read policy.
    """

    policy: Policy | None = None
    calibrator: Calibrator | None = None
    policy_source: Path | Policy | None = None
    calibrator_source: Path | Calibrator | None = None
    binding: Binding = field(default_factory=Binding)
    # Draws the review sample from the replies this pair decides (``guarduq.traffic``), by its
    # policy's ``review`` settings; None without a policy. Built with the pair (``replace`` too),
    # so a sample is always drawn by the settings of the policy that decided the reply.
    review_sampler: ReviewSampler | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        sampler = ReviewSampler.from_settings(self.policy.config.review) if self.policy is not None else None
        object.__setattr__(self, "review_sampler", sampler)

    def keeps_text(self, sampled: bool) -> bool:
        """Whether a reply's text is stored: every reply's with ``audit.log_text``, a sampled one's
        with ``review.keep_text`` (the opt-ins); else its scores only."""
        p = self.policy
        return p is not None and (p.log_text or (sampled and p.config.review.keep_text))

    @property
    def identity(self) -> Identity:
        p, c = self.policy, self.calibrator
        return Identity(f"{p.name}@{p.version}" if p is not None else None,
                        p.sha256 if p is not None else None, c.sha256 if c is not None else None)

    def files(self) -> tuple[Path, ...]:
        """The files a reload re-reads (what ``guarduq serve --watch`` polls)."""
        cal = self.calibrator_source
        if cal is None and self.policy is not None:
            cal = self.policy.calibrator_path
        second = self.policy.second_calibrator_path if self.policy is not None else None
        return tuple(f for f in (self.policy_source, cal, second) if isinstance(f, Path))

    @classmethod
    def load(
        cls,
        policy: PolicySpec,
        calibrator: CalibratorSpec,
        model: ModelInfo,
        binding: Binding | None = None,
        *,
        parameter_set: str | None = None,
        strict: bool = False,
    ) -> Decider:
        """Read, check and bind a pair for ``model``. ``parameter_set``: the scorer's, which the
        calibrator must have been fitted over. ``strict`` (reloads): also check the fingerprint of a
        calibrator given as an object."""
        binding = binding or Binding()
        pol = Policy.from_yaml(policy) if isinstance(policy, str | os.PathLike) else policy
        spec = calibrator
        if calibrator is None and pol is not None:
            calibrator = pol.calibrator_path
        if isinstance(calibrator, str | os.PathLike):
            try:
                cal = Calibrator.load(calibrator, expected_fingerprint=model.fingerprint, expected_model=model.name)
            except FingerprintMismatchError as exc:
                if spec is not None or pol is None:
                    raise
                raise FingerprintMismatchError(f"policy {pol.name!r} ({pol.source}) names calibrator "
                                               f"{calibrator}: {exc}") from exc
        else:
            cal = calibrator
            if strict and cal is not None:
                cal.check_model(model.fingerprint, model_name=model.name)
        if cal is not None and parameter_set is not None and cal.parameter_set_ != parameter_set:
            raise CalibrationError(
                f"the calibrator was fitted on gradients over parameters '{cal.parameter_set_}', but this "
                f"Guard's scorer takes them over '{parameter_set}': a different set needs a different "
                "gradient, so it cannot be swapped in; start a new Guard (or server) with it"
            )
        bound = None
        if pol is not None:
            known_as = {model.name}
            if cal is not None and cal.model_fingerprint == model.fingerprint:
                known_as.add(cal.model_name)
            pol.check_model(known_as, model.fingerprint)
            second = pol.second_calibrator_path
            bound = pol.bind(second_opinion=binding.second_opinion, allow_callables=binding.allow_callables,
                             sinks=binding.sinks, calibrator=cal,
                             second_calibrator=Calibrator.load(second, expected_fingerprint=model.fingerprint,
                                                               expected_model=model.name)
                             if second is not None and cal is not None else None)
        return cls(bound, cal, policy_source=_source(policy, pol), calibrator_source=_source(spec, spec),
                   binding=binding)

    def reloaded(
        self,
        model: ModelInfo,
        *,
        policy: PolicySpec = None,
        calibrator: CalibratorSpec = None,
        parameter_set: str | None = None,
    ) -> Decider:
        """A new pair from ``policy``/``calibrator`` (None: this pair's sources, files re-read),
        bound as this one was; raises a ``GuardUQError`` naming what failed."""
        return Decider.load(
            policy if policy is not None else self.policy_source,
            calibrator if calibrator is not None else self.calibrator_source,
            model, self.binding, parameter_set=parameter_set, strict=True,
        )


def uncertified(pair: Decider) -> str | None:
    """Why a threshold rule of ``pair``'s policy can never match under its calibrator, as
    ``guarduq policy check --strict`` says it (its :func:`certified_thresholds`); None when none."""
    policy = pair.policy
    if policy is None:
        return None
    problems = [certified_thresholds(policy, pair.calibrator).warning]
    if getattr(policy, "second_calibrator_path", None) is not None and policy.second_threshold is None:
        problems.append(f"the second stage certifies no threshold at alpha {policy.alpha:g}: "
                        "so.risk <= so.threshold never holds")
    return "; ".join(p for p in problems if p) or None


def check_certified(pair: Decider, *, force: bool, how_to_force: str, event: str, **context: Any) -> None:
    """Refuse (``UncertifiedPairError``, its message ending in ``how_to_force``) a pair that
    :func:`uncertified` finds fault with; ``force`` takes it, logged as warning ``event``.
    Every reply such a pair would let through is withheld, so it never goes live unannounced."""
    problem = uncertified(pair)
    if problem is None:
        return
    if not force:
        raise UncertifiedPairError(f"{problem} ({how_to_force})", problem)
    log.warning(event, problem=problem[:1000], calibrator_sha256=pair.identity.calibrator_sha256, **context)


def _source(given: Any, obj: Any) -> Any:
    return Path(given) if isinstance(given, str | os.PathLike) else obj


def binding_of(second_opinion: Any, allow_callables: Collection[str], sinks: Mapping[str, Any] | None) -> Binding:
    """The ``Binding`` of a Guard's constructor arguments."""
    return Binding(second_opinion, tuple(allow_callables), dict(sinks) if sinks is not None else None)


def pair_attribute(name: str) -> property:
    """``Guard.policy``/``Guard.calibrator``: one half of the pair in force. Assigning one
    replaces the pair with a copy holding the new half, unchecked, as a plain attribute was."""

    def get(self: Any) -> Any:
        return getattr(self.decider, name)

    def set_(self: Any, value: Any) -> None:
        self.decider = replace(self.decider, **{name: value})

    return property(get, set_, doc=f"The {name} in force (``decider.{name}``).")


def calibrated_signals(
    calibrator: Calibrator | None, scores: Scores, extra: dict[str, float] | None = None,
    group: str | None = None,
) -> dict[str, float]:
    """``risk`` and the z-scores (``epistemic_z``, ``aleatoric_z``) the calibrator can give.

    ``extra``: opt-in features computed outside the scoring pass (e.g. ``p_true``); ``group``:
    the reply's traffic group, whose own risk model a per-group calibrator serves.

    The z-scores use the calibrator's own standardisation (its scaler was fitted on this model's
    calibration data), so 1.0 means one standard deviation above this model's usual value.
    """
    if calibrator is None:
        return {}
    if extra:
        scores = {**scores.to_dict(with_token_probs=False), **extra}  # type: ignore[assignment]
    out = {"risk": calibrator.risk(scores, group=group)}
    x, ok = feature_matrix([scores], calibrator.features)
    scaler = calibrator.pipeline_.named_steps["scale"]
    z = (x[0] - scaler.mean_) / scaler.scale_
    for feature, signal in (("log_epistemic", "epistemic_z"), ("aleatoric", "aleatoric_z")):
        if feature in calibrator.features:
            out[signal] = float(z[calibrator.features.index(feature)]) if ok[0] else math.nan
    return out
