"""Flags and set-up shared by the commands that run a model: batch size, device, dtype, Ray, and
the SVE members that answer a policy's second_opinion rules."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from guarduq.errors import InputError


def run_args(p: argparse.ArgumentParser, *, ray: bool = True) -> None:
    """--batch-size, --device, --dtype (and --ray): how and where the model runs."""
    p.add_argument("--batch-size", type=int, default=8,
                   help="items per batched generate/forward/backward (default 8; 1 = one at a time)")
    p.add_argument("--device", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", help="model weights: float32 (default), bf16 or fp16; scores stay fp32/fp64")
    threads_arg(p)
    parameter_set_arg(p)
    if ray:
        p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                       help="score on Ray actors, one model each: a local Ray instance, or the cluster "
                            "at ADDRESS ('auto', 'ray://host:10001'); needs pip install 'guarduq[ray]'")
        p.add_argument("--ray-cpus-per-actor", type=int, default=4,
                       help="CPU cores per actor when the cluster has no GPU (default 4)")


def threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads torch may use (default: torch's own, one per core); 1 leaves "
                        "the other cores to other work, at the cost of speed")


def apply_threads(threads: int | None) -> None:
    """``torch.set_num_threads`` for ``--threads`` (torch imported only when it is given)."""
    if threads is None:
        return
    if threads < 1:
        raise InputError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def parameter_set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parameter-set", metavar="NAME",
                   help="parameters the epistemic gradient covers: 'all', 'last_n_blocks=N' or a "
                        "recorded set name (default: the calibrator's, else guarduq's default)")


def parameter_kwargs(name: str | None) -> dict[str, Any]:
    """Guard arguments for ``--parameter-set`` (nothing when it is not given)."""
    if name is None:
        return {}
    from guarduq.scoring.uncertainty import ALL_PARAMETERS, parse_parameter_set

    patterns, last_n = parse_parameter_set(name)
    if patterns is None and last_n is None:
        return {"parameters": ALL_PARAMETERS}
    return {"parameters": patterns, "last_n_blocks": last_n}


def sve_arg(p: argparse.ArgumentParser) -> None:
    """--sve FILE: the second-opinion provider of a command that builds a Guard with a policy."""
    p.add_argument("--sve", type=Path, metavar="FILE",
                   help="SVE members (.safetensors, `guarduq sve train`) that answer the policy's "
                        "second_opinion rules; bound to the model's fingerprint")


def check_sve_file(path: Path, flag: str = "--sve") -> None:
    """``InputError`` when ``path`` cannot be opened for reading (checked before the model loads)."""
    try:
        with open(path, "rb"):
            pass
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        reason = getattr(exc, "strerror", None) or exc
        raise InputError(f"{flag} {path}: cannot read it ({reason}); give the .safetensors file "
                         "`guarduq sve train` wrote for this model") from exc


def open_guard(model_spec: Any, *, sve: Path | None = None, device: str | None = None,
               dtype: str | None = None, **guard_kwargs: Any) -> Any:
    """A Guard on ``model_spec`` (``guard_kwargs``: policy, calibrator, ...); with ``sve``, the SVE
    members in that file over the same loaded model as its second-opinion provider.

    An unreadable ``sve`` raises ``InputError`` before the model loads; members trained on another
    model raise ``FingerprintMismatchError``. When no rule of the policy asks for a second opinion,
    one line on stderr says ``--sve`` is unused (the members stay bound, so a reloaded policy that
    has such a rule can use them).
    """
    from guarduq.guard import Guard  # heavy import (torch) only when needed

    if sve is None:
        return Guard(model_spec, device=device, dtype=dtype, **guard_kwargs)
    check_sve_file(sve)
    from guarduq.models import load_model
    from guarduq.sve import SVEnsemble

    loaded = load_model(model_spec, device=device, dtype=dtype)  # as Guard loads a spec
    guard = Guard(loaded, second_opinion=SVEnsemble.load(sve, loaded), **guard_kwargs)
    policy = guard.policy
    if policy is None or not policy.uses_second_opinion:
        why = "no --policy given" if policy is None else f"policy {policy.name!r} has no second_opinion rule"
        print(f"warning: --sve is unused: {why}", file=sys.stderr)
    return guard


def open_scorer(args: argparse.Namespace, model_spec: str) -> tuple[Any, bool]:
    """(a Guard, or a RayScorer with --ray; whether the model's tokenizer has a chat template)."""
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if getattr(args, "ray", None) is not None:
        from guarduq.distributed import RayScorer


        pool = RayScorer(model_spec, address=args.ray or None, cpus_per_actor=args.ray_cpus_per_actor,
                         device=args.device, dtype=args.dtype,
                         scoring=parameter_kwargs(getattr(args, "parameter_set", None)))
        return pool, pool.chat_template
    from guarduq.guard import Guard  # heavy import (torch) only when needed
    from guarduq.layout import has_chat_template

    guard = Guard(model_spec, device=args.device, dtype=args.dtype,
                  **parameter_kwargs(getattr(args, "parameter_set", None)))
    return guard, has_chat_template(guard.tokenizer)


def dataset_limits(specs: Sequence[str], names: Sequence[str], option: str = "--limit") -> dict[str, int]:
    """``--limit``-style values as {dataset: N}, with "" for the one that applies to every other dataset."""
    out: dict[str, int] = {}
    for spec in specs:
        name, _, value = spec.rpartition("=")
        if name and name not in names:
            raise InputError(f"{option} {spec}: no --dataset {name!r} (given: {', '.join(names)})")
        try:
            n = int(value)
        except ValueError:
            raise InputError(f"{option} takes N or DATASET=N, got {spec!r}") from None
        if n < 1:
            raise InputError(f"{option} must be >= 1, got {spec}")
        if name in out:
            raise InputError(f"{option} given twice for {name or 'every dataset'}")
        out[name] = n
    return out
