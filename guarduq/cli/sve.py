"""``guarduq sve train``: fit a Singular Value Ensemble on labelled data and save its members.

Two kinds of data:

* ``--dataset sst2``: SST-2 TSV (``sentence``, ``label``), trained as classification over the
  label words' next-token probabilities (``negative`` / ``positive``);
* any loader of :mod:`guarduq.calibration.datasets` (``arc``, ``triviaqa``,
  ``truthfulqa-mc``, ...): trained with the language-model loss on the (prompt, correct answer)
  pairs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from guarduq._logging import get_logger
from guarduq._storage import check_writable
from guarduq.aliases import DEFAULT_MODEL
from guarduq.calibration.datasets import DATASETS, PROMPT_STYLES, Item, load_dataset
from guarduq.calibration.splits import limit_subset, outside_limits
from guarduq.cli._help import with_example
from guarduq.cli._run import dataset_limits, threads_arg
from guarduq.errors import DatasetError, InputError
from guarduq.layout import PromptLike, has_chat_template
from guarduq.sve import BIAS_MODES, KNOWN_TARGETS, PARAMETRISATIONS, SVEnsemble, validate_settings

log = get_logger("cli.sve")

SST2_LABEL_WORDS = ("negative", "positive")  # index = SST-2 label (0 negative, 1 positive)
SST2_SYSTEM = "Classify the sentiment of the movie review as positive or negative."


def sst2_prompt(sentence: str) -> PromptLike:
    """The SST-2 prompt: the instruction as a short system turn, the review as the user turn."""
    return [{"role": "system", "content": SST2_SYSTEM}, {"role": "user", "content": sentence.strip()}]


def read_sst2(path: str | os.PathLike[str], limit: int | None = None) -> list[tuple[PromptLike, int]]:
    """(prompt, label) pairs from a GLUE SST-2 TSV (header ``sentence<TAB>label``, no quoting)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"sst2: data file not found: {path}")
    out: list[tuple[PromptLike, int]] = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header != ["sentence", "label"]:
            raise DatasetError(f"{path}: expected the header 'sentence<TAB>label', got {header}")
        for lineno, row in enumerate(reader, start=2):
            if len(row) != 2 or row[1] not in ("0", "1") or not row[0].strip():
                raise DatasetError(f"{path}: line {lineno}: expected a sentence and a 0/1 label")
            out.append((sst2_prompt(row[0]), int(row[1])))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise DatasetError(f"{path}: no rows")
    return out


