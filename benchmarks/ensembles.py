"""SVE against LoRA-Ensemble and deep ensembles on one harness (make ensembles).

Per cell (model x task): multiple-choice classification, each option scored as the response by
its mean token log-probability (guarduq's own multiple-choice scoring); train on
the task's train split, choose every setting on its dev split, report on its test split. Every
method trains the same last N blocks with the same steps, batch, data orders and prompt, from
cached frozen-block states (``_ensemble_methods``). Per cell, in order (each stage is saved under
``--work`` and skipped when rerun, so an interrupted run resumes):

1. encode: one full forward per item, keeping the states entering block L-N and the base answer;
2. select: learning rate of each family from a grid (one member each, dev NLL), then SVE's
   σ_init from a grid (M = 4 at the chosen rate, dev NLL of the mean);
3. final: SVE with ``--sve-members`` members (M = 4 and 8 are its first members), LoRA-Ensemble
   and the deep ensemble with ``--members``; every method also with a temperature fitted on dev;
4. report: accuracy, ECE (+ noise floor), NLL, Brier, misclassification AUROC of predictive
   entropy and mutual information, OOD AUROC, parameters, time, peak memory; 95% bootstrap
   intervals; reliability diagrams and the accuracy / ECE / parameters chart.

Every fit records each member's own loss per step; the page shows each member's first and last
training loss (a baseline whose loss does not fall has not been tuned). ``--sve-parametrisation
relative`` trains SVE scale-free (Σ ⊙ exp(δ), biases b₀ + s·β; ``guarduq.sve.SVELinear``); the
default stays raw, the parametrisation of the results on the page and of the Makefile's rates.

    .venv/bin/python benchmarks/ensembles.py                       # every cell (hours)
    .venv/bin/python benchmarks/ensembles.py --cells smollm2:arc   # one cell
    .venv/bin/python benchmarks/ensembles.py --quick --out /tmp/q  # tiny random model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ensemble_methods import (  # noqa: E402
    FAMILIES,
    Encoded,
    Example,
    Method,
    SVEMethod,
    Task,
    Top,
    cache_key,
    encode_split,
    hash_split,
    read_items,
    sample,
)
from _ensemble_metrics import (  # noqa: E402
    apply_temperature,
    diversity,
    evaluate,
    fit_temperature,
    loss_cell,
    loss_ends,
    mutual_information,
    paired_diff,
    plot_reliability,
    plot_tradeoff,
)
from _ensemble_page import fmt, goals  # noqa: E402
from _pages import write_page  # noqa: E402

from guarduq.calibration import reliability_bins  # noqa: E402
from guarduq.calibration.datasets import default_data_dir  # noqa: E402
from guarduq.cli.sve import SST2_LABEL_WORDS, read_sst2  # noqa: E402
from guarduq.models import cache_root, fingerprint, load_model  # noqa: E402
from guarduq.sve import LLAMA_TARGETS  # noqa: E402

CELLS = ("smollm2:arc", "gemma:arc", "smollm2:sst2", "smollm2:csqa")
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, from {', '.join(CELLS)}")
    p.add_argument("--data", type=Path, default=default_data_dir())
    p.add_argument("--last-n-blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per member, every method")
    p.add_argument("--batch", type=int, default=8, help="items per member per step")
    p.add_argument("--sve-members", type=int, default=16)
    p.add_argument("--members", type=int, default=4, help="LoRA-Ensemble and deep ensemble size")
    p.add_argument("--lr-sve", default="1e-3,3e-3,1e-2,3e-2,1e-1")
    p.add_argument("--lr-lora", default="1e-4,3e-4,1e-3,3e-3")
    p.add_argument("--lr-deep", default="1e-5,3e-5,1e-4")
    p.add_argument("--sigma-grid", default="0.02,0.05,0.1")
    p.add_argument("--sve-parametrisation", choices=("raw", "relative"), default="raw",
                   help="raw: Σ trained in its own units (what docs/ensembles ran; the Makefile's rates are raw); "
                        "relative: Σ ⊙ exp(δ), a rate relative to each singular value")
    p.add_argument("--sve-bias", choices=("raw", "scaled", "none"), default=None,
                   help="SVE's biases: raw (absolute units), scaled (b₀ + s·β, s the layer's output RMS) or none "
                        "(default: raw with --sve-parametrisation raw, scaled with relative)")
    p.add_argument("--sve-lr-also", default="",
                   help="more SVE learning rates to fit and report beside the chosen one (sensitivity rows)")
    p.add_argument("--sve-lr-also-members", type=int, default=None,
                   help="members of the --sve-lr-also fits (default: --sve-members)")
    p.add_argument("--select-only", action="store_true",
                   help="only the one-member dev fits of each grid with more than one value, shown beside the "
                        "cell's results (a rate check; no final ensembles)")
    p.add_argument("--train-n", type=int, default=None, help="cap on train items (default: all)")
    p.add_argument("--test-n", type=int, default=None, help="cap on test items (default: all)")
    p.add_argument("--ood-n", type=int, default=600, help="out-of-distribution items (a seeded sample)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (fp32 weights) for training and predicting with the top blocks, "
                        "every method alike; the frozen-block states and the base scores stay fp32 "
                        "(default: only where the CPU has native bf16; emulated, it is many times slower)")
    p.add_argument("--quick", action="store_true", help="a tiny random model on a synthetic task (make test)")
    p.add_argument("--out", type=Path, default=Path("docs/ensembles"))
    p.add_argument("--work", type=Path, default=cache_root() / "bench-ensembles")
    p.add_argument("--render", action="store_true", help="only redraw the page from <out>/results.json")
    args = p.parse_args(argv)
    if args.bf16 is None:
        from guarduq.models import native_bf16

        args.bf16 = native_bf16()
    return args


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def sve_options(args: argparse.Namespace) -> tuple[dict[str, str], str]:
    """SVEMethod's parametrisation keywords, and the tag its stage keys carry (none for raw/raw,
    so the stages saved before the option existed are still found)."""
    bias = args.sve_bias or ("raw" if args.sve_parametrisation == "raw" else "scaled")
    kind = {"parametrisation": args.sve_parametrisation, "bias": bias}
    return kind, "" if (args.sve_parametrisation, bias) == ("raw", "raw") else f"-{args.sve_parametrisation}-{bias}"


# --------------------------------------------------------------------------- cells


def load(cell: str, args: argparse.Namespace) -> tuple[Any, Any, Task]:
    """The model, its tokenizer and the cell's task."""
    model_key, task_name = cell.split(":")
    if args.quick:
        from tests.conftest import make_tokenizer, tiny_llama

        return tiny_llama(seed=0, layers=4), make_tokenizer(), quick_task()
    base = model_key == "gemma"
    if base:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from qa import model_spec

        loaded = load_model(model_spec(MODELS[model_key]))
        loaded.tokenizer.chat_template = None  # a base model: the prompt is plain text
    else:
        loaded = load_model(MODELS[model_key])
    return loaded.model, loaded.tokenizer, make_task(task_name, args, base=base)


