"""Which parameters the epistemic gradient covers, and how its norm is reported by group.

A selection is named by ``parameter_set_id`` (``all``, ``last_n_blocks=2``, ...); the name is
recorded in every ``Scores``, cache line and calibrator, since a gradient over another set of
parameters is another quantity. ``parameter_groups`` labels each selected parameter for the
``grad_profile`` (embeddings, each block's attention / MLP / norms, final norm, head), from which
any union of groups can be read back (``calibration.features.restrict_profile``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from guarduq.errors import InputError

if TYPE_CHECKING:
    from torch import nn

# What transformers calls a model's list of blocks (Llama/Gemma ``layers``, GPT-2 ``h``, ...).
BLOCK_LIST_NAMES = "layers|h|blocks|block|layer"
_BLOCK_INDEX = re.compile(rf"\.(?:{BLOCK_LIST_NAMES})\.(\d+)\.")

ALL_PARAMETERS = "all"


def parameter_set_id(patterns: str | Sequence[str] | None, last_n_blocks: int | None) -> str:
    """The canonical name of a parameter selection, recorded in every ``Scores``, cache line and
    calibrator: ``all``, ``last_n_blocks=2``, ``parameters=["mlp\\."]`` or both joined by ``;``."""
    parts = []
    if patterns is not None:
        parts.append("parameters=" + json.dumps([patterns] if isinstance(patterns, str) else list(patterns)))
    if last_n_blocks is not None:
        parts.append(f"last_n_blocks={int(last_n_blocks)}")
    return ";".join(parts) or ALL_PARAMETERS


def parse_parameter_set(name: str) -> tuple[list[str] | None, int | None]:
    """(patterns, last_n_blocks) back from ``parameter_set_id``; ``InputError`` if malformed."""
    if name == ALL_PARAMETERS:
        return None, None
    patterns: list[str] | None = None
    last_n: int | None = None
    rest = name
    try:
        if rest.startswith("parameters="):
            value, end = json.JSONDecoder().raw_decode(rest, len("parameters="))
            patterns = [str(x) for x in value]
            rest = rest[end + 1 :] if rest[end : end + 1] == ";" else rest[end:]
        if rest.startswith("last_n_blocks="):
            last_n, rest = int(rest[len("last_n_blocks=") :]), ""
    except (ValueError, TypeError) as exc:
        raise InputError(f"malformed parameter set {name!r}") from exc
    if rest or parameter_set_id(patterns, last_n) != name:
        raise InputError(f"malformed parameter set {name!r}")
    return patterns, last_n


def resolve_selection(
    parameters: str | Sequence[str] | None,
    last_n_blocks: int | None,
    fitted: str | None,
    *,
    default_last_n_blocks: int | None = None,
) -> dict[str, Any]:
    """``GradientScorer`` arguments: the caller's selection, else the one a calibrator was
    ``fitted`` on (it reads scores over no other set), else the default. ``parameters="all"``
    names every parameter explicitly. A caller's selection other than ``fitted`` is an error."""
    if parameters == ALL_PARAMETERS:
        if last_n_blocks is not None:
            raise InputError('parameters="all" and last_n_blocks exclude each other')
        chosen: dict[str, Any] = {"parameters": None, "last_n_blocks": None}
    elif parameters is not None or last_n_blocks is not None:
        chosen = {"parameters": parameters, "last_n_blocks": last_n_blocks}
    elif fitted is not None:
        patterns, last_n = parse_parameter_set(fitted)
        return {"parameters": patterns, "last_n_blocks": last_n}
    else:
        chosen = {"parameters": None, "last_n_blocks": default_last_n_blocks}
    name = parameter_set_id(chosen["parameters"], chosen["last_n_blocks"])
    if fitted is not None and name != fitted:
        raise InputError(
            f"the calibrator was fitted on gradients over parameters '{fitted}', not '{name}': "
            "score with its set (leave parameters unset), or fit a calibrator for this set"
        )
    return chosen


