"""SVE against LoRA-Ensemble and deep ensembles on one harness (make ensembles).

Per cell (model x task): multiple-choice classification, each option scored as the response by
its mean token log-probability (guarduq's own multiple-choice scoring); train on
the task's train split, choose every setting on its dev split, report on its test split. Every
method trains the same last N blocks with the same steps, batch, data orders and prompt, from
cached frozen-block states (``_ensemble_methods``). Per cell, in order (each stage is saved under
``--work`` and skipped when rerun, so an interrupted run resumes):

1. encode: one full forward per item, keeping the states entering block L-N and the base answer;
2. select: the learning rate of every family alike (``_ensemble_select``): one member per rate,
   dev NLL; a best at the grid's edge grows the grid one step past it (``--max-extensions``),
   and a rate still at the edge is marked on the page. ``--sve-transfer-from CELL`` trains SVE at
   the rate chosen on CELL's dev instead, unchanged, while this cell's own SVE grid still runs
   (the page shows both rates' dev NLL). Then SVE's σ_init from a grid (M = 4 at its rate);
3. final: every family trains its M members once (``--sve-members``, ``--members``); its first m
   members are the M=m rows for each m of ``--report-m`` (4 and 8), paired on the same test
   items (``_ensemble_report``). Deep-ensemble members start apart by a seeded NoisyTune
   perturbation (``--deep-perturb``, ``_ensemble_methods.DeepMethod``). Every method also with a
   temperature fitted on dev;
4. report: accuracy, ECE (+ noise floor), NLL, Brier, misclassification AUROC of predictive
   entropy and mutual information, OOD AUROC, parameters, time, peak memory; 95% bootstrap
   intervals; each method minus the best baseline, paired; reliability diagrams, the accuracy /
   ECE / parameters chart, the dev curves (``_ensemble_page``, ``_ensemble_plots``).

Every fit records each member's own loss per step; the page shows each member's first and last
training loss and names any member whose loss did not fall (it has not been tuned).
``--sve-parametrisation relative`` trains SVE scale-free (Σ ⊙ exp(δ), biases b₀ + s·β;
``guarduq.sve.SVELinear``); the default stays raw, the parametrisation of the first page's
results. The Qwen cells run only where ``make model-qwen-0.5b`` / ``-1.5b`` provisioned the model
(otherwise they are skipped with that message).

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
    DeepMethod,
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
from _ensemble_metrics import loss_ends  # noqa: E402
from _ensemble_page import render  # noqa: E402
from _ensemble_report import first_member, report_cell  # noqa: E402
from _ensemble_select import MAX_EXTENSIONS, search_rate, transferred_rate  # noqa: E402

from guarduq._storage import write_atomic  # noqa: E402
from guarduq.calibration.datasets import default_data_dir  # noqa: E402
from guarduq.cli.sve import SST2_LABEL_WORDS, read_sst2  # noqa: E402
from guarduq.errors import ModelNotFoundError  # noqa: E402
from guarduq.models import cache_root, fingerprint, load_model, resolve_alias  # noqa: E402
from guarduq.sve import LLAMA_TARGETS  # noqa: E402

CELLS = ("smollm2:arc", "gemma:arc", "smollm2:sst2", "smollm2:csqa", "qwen05:arc", "qwen15:arc")
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m",
          "qwen05": "qwen2.5-coder-0.5b-instruct", "qwen15": "qwen2.5-coder-1.5b-instruct"}
PROVISIONED_ELSEWHERE = ("qwen05", "qwen15")  # chunked aliases: provisioned by make model-qwen-*, often absent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, from {', '.join(CELLS)}")
    p.add_argument("--data", type=Path, default=default_data_dir())
    p.add_argument("--last-n-blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per member, every method")
    p.add_argument("--batch", type=int, default=8, help="items per member per step")
    p.add_argument("--sve-members", type=int, default=16)
    p.add_argument("--members", type=int, default=8,
                   help="LoRA-Ensemble and deep ensemble size (their first --report-m members are reported too)")
    p.add_argument("--report-m", default="4,8",
                   help="ensemble sizes reported for every family: each family's first m members, for each m "
                        "below its own size (paired rows at equal M)")
    p.add_argument("--deep-perturb", type=float, default=0.15,
                   help="NoisyTune λ of each deep-ensemble member's own seeded start (W + U(-λ/2, λ/2)·std(W)); "
                        "0: members differ by data order only, as on the first page")
    p.add_argument("--max-extensions", type=int, default=MAX_EXTENSIONS,
                   help="times a rate grid grows by one step past the edge its best dev NLL sits at")
    p.add_argument("--sve-transfer-from", default=None, metavar="CELL",
                   help="train SVE's ensembles at the rate chosen on CELL's dev (read from <out>/results.json, "
                        "same SVE parametrisation); this cell's own SVE grid still runs at one member, shown beside. "
                        "CELL itself, run first in the same --cells, chooses its own")
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
    p.add_argument("--print-sve-choice", metavar="CELL",
                   help="print the SVE rate and initial spread chosen on CELL's dev in <out>/results.json, with "
                        "this run's SVE parametrisation and bias (refused if CELL ran another), and exit: what "
                        "`make sve-scale` trains the 1.5B's SVE with")
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
        write_atomic(meta, json.dumps(info).encode())  # last: a stage counts as done with both files
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
    sve_kind, sve_tag = sve_options(args)
    tags = {"sve": sve_tag, "lora": "", "deep": f"-np{args.deep_perturb:g}" if args.deep_perturb else ""}

    def make(family: str, members: int, lr: float, sigma: float = 0.0) -> Method:
        if family == "sve":
            return SVEMethod(members, lr, sigma_init=sigma, **sve_kind)
        if family == "deep":
            return DeepMethod(members, lr, perturb=args.deep_perturb)
        return FAMILIES[family](members, lr)

    # ---- selection on dev: each family's learning rate (one member), then SVE's sigma_init
    grids = {"sve": floats(args.lr_sve), "lora": floats(args.lr_lora), "deep": floats(args.lr_deep)}
    transfer = None  # the source cell itself (first in a run of several) chooses its own
    if args.sve_transfer_from and args.sve_transfer_from != cell:
        transfer = transferred_rate(args.out / "results.json", args.sve_transfer_from, sve_kind)
    chosen: dict[str, float] = {}
    selection: list[dict[str, Any]] = []
    searches: dict[str, dict[str, Any]] = {}
    singles: dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
    labels = {s: e.labels for s, e in enc.items()}
    trained: dict[tuple[str, float], Method] = {}

    def score(family: str, lr: float) -> float:
        """One member at ``lr``, scored by its dev NLL (dev predictions only: test and OOD for the
        chosen rate alone)."""
        method = trained[family, lr] = make(family, 1, lr)
        arrays, info = stages.run(f"{settings_key}-select-{family}-m1-lr{lr:g}{tags[family]}",
                                  lambda: train_and_predict(method, top, enc, args, ("dev",)))
        dev_nll = float(-arrays["dev"][0][np.arange(len(labels["dev"])), labels["dev"]].mean())
        dev_acc = float((arrays["dev"][0].argmax(1) == labels["dev"]).mean())
        selection.append({"family": family + tags[family], "lr": lr, "dev_nll": dev_nll, "dev_accuracy": dev_acc,
                          "train_loss": loss_ends(info.get("fit", {}))})
        return dev_nll

    for family, grid in grids.items():
        if family != "sve" and len(grid) == 1:  # one rate: nothing to select; M=1 is the ensemble's member 0
            chosen[family] = grid[0]
            continue
        search = search_rate(family + tags[family], grid, lambda lr, f=family: score(f, lr),
                             max_extensions=args.max_extensions)
        if family == "sve" and transfer is not None:  # the transferred rate, and this cell's own best beside it
            searches["sve_transfer"] = {"from": args.sve_transfer_from,
                                        **search.transfer(transfer, lambda lr: score("sve", lr))}
        searches[family] = search.to_json()
        if args.select_only:
            continue
        chosen[family] = lr = search.chosen
        method = trained[family, lr]  # trained above, or (a resumed run) trained again: seeded, the same model
        singles[family] = stages.run(
            f"{settings_key}-{family}-m1-lr{lr:g}{tags[family]}",
            lambda m=method: predict_only(m, top, enc, eval_splits, args.bf16) if m.fitted_ is not None
            else train_and_predict(m, top, enc, args, eval_splits))
    if args.select_only:
        return {"selection_only": selection, "rate_search_only": searches}
    sigma_nll: dict[float, float] = {}
    sigmas = floats(args.sigma_grid)
    for sigma in sigmas if len(sigmas) > 1 else ():  # one value: nothing to select, no M=4 fit
        method = make("sve", 4, chosen["sve"], sigma)
        arrays, info = stages.run(f"{settings_key}-select-sve-m4-lr{chosen['sve']:g}-s{sigma:g}{sve_tag}",
                                  lambda m=method: train_and_predict(m, top, enc, args, ("dev",)))
        probs = np.exp(arrays["dev"]).mean(0)
        sigma_nll[sigma] = float(-np.log(np.clip(probs[np.arange(len(labels["dev"])), labels["dev"]],
                                                 1e-12, 1)).mean())
        selection.append({"family": "sve-sigma", "sigma_init": sigma, "members": 4, "dev_nll": sigma_nll[sigma]})
    sigma = min(sigma_nll, key=sigma_nll.__getitem__) if sigma_nll else sigmas[0]

    # ---- final ensembles: every family's M members once (its first m are the M=m rows)
    sizes = {"sve": args.sve_members, "lora": args.members, "deep": args.members}
    finals = {family: stages.run(
        f"{settings_key}-{family}-m{m}-lr{chosen[family]:g}" + (f"-s{sigma:g}" if family == "sve" else "") + tags[family],
        lambda f=family, m=m: train_and_predict(make(f, m, chosen[f], sigma), top, enc, args, eval_splits))
        for family, m in sizes.items()}
    also = args.sve_lr_also_members or args.sve_members
    for lr in floats(args.sve_lr_also):  # sensitivity: the final SVE at another rate, reported beside it
        if lr != chosen["sve"] or also != args.sve_members:
            finals[f"sve-lr{lr:g}"] = stages.run(
                f"{settings_key}-sve-m{also}-lr{lr:g}-s{sigma:g}{sve_tag}",
                lambda lr=lr: train_and_predict(make("sve", also, lr, sigma), top, enc, args, eval_splits))
    for family in ("lora", "deep"):
        singles.setdefault(family, first_member(*finals[family]))
    base_params = sum(p.numel() for p in model.parameters())
    return report_cell(cell, task, enc, labels, singles, finals, args, {
        "k": k, "blocks": n_blocks, "base_params": base_params, "chosen_lr": chosen, "sigma_init": sigma,
        "sve_parametrisation": sve_kind, "deep_perturb": args.deep_perturb,
        "rate_search": [searches[f] for f in grids if f in searches],
        **({"sve_transfer": searches["sve_transfer"]} if "sve_transfer" in searches else {}),
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


def unprovisioned(cell: str) -> str | None:
    """Why ``cell``'s model cannot load here (a Qwen model not provisioned), else None."""
    key = cell.split(":")[0]
    if key not in PROVISIONED_ELSEWHERE:
        return None
    try:
        resolve_alias(MODELS[key])
    except ModelNotFoundError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_sve_choice:  # rate, spread, parametrisation, bias: what sve train is given
        cell, kind = args.print_sve_choice, sve_options(args)[0]
        lr = transferred_rate(args.out / "results.json", cell, kind)
        sigma = json.loads((args.out / "results.json").read_text())[cell]["facts"]["sigma_init"]
        print(lr, sigma, kind["parametrisation"], kind["bias"])
        return 0
    if args.quick:  # seconds: three rates per family, few steps, small ensembles (M=2 rows: their first 2)
        args.steps, args.batch, args.sve_members, args.members = 6, 4, 4, 4
        defaults = parse_args([])
        for name, value in {"lr_sve": "3e-3,1e-2,3e-2", "lr_lora": "1e-3,3e-3,1e-2", "lr_deep": "3e-4,1e-3,3e-3",
                            "sigma_grid": "0.05", "report_m": "2"}.items():
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
            if (missing := unprovisioned(cell)) is not None:
                print(f"ensembles: skipping {cell}: {missing}", file=sys.stderr)
                continue
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