def make_task(name: str, args: argparse.Namespace, *, base: bool) -> Task:
    """The cell's splits, prompts and options exactly as guarduq's dataset loaders make them."""
    d = args.data
    if name == "arc":
        splits = {s: read_items("arc", d / f"arc_easy/ARC-Easy-{s.title()}.jsonl", base=base)
                  for s in ("train", "dev", "test")}
        # OOD: CommonsenseQA questions, cut to four options like ARC's usual four
        splits["ood"] = read_items("commonsenseqa", d / "commonsense_qa/dev_rand_split.jsonl", base=base,
                                   four_options=True)
        ood = "CommonsenseQA dev (4 of its 5 options kept: the answer and the first 3 others)"
        task = Task("arc", splits, ood_name=ood)
    elif name == "csqa":
        # CommonsenseQA ships its dev split only here: a fixed hash split of it
        rows = read_items("commonsenseqa", d / "commonsense_qa/dev_rand_split.jsonl", base=base)
        task = Task("csqa", hash_split(rows, {"train": 0.5, "dev": 0.15, "test": 0.35}))
    elif name == "sst2":
        words = SST2_LABEL_WORDS
        train = [Example(p, words, y) for p, y in read_sst2(d / "sst2/train.tsv")]
        train = sample(train, 2500, seed=0)
        test = [Example(p, words, y) for p, y in read_sst2(d / "sst2/dev.tsv")]
        task = Task("sst2", {"train": train[500:], "dev": train[:500], "test": test})
    else:
        raise SystemExit(f"unknown task {name!r}")
    task.splits["train"] = sample(task.splits["train"], args.train_n, seed=0)
    if "ood" in task.splits:
        task.splits["ood"] = sample(task.splits["ood"], args.ood_n, seed=0)
    return task


