"""The second-opinion interface a policy asks: what a provider returns, how it is called.

``SecondOpinion`` is the checked result (the SVE ensemble's, or any provider's),
``SecondOpinionProvider`` what a provider must offer; ``as_provider`` also accepts a plain
callable, and ``ask`` passes ``ended=`` to providers that take it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from guarduq.errors import PolicyError
from guarduq.policy.conditions import _fmt


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
    """Anything with ``second_opinion(prompt, response)``, e.g. ``guarduq.sve.SVEnsemble``.

    A provider that also takes ``ended=`` is told whether the reply closed its turn, so it scores
    the reply in the same layout as the first opinion (a reply cut by ``max_new_tokens`` has no
    end-of-turn token).
    """

    def second_opinion(self, prompt: Any, response: str) -> Any: ...


def as_provider(obj: Any) -> SecondOpinionProvider:
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


def ask(provider: SecondOpinionProvider, prompt: Any, response: str, ended: bool) -> Any:
    """``provider.second_opinion``, with ``ended=`` when its signature takes it."""
    fn = provider.fn if isinstance(provider, _CallableProvider) else provider.second_opinion
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        params = ()
    if any(p.name == "ended" or p.kind is p.VAR_KEYWORD for p in params):
        return fn(prompt, response, ended=ended)
    return fn(prompt, response)


def summary(so: SecondOpinion) -> str:
    return (f"mean_prob={_fmt(so.mean_prob)} variance={_fmt(so.variance)} "
            f"mutual_information={_fmt(so.mutual_information)} agrees={_fmt(so.agrees)}")
