"""A first policy for a calibrator: allow within the threshold certified at the strictest alpha it
certifies, abstain otherwise. What ``guarduq policy init`` writes, so that a user who fitted a
calibrator for their own model never hand-picks an alpha the calibrator cannot back.

Pure: reads the calibrator's thresholds (``thresholds_``) and returns YAML text; writes nothing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from guarduq.errors import PolicyError
from guarduq.policy.certified import certified_alphas, fitted_alphas, format_alphas


def choose_alpha(calibrator: Any, alpha: float | None = None) -> float:
    """``alpha`` if the calibrator certifies it, else the strictest alpha it does certify.

    Raises PolicyError when the asked alpha is not certified or nothing is: a policy whose allow
    rule can never match would withhold every reply while looking configured.
    """
    ok = certified_alphas(calibrator)
    if not ok:
        raise PolicyError(f"the calibrator certifies no alpha (fitted for {format_alphas(fitted_alphas(calibrator)) or 'none'}): "
                          "refit it on more labelled answers (calibrate says how many) before writing a policy on it")
    if alpha is None:
        return ok[0]
    if not any(math.isclose(alpha, a) for a in ok):
        raise PolicyError(f"the calibrator does not certify alpha {alpha:g}; it certifies {format_alphas(ok)}")
    return alpha


def starter_policy(calibrator: Any, calibrator_path: Path, out: Path, alpha: float, *,
                   name: str | None = None) -> str:
    """The YAML of a two-rule policy on ``calibrator`` (read from ``calibrator_path``) at
    ``alpha``, naming the calibrator relative to ``out``'s folder as policies do."""
    rec = next(t for t in calibrator.thresholds_ if math.isclose(float(t.alpha), alpha))
    rel = Path(os.path.relpath(calibrator_path.resolve(), out.resolve().parent)).as_posix()
    model = calibrator.model_name or "unknown"
    name = name or out.stem
    coverage = f", coverage {rec.coverage:.0%} of its threshold split" if getattr(rec, "coverage", None) else ""
    delta = getattr(rec, "delta", None) or 0.1
    certified = certified_alphas(calibrator)
    which = "strictest alpha the calibrator certifies" if math.isclose(alpha, certified[0]) else "alpha asked for"
    return f"""\
# Written by `guarduq policy init` for the calibrator {rel} (model {model}).
#
# Answer when the calibrated risk is within the threshold certified for alpha = {alpha:g}
# (risk <= {rec.threshold:.4g}{coverage}); otherwise abstain and say why.
# alpha {alpha:g} is the {which}; it certifies {format_alphas(certified)}.
# The guarantee (delta {delta:g}): on answers drawn like the calibration data, at most
# {alpha:.0%} of the answers this policy lets through are wrong, except with probability {delta:g}
# over the calibration draw. It says nothing about a single answer, or about traffic unlike the
# calibration data (README: "What the guarantee promises").
#
{_kinds(calibrator, alpha)}# Check it:  guarduq policy check --strict {out.name}
name: {_yaml_str(name)}
version: "1.0"
description: Answer when the calibrated risk is within the alpha = {alpha:g} certified threshold, abstain otherwise.
model: {_yaml_str(model)}
calibrator: {_yaml_str(rel)}   # relative to this file
alpha: {alpha:g}
mode: enforce
on_error:
  action: abstain
  message: "I can't check this answer right now, so I won't give it."
rules:
  - name: confident
    description: calibrated risk within the certified threshold (alpha {alpha:g}, delta {delta:g})
    when:
      risk: {{le: threshold}}
    action: allow
  - name: uncertain
    action: abstain
    message: >-
      I'm not confident enough to answer this reliably
      (estimated chance of a wrong answer: {{risk:.0%}}).
"""


def _kinds(calibrator: Any, alpha: float) -> str:
    """For a calibrator with a risk model per kind of traffic: which kinds are served by their own
    model at ``alpha`` (those with a certificate of their own) and how a reply names its kind."""
    models = sorted(getattr(calibrator, "group_models_", None) or {})
    if not models:
        return ""
    own = [g for g in models if any(math.isclose(t.alpha, alpha) and t.threshold is not None
                                    for t in calibrator.group_thresholds_.get(g, ()))]
    return (f"# Risk models per kind of traffic: {', '.join(models)}; at alpha {alpha:g} "
            f"{', '.join(own) if own else 'none'} {'is' if len(own) == 1 else 'are'} certified on their own\n"
            "# and decided by their own model and threshold, every other reply by the pooled ones. A reply\n"
            "# names its kind with guarduq.policy.traffic_group(...) in Python; for `guarduq serve`, add\n"
            "# groups: {from_key: true} (API key names) or {from_metadata: true} (trusted clients).\n#\n")


def _yaml_str(text: str) -> str:
    """A YAML double-quoted scalar (JSON's escaping is valid YAML), so a path or name with
    a colon, a quote or a leading symbol stays one string."""
    return json.dumps(text, ensure_ascii=False)