def quick_task() -> Task:
    """Synthetic: the prompt names the answer; a tiny model can learn to read it."""
    rng = np.random.default_rng(0)
    options = ("red", "green", "blue", "gold")

    def items(n: int) -> list[Example]:
        out = []
        for _ in range(n):
            y = int(rng.integers(0, 4))
            k = 3 if y < 3 and rng.random() < 0.3 else 4  # some items with fewer options
            out.append(Example(f"say {options[y]}", options[:k], y))
        return out

    splits = {"train": items(48), "dev": items(16), "test": items(32), "ood": items(16)}
    return Task("synthetic", splits, ood_name="synthetic")


# --------------------------------------------------------------------------- stages


class Stages:
    """Each stage's result saved under ``work`` (npz + json); a rerun reads it instead of training."""

    def __init__(self, work: Path) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)

    def run(self, key: str, fn: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        npz, meta = self.work / f"{key}.npz", self.work / f"{key}.json"
        if npz.is_file() and meta.is_file():
            with np.load(npz) as f:
                return dict(f), json.loads(meta.read_text())
        arrays, info = fn()
        tmp = self.work / f"{key}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, npz)
        meta.write_text(json.dumps(info))
        return arrays, info


def predict_only(method: Method, top: Top, enc: dict[str, Encoded], splits: tuple[str, ...],
                 bf16: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Predictions of an already trained method (its fit's record kept on it)."""
    arrays, seconds = {}, {}
    for split in splits:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            arrays[split] = method.predict(top, enc[split])
        seconds[split] = (time.perf_counter() - start) / len(enc[split])
    return arrays, {**(method.fitted_ or {}), "seconds_per_item": seconds}


def train_and_predict(method: Method, top: Top, enc: dict[str, Encoded], args: argparse.Namespace,
                      splits: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    method.build(top)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        fit = method.fit(top, enc["train"], steps=args.steps, batch=args.batch)
    method.fitted_ = {
        "name": method.name, "settings": method.settings(), "fit": asdict(fit),
        "trainable_per_member": method.trainable_per_member(), "stored": method.stored(),
    }
    return predict_only(method, top, enc, splits, args.bf16)


def run_cell(cell: str, args: argparse.Namespace) -> dict[str, Any]:
    model, tok, task = load(cell, args)
    model.eval().requires_grad_(False)
    n_blocks = len(list(model.base_model.layers))
    k = n_blocks - args.last_n_blocks
    top = Top(model, tok, k)
    fp = fingerprint(model)
    work = args.work / cell.replace(":", "-")
    stages = Stages(work)
    width = max(ex.n_options for examples in task.splits.values() for ex in examples)
    enc: dict[str, Encoded] = {}
    for split, examples in task.splits.items():
        if args.select_only and split not in ("train", "dev"):  # a rate check reads dev only
            continue
        cache = work / "states" / f"{split}-{cache_key(fp, k, width, examples)}.safetensors"
        enc[split] = encode_split(top, examples, width, cache=cache, desc=f"{cell} {split}")
    if "test" in enc and args.test_n is not None and args.test_n < len(enc["test"]):
        # sampled after encoding, so a smaller test set reuses the whole split's cached states
        enc["test"] = enc["test"].subset(sorted(random.Random(0).sample(range(len(enc["test"])), args.test_n)))
    eval_splits = ("dev", "test", "ood") if "ood" in enc else ("dev", "test")
    settings_key = f"n{args.last_n_blocks}-s{args.steps}-b{args.batch}{'-bf16' if args.bf16 else ''}"

    # ---- selection on dev: each family's learning rate (one member), then SVE's sigma_init
    grids = {"sve": floats(args.lr_sve), "lora": floats(args.lr_lora), "deep": floats(args.lr_deep)}
    sve_kind, tag = sve_options(args)

    def sve(members: int, lr: float, sigma: float) -> SVEMethod:
        return SVEMethod(members, lr, sigma_init=sigma, **sve_kind)

    chosen: dict[str, float] = {}
    selection: list[dict[str, Any]] = []
    singles: dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
    labels = {s: e.labels for s, e in enc.items()}
    for family, grid in grids.items():
        if family != "sve" and len(grid) == 1:  # one rate: nothing to select; M=1 is the ensemble's member 0
            chosen[family] = grid[0]
            continue
        best, trained = None, {}
        for lr in grid:  # dev predictions only: test and OOD for the chosen rate alone
            method = trained[lr] = sve(1, lr, 0.0) if family == "sve" else FAMILIES[family](1, lr)
            arrays, info = stages.run(f"{settings_key}-select-{family}-m1-lr{lr:g}{tag if family == 'sve' else ''}",
                                      lambda m=method: train_and_predict(m, top, enc, args, ("dev",)))
            dev_nll = float(-arrays["dev"][0][np.arange(len(labels["dev"])), labels["dev"]].mean())
            dev_acc = float((arrays["dev"][0].argmax(1) == labels["dev"]).mean())
            selection.append({"family": family + (tag if family == "sve" else ""), "lr": lr, "dev_nll": dev_nll, "dev_accuracy": dev_acc,
                              "train_loss": loss_ends(info.get("fit", {}))})
            if best is None or dev_nll < best[0]:
                best = (dev_nll, lr)
        if args.select_only:
            continue
        chosen[family] = lr = best[1]
        method = trained[lr]  # trained above, or (a resumed run) trained again: seeded, the same model
        singles[family] = stages.run(
            f"{settings_key}-{family}-m1-lr{lr:g}{tag if family == 'sve' else ''}",
            lambda m=method: predict_only(m, top, enc, eval_splits, args.bf16) if m.fitted_ is not None
            else train_and_predict(m, top, enc, args, eval_splits))
    if args.select_only:
        return {"selection_only": selection}
    sigma_nll: dict[float, float] = {}
    sigmas = floats(args.sigma_grid)
    for sigma in sigmas if len(sigmas) > 1 else ():  # one value: nothing to select, no M=4 fit
        method = sve(4, chosen["sve"], sigma)
        arrays, info = stages.run(f"{settings_key}-select-sve-m4-lr{chosen['sve']:g}-s{sigma:g}{tag}",
                                  lambda m=method: train_and_predict(m, top, enc, args, ("dev",)))
        probs = np.exp(arrays["dev"]).mean(0)
        sigma_nll[sigma] = float(-np.log(np.clip(probs[np.arange(len(labels["dev"])), labels["dev"]],
                                                 1e-12, 1)).mean())
        selection.append({"family": "sve-sigma", "sigma_init": sigma, "members": 4, "dev_nll": sigma_nll[sigma]})
    sigma = min(sigma_nll, key=sigma_nll.__getitem__) if sigma_nll else sigmas[0]

    # ---- final ensembles
    finals = {
        "sve": stages.run(f"{settings_key}-sve-m{args.sve_members}-lr{chosen['sve']:g}-s{sigma:g}{tag}",
                          lambda: train_and_predict(sve(args.sve_members, chosen["sve"], sigma),
                                                    top, enc, args, eval_splits)),
        "lora": stages.run(f"{settings_key}-lora-m{args.members}-lr{chosen['lora']:g}",
                           lambda: train_and_predict(FAMILIES["lora"](args.members, chosen["lora"]),
                                                     top, enc, args, eval_splits)),
        "deep": stages.run(f"{settings_key}-deep-m{args.members}-lr{chosen['deep']:g}",
                           lambda: train_and_predict(FAMILIES["deep"](args.members, chosen["deep"]),
                                                     top, enc, args, eval_splits)),
    }
    also = args.sve_lr_also_members or args.sve_members
    for lr in floats(args.sve_lr_also):  # sensitivity: the final SVE at another rate, reported beside it
        if lr != chosen["sve"] or also != args.sve_members:
            finals[f"sve-lr{lr:g}"] = stages.run(
                f"{settings_key}-sve-m{also}-lr{lr:g}-s{sigma:g}{tag}",
                lambda lr=lr: train_and_predict(sve(also, lr, sigma), top, enc, args, eval_splits))
    for family in ("lora", "deep"):
        singles.setdefault(family, first_member(*finals[family]))
    base_params = sum(p.numel() for p in model.parameters())
    return report_cell(cell, task, enc, labels, singles, finals, args, {
        "k": k, "blocks": n_blocks, "base_params": base_params, "chosen_lr": chosen, "sigma_init": sigma,
        "sve_parametrisation": sve_kind,
        "median_singular_value": median_singular_value(top),
        "selection": selection, "encode_seconds_per_item": {s: e.seconds / max(len(e), 1) for s, e in enc.items()},
        "sizes": {s: len(e) for s, e in enc.items()},
    })


def median_singular_value(top: Top) -> float:
    """The median singular value of the trained blocks' targeted matrices.

    SVE's parameters are the singular values themselves, so one AdamW learning rate moves them by
    about the same absolute amount in any model: relative to Σ, by lr / Σ. This is the scale that
    tells whether a rate chosen on one model transfers to another."""
    values = [torch.linalg.svdvals(m.weight.detach().float())
              for block in top.frozen_blocks() for name, m in block.named_modules()
              if name.rpartition(".")[2] in LLAMA_TARGETS and isinstance(m, torch.nn.Linear)]
    return float(np.median(torch.cat(values).numpy())) if values else float("nan")


def _subset(arrays: dict[str, np.ndarray], m: int) -> dict[str, np.ndarray]:
    return {s: a[:m] for s, a in arrays.items()}


def first_member(arrays: dict[str, np.ndarray], info: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Member 0 of a LoRA or deep ensemble as its one-member row.

    Members of those methods are separate copies, each with its own loss, clipping and data order
    (seeded by its index), so member 0 is the model an M=1 run trains (``test_ensembles_bench``
    checks it). Its costs are the ensemble's divided by M."""
    m = next(iter(arrays.values())).shape[0]
    fit = {**info.get("fit", {})}
    if fit.get("seconds") is not None:
        fit["seconds"] /= m
    return _subset(arrays, 1), {
        **info, "fit": fit, "stored": info["stored"] // m,
        "seconds_per_item": {s: v / m for s, v in info.get("seconds_per_item", {}).items()},
        "settings": {**info.get("settings", {}), "members": 1, "from": f"member 0 of the M={m} ensemble"}}


def report_cell(cell: str, task: Task, enc: dict[str, Encoded], labels: dict[str, np.ndarray],
                singles: dict[str, Any], finals: dict[str, Any], args: argparse.Namespace,
                facts: dict[str, Any]) -> dict[str, Any]:
    """Every method's metrics on test (and OOD), with and without a temperature fitted on dev."""
    has_ood = "ood" in enc
    base_logp = {s: torch.log_softmax(e.base_logits, -1).numpy()[None] for s, e in enc.items()}
    methods: list[tuple[str, dict[str, np.ndarray], dict[str, Any]]] = [
        ("base", base_logp, {"stored": 0, "trainable_per_member": 0}),
        ("fine-tuned (SVE M=1)", *singles["sve"]),
        ("LoRA (M=1)", *singles["lora"]),
        ("full fine-tune (M=1)", *singles["deep"]),
    ]
    sve_arrays, sve_info = finals["sve"]
    for m in sorted({4, 8, args.sve_members}):
        if m <= args.sve_members:
            info = {**sve_info, "stored": sve_info["stored"] * m // args.sve_members}
            methods.append((f"SVE M={m}", _subset(sve_arrays, m), info))
    methods.append((f"LoRA-Ensemble M={args.members}", *finals["lora"]))
    methods.append((f"deep ensemble M={args.members}", *finals["deep"]))
    for key, (arrays, info) in finals.items():
        if key.startswith("sve-lr"):
            methods.append((f"SVE M={arrays['test'].shape[0]}, lr {key.removeprefix('sve-lr')}", arrays, info))

    rows, probs_test = [], {}
    for name, arrays, info in methods:
        for ts in (False, True):
            dev = np.exp(arrays["dev"]).mean(0)
            t = fit_temperature(dev, labels["dev"]) if ts else 1.0
            test = apply_temperature(np.exp(arrays["test"]).mean(0), t)
            members = arrays["test"].shape[0]
            mi = mutual_information(arrays["test"]) if members > 1 else None
            ood = ood_mi = None
            if has_ood:
                ood = apply_temperature(np.exp(arrays["ood"]).mean(0), t)
                ood_mi = mutual_information(arrays["ood"]) if members > 1 else None
            label = f"{name} + TS" if ts else name
            metrics = evaluate(test, labels["test"], mi=mi, ood_probs=ood, ood_mi=ood_mi)
            probs_test[label] = test
            conf, correct = test.max(1), (test.argmax(1) == labels["test"]).astype(float)
            fit = info.get("fit", {})
            rows.append({
                "name": label, "members": members, "temperature": t, **metrics,
                "stored": info["stored"] + (1 if ts else 0),
                "trainable_per_member": info["trainable_per_member"],
                "train_seconds": fit.get("seconds"), "peak_rss_mb": fit.get("peak_rss_mb"),
                "seconds_per_item": info.get("seconds_per_item", {}).get("test"),
                "diversity": diversity(arrays["test"]), "settings": info.get("settings"),
                "reliability": reliability_bins(conf, correct),
                "history": fit.get("history"), "train_loss": loss_ends(fit, members),
            })
    # SVE diagnostics: averaging the members in log space instead of probability space
    logit_mean = np.exp(sve_arrays["test"].mean(0))
    logit_mean /= logit_mean.sum(1, keepdims=True)
    diag = {"logit_space_mean": evaluate(logit_mean, labels["test"])}
    sve_name, lora_name, deep_name = f"SVE M={args.sve_members}", f"LoRA-Ensemble M={args.members}", \
        f"deep ensemble M={args.members}"
    paired = {}
    for other in (lora_name, deep_name, "base"):
        for metric in ("ece", "accuracy", "nll"):
            paired[f"{sve_name} - {other}: {metric}"] = paired_diff(
                probs_test[sve_name], probs_test[other], labels["test"], metric)
    for other in (n for n, _, _ in methods if n.startswith("SVE M=") and ", lr " in n):  # sensitivity rows
        for ref in (sve_name, lora_name, deep_name):
            for metric in ("ece", "accuracy", "nll"):
                paired[f"{other} - {ref}: {metric}"] = paired_diff(
                    probs_test[other], probs_test[ref], labels["test"], metric)
    return {"cell": cell, "task": task.name, "ood": task.ood_name, "facts": facts, "methods": rows,
            "sve_diagnostics": diag, "paired": paired, "args": {k: str(v) for k, v in vars(args).items()}}


# --------------------------------------------------------------------------- page


def render(results: dict[str, Any], out: Path) -> None:
    parts = []
    for cell, res in results.items():
        if "facts" not in res:  # a rate check only, so far
            continue
        f = res["facts"]
        parts.append(f"## {cell}\n")
        parts.append("Goals of issue 24 on this cell:\n")
        parts += goals(res)
        parts.append("")
        parts.append(
            f"- n: {f['sizes']}; blocks trained: the last {f['blocks'] - f['k']} of {f['blocks']} (every method); "
            f"chosen learning rates {f['chosen_lr']}, SVE σ_init {f['sigma_init']}; SVE parametrisation "
            f"{'/'.join(f.get('sve_parametrisation', {'parametrisation': 'raw', 'bias': 'raw'}).values())} "
            "(Σ/bias: raw = in their own units; relative = Σ ⊙ exp(δ); scaled = b₀ + s·β)."
        )
        if f.get("median_singular_value") is not None:
            parts.append(f"- Median singular value of the trained blocks' targeted matrices: "
                         f"{f['median_singular_value']:.2f} (SVE's step relative to Σ is about lr / Σ).")
        if res.get("ood"):
            parts.append(f"- OOD items: {res['ood']}.")
        for r in res["methods"]:
            if (r.get("settings") or {}).get("from") and not r["name"].endswith("+ TS"):
                parts.append(f"- {r['name']}: {r['settings']['from']} (its one rate was not selected on dev; "
                             "train seconds and ms/item are the ensemble's divided by M).")
        enc = f["encode_seconds_per_item"]
        parts.append(f"- Frozen blocks, once per item: {max(enc.values()):.3f} s/item (cached states).\n")
        parts.append("| method | M | accuracy | ECE (floor) | NLL | Brier | AUROC entropy | AUROC MI | "
                     "OOD AUROC entropy | OOD AUROC MI | stored params | % of model | train s | "
                     "infer ms/item | peak RSS MB |")
        parts.append("|---|---:|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|")
        for r in res["methods"]:
            pct = 100 * r["stored"] / f["base_params"]
            parts.append(
                f"| {r['name']} | {r['members']} | {fmt(r['accuracy'])} | {fmt(r['ece'])} ({r['ece_floor'][0]:.3f}) "
                f"| {fmt(r['nll'])} | {fmt(r['brier'])} | {fmt(r.get('auroc_entropy'))} | {fmt(r.get('auroc_mi'))} "
                f"| {fmt(r.get('ood_auroc_entropy'))} | {fmt(r.get('ood_auroc_mi'))} | {r['stored']:,} | {pct:.3f} "
                f"| {r['train_seconds'] or 0:.0f} | {1000 * (r['seconds_per_item'] or 0):.1f} "
                f"| {r['peak_rss_mb'] or 0:.0f} |"
            )
        parts.append("\nPaired bootstrap differences on the same test items:\n")
        parts.append("| difference | value [95%] |\n|---|---|")
        parts += [f"| {k} | {fmt(v)} |" for k, v in res["paired"].items()]
        parts.append("\nMember diversity on test, and the temperature each ensemble's mean got on dev:\n")
        parts.append("| method | pairwise disagreement | mean MI (nats) | dev temperature |\n|---|---:|---:|---:|")
        ts = {r["name"].removesuffix(" + TS"): r["temperature"] for r in res["methods"] if r["name"].endswith("+ TS")}
        for r in res["methods"]:
            if r["members"] > 1 and not r["name"].endswith("+ TS"):
                d = r["diversity"]
                parts.append(f"| {r['name']} | {d['pairwise_disagreement']:.3f} | {d['mean_mi']:.4f} "
                             f"| {ts.get(r['name'], float('nan')):.2f} |")
        parts.append("\nTraining loss of each member, first → last (each the mean of w steps; a member whose loss "
                     "does not fall has not been tuned):\n")
        parts.append("| method | w | per member |\n|---|---:|---|")
        for r in res["methods"]:
            if not r["name"].endswith("+ TS") and r["name"] != "base":
                ends = r.get("train_loss") or loss_ends({"history": r.get("history")})  # older results: mean
                parts.append(f"| {r['name']} | {ends['window'] if ends else '–'} | {loss_cell(ends)} |")
        logit = res["sve_diagnostics"]["logit_space_mean"]
        sve_row = next(r for r in res["methods"] if r["name"] == f"SVE M={res['args'].get('sve_members', '16')}")
        parts.append(f"\nAveraging SVE's members in log space instead (renormalised geometric mean): "
                     f"ECE {fmt(logit['ece'])}, NLL {fmt(logit['nll'])}, accuracy {fmt(logit['accuracy'])} "
                     f"(probability space: ECE {fmt(sve_row['ece'])}, NLL {fmt(sve_row['nll'])}).")
        families = [s["family"] for s in f["selection"]]
        if len(families) == len(set(families)):  # grids of one value each: nothing was chosen here
            parts.append("\nNo selection on this cell: every grid held one value (dev NLL shown).")
        parts.append("\nSelection on dev (NLL):\n")
        parts.append("| family | setting | dev NLL | train loss first → last |\n|---|---|---:|---|")
        for s in f["selection"]:
            setting = f"lr {s['lr']:g}" if "lr" in s else f"σ_init {s['sigma_init']:g} (M=4)"
            parts.append(f"| {s['family']} | {setting} | {s['dev_nll']:.4f} | {loss_cell(s.get('train_loss'))} |")
        if res.get("selection_only"):
            parts.append("\nOne member at more rates (`--select-only`: dev fits only, no ensemble):\n")
            parts.append("| family | lr | dev NLL | dev accuracy | train loss first → last |\n|---|---|---:|---:|---|")
            for s in sorted(res["selection_only"], key=lambda s: (s["family"], s["lr"])):
                acc = f"{s['dev_accuracy']:.3f}" if "dev_accuracy" in s else "–"
                parts.append(f"| {s['family']} | {s['lr']:g} | {s['dev_nll']:.4f} | {acc} "
                             f"| {loss_cell(s.get('train_loss'))} |")
        slug = cell.replace(":", "-")
        parts.append(f"\n![reliability]({slug}-reliability.png)\n\n![tradeoff]({slug}-tradeoff.png)\n")
        shown = [r for r in res["methods"] if not r["name"].endswith("+ TS") or r["name"] == "base + TS"]
        plot_reliability([(r["name"], r["reliability"], r["ece"][0]) for r in shown],
                         out / f"{slug}-reliability.png", f"{cell}: test reliability")
        plot_tradeoff([{"name": r["name"], "stored": r["stored"], "accuracy": r["accuracy"], "ece": r["ece"]}
                       for r in res["methods"] if not r["name"].endswith("+ TS")],
                      out / f"{slug}-tradeoff.png", f"{cell}: accuracy and ECE against stored parameters")
    write_page(out / "README.md", "\n".join(parts), "SVE against LoRA-Ensemble and deep ensembles")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:  # seconds: one setting per grid, few steps, small ensembles
        args.steps, args.batch, args.sve_members, args.members = 6, 4, 4, 2
        defaults = parse_args([])
        for name, value in {"lr_sve": "1e-2", "lr_lora": "3e-3", "lr_deep": "1e-3", "sigma_grid": "0.05"}.items():
            if getattr(args, name) == getattr(defaults, name):  # a grid given on the command line stays
                setattr(args, name, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    if not args.render:
        cells = ["tiny:synthetic"] if args.quick else [c.strip() for c in args.cells.split(",") if c.strip()]
        torch.manual_seed(0)
        for cell in cells:
            res = run_cell(cell, args)
            # re-read: another run may have finished another cell meanwhile; replace this cell only
            results = json.loads(path.read_text()) if path.is_file() else {}
            prev = results.get(cell, {})
            keep = "selection_only"  # a rate check stays beside the cell's results, and the other way round
            results[cell] = {**prev, **res} if args.select_only else {**res, **({keep: prev[keep]} if keep in prev else {})}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(results))
            os.replace(tmp, path)
    render(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