def select_parameters(
    model: nn.Module,
    patterns: str | Sequence[str] | None = None,
    last_n_blocks: int | None = None,
) -> list[tuple[str, nn.Parameter]]:
    """Parameters that enter the gradient norm (default: all; tied weights once).

    ``patterns`` are regular expressions searched in parameter names; ``last_n_blocks`` keeps the
    parameters of the last N transformer blocks. Both given: a parameter must satisfy both.
    """
    named = list(model.named_parameters())  # de-duplicates tied parameters
    if isinstance(patterns, str):
        patterns = [patterns]
    if patterns is not None:
        try:
            regexes = [re.compile(p) for p in patterns]
        except re.error as exc:
            raise InputError(f"invalid parameter pattern: {exc}") from exc
        named = [(n, p) for n, p in named if any(r.search(n) for r in regexes)]
    if last_n_blocks is not None:
        if last_n_blocks < 1:
            raise InputError(f"last_n_blocks must be >= 1, got {last_n_blocks}")
        indices = {int(m.group(1)) for n, _ in named if (m := _BLOCK_INDEX.search(n))}
        if not indices:
            raise InputError("last_n_blocks given but no numbered transformer blocks were found")
        first = max(indices) - last_n_blocks + 1
        named = [
            (n, p) for n, p in named if (m := _BLOCK_INDEX.search(n)) and int(m.group(1)) >= first
        ]
    if not named:
        raise InputError("no parameters selected for the gradient norm")
    return named


def parameter_groups(model: nn.Module, selected: list[tuple[str, nn.Parameter]]) -> list[str]:
    """The ``grad_profile`` group of each selected parameter.

    ``embed``: token and position embeddings, and an LM head tied to them (one shared matrix,
    one parameter, counted once, cross term included); ``head``: an untied LM head;
    ``block.{i}.norm`` / ``.attn`` / ``.mlp`` / ``.other`` inside numbered block i (a norm
    inside attention, e.g. Gemma's q_norm, is a norm); ``final_norm``; ``other``.
    """
    # torch here, not above: the calibrator reads the selection's names without it
    from torch import nn

    emb = optional_call(model, "get_input_embeddings")
    head = optional_call(model, "get_output_embeddings")
    head_params = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    modules = dict(model.named_modules())
    groups = []
    for name, p in selected:
        path = name.rsplit(".", 1)[0] if "." in name else ""
        leaf = path.rsplit(".", 1)[-1]
        is_norm = "norm" in leaf.lower() or leaf.startswith("ln")
        if (isinstance(emb, nn.Module) and p is getattr(emb, "weight", None)) or isinstance(
            modules.get(path), nn.Embedding
        ):
            groups.append("embed")
        elif id(p) in head_params:
            groups.append("head")
        elif m := _BLOCK_INDEX.search(name):
            rest = name[m.end() :].lower()
            kind = (
                "norm" if is_norm
                else "attn" if "attn" in rest or "attention" in rest
                else "mlp" if "mlp" in rest or "ffn" in rest or "feed_forward" in rest
                else "other"
            )
            groups.append(f"block.{m.group(1)}.{kind}")
        else:
            groups.append("final_norm" if is_norm else "other")
    return groups


def grad_profile(groups: Sequence[str], totals: Sequence[float]) -> dict[str, float]:
    """Per-group sums (math.fsum) of the per-parameter squared norms, in first-seen order."""
    parts: dict[str, list[float]] = {}
    for g, v in zip(groups, totals, strict=True):
        parts.setdefault(g, []).append(v)
    return {g: math.fsum(v) for g, v in parts.items()}



def optional_call(model: nn.Module, name: str) -> Any:
    """``model.name()``, or None where the model lacks it or does not implement it."""
    fn = getattr(model, name, None)
    try:
        return fn() if callable(fn) else None
    except NotImplementedError:
        return None
