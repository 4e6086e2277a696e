"""Singular Value Ensemble (SVE): a trained second opinion from M singular-value members.

``layers`` holds the SVD-parametrised layer and the module selection, ``training`` the
objectives and batch orders, ``io`` the SVD cache and artifact files, ``results`` what the
ensemble reports, ``ensemble`` the :class:`SVEnsemble` itself.
"""

from guarduq.sve.ensemble import DEFAULT_LR, SVEnsemble
from guarduq.sve.io import FORMAT, FORMAT_VERSION
from guarduq.sve.layers import (
    BIAS_MODES,
    GPT2_TARGETS,
    KNOWN_TARGETS,
    LLAMA_TARGETS,
    PARAMETRISATIONS,
    SVELinear,
    validate_settings,
)
from guarduq.sve.results import Overhead, SVEOpinion

__all__ = [
    "BIAS_MODES",
    "DEFAULT_LR",
    "FORMAT",
    "FORMAT_VERSION",
    "GPT2_TARGETS",
    "KNOWN_TARGETS",
    "LLAMA_TARGETS",
    "Overhead",
    "PARAMETRISATIONS",
    "SVELinear",
    "SVEOpinion",
    "SVEnsemble",
    "validate_settings",
]