def answer_pairs(items: list[Item]) -> list[tuple[PromptLike, str]]:
    """(prompt, a correct answer) for each item that has one: the LM-loss training data."""
    pairs: list[tuple[PromptLike, str]] = []
    for it in items:
        if it.kind == "mc" and it.answer_index is not None:
            pairs.append((it.prompt, it.options[it.answer_index]))
        elif it.answers:
            pairs.append((it.prompt, it.answers[0]))
        elif it.correct_refs:
            pairs.append((it.prompt, it.correct_refs[0]))
        elif it.response is not None and it.label == 1:
            pairs.append((it.prompt, it.response))
    if not pairs:
        raise DatasetError("the dataset has no items with a correct answer to train on")
    return pairs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sve", help="Singular Value Ensemble: train members for a second opinion",
                       **with_example("guarduq sve train --dataset sst2 --data sst2.tsv --out sve.safetensors"))
    sve_sub = p.add_subparsers(dest="sve_command", required=True)
    t = sve_sub.add_parser(
        "train",
        help="train SVE members on labelled data and save them (safetensors)",
        description="Build an M-member Singular Value Ensemble over MODEL, train the members' "
        "singular values and biases (AdamW, per-member shuffles), and save them bound to the "
        "model's fingerprint. Re-running with the same --checkpoint resumes.",
        **with_example("guarduq sve train --dataset sst2 --data sst2.tsv --members 4 --steps 200 "
                       "--checkpoint sve.ckpt --out sve.safetensors"),
    )
    t.add_argument("--model", default=DEFAULT_MODEL, help="alias, folder, hub id or .gguf")
    threads_arg(t)
    t.add_argument("--dataset", action="append", required=True, choices=["sst2", *sorted(DATASETS)],
                   help="sst2 = classification by label words (stands alone); others = LM loss on correct "
                   "answers, repeatable (pairs with --data, in order)")
    t.add_argument("--data", action="append", type=Path, required=True, help="the dataset file")
    t.add_argument("--limit", type=int, help="use at most this many items of each dataset (hash order)")
    t.add_argument("--exclude-limit", action="append", metavar="N|DATASET=N",
                   help="leave out what `guarduq calibrate --limit N` scores of each file (and every item "
                   "asking one of those questions), so the second opinion never trains on what its "
                   "calibrator is fitted, certified or tested on (repeatable: 1000 truthfulqa-mc=817)")
    t.add_argument("--prompt-style", choices=("auto", *PROMPT_STYLES), default="auto",
                   help="auto: instruct with a chat template, few-shot without (as calibrate)")
    t.add_argument("--members", type=int, default=4)
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--batch-size", type=int, default=4, help="items per member per step")
    t.add_argument("--lr", type=float,
                   help="AdamW learning rate (default: relative 5e-3, raw 3e-2). Relative: a step of about lr of each "
                   "singular value, the same on any model; raw: in the singular values' units (3e-2 for SmolLM2, "
                   "1e-3 for Gemma-3-270m on ARC-Easy dev: docs/ensembles)")
    t.add_argument("--sigma-init", type=float, default=0.05, help="relative spread of the members' initial spectra")
    t.add_argument("--parametrisation", choices=PARAMETRISATIONS, default="relative",
                   help="relative: Σ ⊙ exp(δ), scale-free (default); raw: Σ trained in its own units (the first SVE)")
    t.add_argument("--bias", choices=BIAS_MODES, default="scaled",
                   help="scaled: b₀ + s·β with s the layer's output RMS (default); none: no trained bias "
                   "(ablation); raw: the bias in absolute units (the first SVE)")
    t.add_argument("--targets", help=f"comma-separated layer names (default all of: {', '.join(KNOWN_TARGETS)})")
    t.add_argument("--last-n-blocks", type=int, help="only target the last N transformer blocks")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint", type=Path, help="resumable training state (safetensors)")
    t.add_argument("--checkpoint-every", type=int, default=50)
    t.add_argument("--out", type=Path, required=True, help="where to save the members (.safetensors)")
    t.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    validate_settings(args.members, args.targets, args.sigma_init, args.parametrisation, args.bias)  # fail before loading anything
    check_writable(args.out, "SVE output")  # a folder or read-only path fails now, not after training
    if args.checkpoint is not None:
        check_writable(args.checkpoint, "checkpoint")
    if len(args.dataset) != len(args.data):
        raise InputError(f"--dataset and --data come in pairs: got {len(args.dataset)} --dataset and "
                         f"{len(args.data)} --data")
    label_words: tuple[str, ...] | None = None
    if "sst2" in args.dataset:
        if len(args.dataset) > 1 or args.exclude_limit:
            raise InputError("--dataset sst2 stands alone (a classifier over label words), without --exclude-limit")
        data: list[Any] = read_sst2(args.data[0], args.limit)
        label_words = SST2_LABEL_WORDS
    else:
        _qa_items(args, "instruct")  # bad files and limits fail before the model loads
    from guarduq.models import load_model  # torch: only when a model is needed

    loaded = load_model(args.model)
    if label_words is None:
        style = args.prompt_style if args.prompt_style != "auto" else (
            "instruct" if has_chat_template(loaded.tokenizer) else "fewshot")
        items = _qa_items(args, style)
        data = answer_pairs(items)
        log.info("sve_training_items", n=len(data), per_dataset=dict(Counter(it.dataset for it in items)))
    ens = SVEnsemble.from_model(
        loaded,
        members=args.members,
        targets=args.targets,
        sigma_init=args.sigma_init,
        parametrisation=args.parametrisation,
        bias=args.bias,
        last_n_blocks=args.last_n_blocks,
        seed=args.seed,
    )
    ens.fit(
        data,
        label_words=label_words,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
    )
    path = ens.save(args.out)
    tail = ens.history_[-10:]
    summary = {
        "out": str(path),
        "model": loaded.info.name,
        "fingerprint": loaded.info.fingerprint,
        "items": len(data),
        "datasets": sorted(set(args.dataset)),
        "steps": ens.steps_done_,
        "parametrisation": ens.parametrisation,
        "bias": ens.bias_mode,
        "first_loss": ens.history_[0] if ens.history_ else None,
        "final_loss_mean10": sum(tail) / len(tail) if tail else None,
        "overhead": ens.overhead().to_dict(),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _qa_items(args: argparse.Namespace, style: str) -> list[Item]:
    """The training items: each file whole, less what ``--exclude-limit`` says calibrate scores,
    then at most ``--limit`` per dataset (hash order)."""
    groups = {}
    for name, path in zip(args.dataset, args.data, strict=True):
        if name in groups:
            raise InputError(f"--dataset {name} given twice")
        groups[name] = load_dataset(name, path, prompt_style=style).items
    if args.exclude_limit:
        groups = outside_limits(groups, dataset_limits(args.exclude_limit, args.dataset, "--exclude-limit"))
    items = [it for group in groups.values() for it in limit_subset(group, args.limit)]
    if not items:
        raise DatasetError("no training items are left once --exclude-limit leaves out what calibrate scores")
    return items
