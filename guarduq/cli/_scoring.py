"""Steps that ``calibrate``, ``evaluate`` and ``calibrate --cascade-on`` share, kept apart so the
cascade command can use them without importing ``calibrate`` back: check the SVE flags, load the
data, score it with the model (cached), split the records by id hash, write numpy values as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guarduq._storage import private_file
from guarduq.calibration.datasets import Dataset, load_dataset
from guarduq.calibration.features import SVE, SVEShape
from guarduq.calibration.reviews import REVIEWS
from guarduq.cli._run import dataset_limits, open_scorer
from guarduq.cli.calibrate_reviews import review_data_file
from guarduq.errors import InputError


@dataclass(frozen=True)
class _SVEPlan:
    """The SVE opinion a feature set needs: which members, and the greedy answer's budget."""

    path: Path
    sha256: str
    answer_tokens: int  # 0 when no feature reads the greedy answer: it is not computed

    def describe(self) -> dict[str, Any]:
        return {"file": str(self.path), "sha256": self.sha256, "answer_tokens": self.answer_tokens}


def _sve_plan(args: argparse.Namespace, features: Sequence[str]) -> _SVEPlan | None:
    """Check the SVE flags against the features before anything slow; None when none is needed."""
    if args.sve_answer_tokens < 0:
        raise InputError(f"--sve-answer-tokens must be >= 0, got {args.sve_answer_tokens}")
    wanted = [f for f in features if f in SVE]
    if not wanted:
        if args.sve is not None:
            print("warning: --sve is unused: the features read no SVE opinion", file=sys.stderr)
        return None
    if args.sve is None:
        raise InputError(f"features {', '.join(wanted)} need an SVE second opinion: give --sve FILE "
                         "(members trained for this model by `guarduq sve train`)")
    if "sve_agree" in wanted and args.sve_answer_tokens == 0:
        raise InputError("feature sve_agree needs the SVE members' greedy answer: "
                         "--sve-answer-tokens must be > 0")
    if getattr(args, "ray", None) is not None:
        raise InputError("--sve runs the ensemble in this process, beside the model: not with --ray")
    try:
        digest = hashlib.sha256(args.sve.read_bytes()).hexdigest()
    except OSError as exc:
        raise InputError(f"--sve {args.sve}: cannot read it ({exc.strerror or exc})") from exc
    tokens = args.sve_answer_tokens if "sve_agree" in wanted else 0
    return _SVEPlan(args.sve, digest, tokens)


def _load_sve(plan: _SVEPlan, guard: Any) -> Any:
    """The ensemble over the guard's own model; another model's members raise
    ``FingerprintMismatchError``."""
    from guarduq.models import LoadedModel
    from guarduq.sve import SVEnsemble

    return SVEnsemble.load(plan.path, LoadedModel(guard.model, guard.tokenizer, guard.info))


def _sve_shape(records: Sequence[Any]) -> SVEShape | None:
    """The SVE shape the records' features were computed with (the first that says)."""
    for r in records:
        shape = SVEShape.of(r.scores or {})
        if shape is not None:
            return shape
    return None


def _load_datasets(args: argparse.Namespace, style: str) -> list[Dataset]:
    if REVIEWS in args.dataset:
        if len(args.dataset) > 1 or (args.data and args.store) or len(args.data) > 1:
            raise InputError("--dataset reviews stands alone (--store URL, or --data one exported file; no "
                             "other --dataset): its weights and certificate describe your traffic, not a mix")
        paths = args.data if args.data else [review_data_file(args.store, args.since, args.runs_dir)]
    else:
        if args.store or args.since:
            raise InputError("--store and --since go with --dataset reviews")
        paths = args.data
    if len(args.dataset) != len(paths):
        raise InputError(
            f"--dataset and --data come in pairs: got {len(args.dataset)} --dataset and "
            f"{len(paths)} --data"
        )
    limits = dataset_limits(args.limit or (), args.dataset)
    return [
        load_dataset(name, path, prompt_style=style, skip_malformed=args.skip_malformed,
                     limit=limits.get(name, limits.get("")))
        for name, path in zip(args.dataset, paths, strict=True)
    ]


def _score_all(
    args: argparse.Namespace,
    model_spec: str,
    check: Callable[[Any], None] | None = None,
    p_true: bool = False,
    sve: _SVEPlan | None = None,
) -> tuple[Any, list[Dataset], list[Any]]:
    """Load data (fails fast on bad files), then the model (``check`` it), then score (cached).

    ``p_true``: also compute the opt-in P(True) feature (one extra forward per answer, cached).
    ``sve``: also compute the opt-in SVE features (one folded forward of the members per answer,
    plus their greedy answer when asked; cached); the members are loaded before any scoring.
    """
    from guarduq.calibration.evaluation import (
        add_p_true,
        add_sve_opinion,
        check_guard_errors,
        score_dataset,
    )

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    style = "instruct" if args.prompt_style == "auto" else args.prompt_style
    datasets = _load_datasets(args, style)
    guard, chat_template = open_scorer(args, model_spec)
    try:
        if check is not None:
            check(guard)
        ensemble = _load_sve(sve, guard) if sve is not None else None
        if args.prompt_style == "auto" and not chat_template:
            datasets = _load_datasets(args, "fewshot")
        records = []
        for ds in datasets:
            cache = args.cache or _default_cache(args.runs_dir, guard.info.name, ds)
            if ds.name == REVIEWS:  # the cache holds the replies' text too
                private_file(Path(cache))
            recs = score_dataset(
                guard,
                ds.items,
                cache,
                batch_size=args.batch_size,
                progress=not args.no_progress,
                max_new_tokens=args.max_new_tokens,
                desc=ds.name,
            )
            check_guard_errors(recs)
            if p_true:
                recs = add_p_true(guard, ds.items, recs, cache, progress=not args.no_progress,
                                  desc=f"{ds.name} P(True)")
            if ensemble is not None and sve is not None:
                recs = add_sve_opinion(ensemble, ds.items, recs, cache, max_new_tokens=sve.answer_tokens,
                                       ensemble_id=sve.sha256[:16], progress=not args.no_progress,
                                       desc=f"{ds.name} SVE")
            records.extend(recs)
    finally:
        if hasattr(guard, "close"):  # Ray actors
            guard.close()
    return guard, datasets, records


def _check_outputs(args: argparse.Namespace, *outputs: Path | None) -> None:
    """Unwritable outputs or cache (read-only folder, full disk) fail before the model loads."""
    from guarduq._storage import check_writable

    for out in outputs:
        if out is not None:
            check_writable(out, "output file")
    check_writable(args.cache or args.runs_dir / "cache" / ".write-check", "scoring cache")


def _default_cache(runs_dir: Path, model_name: str, ds: Dataset) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name).strip("_") or "model"
    base = runs_dir / REVIEWS if ds.name == REVIEWS else runs_dir  # text stays in the private folder
    return base / "cache" / safe / f"{ds.name}-{ds.sha256[:12]}-{ds.prompt_style}.jsonl"


def _splitter(datasets: Sequence[Dataset], fractions: dict[str, float]) -> Callable[[Any], str]:
    """record -> its split, keyed by the item's group (TruthfulQA gen/mc share a question)."""
    from guarduq.calibration.splits import split_of

    groups = {it.id: (it.group or it.id) for d in datasets for it in d.items}
    return lambda record: split_of(groups.get(record.id, record.id), **fractions)


def _xy(records: Sequence[Any]) -> tuple[list[dict[str, Any]], list[int], list[str]]:
    return [r.scores for r in records], [int(r.label) for r in records], [r.dataset for r in records]


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
