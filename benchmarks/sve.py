"""SVE on real data: SmolLM2-135M-Instruct, M members trained on SST-2, CPU only, minutes.

Classification by the LM's label-word probabilities: after the chat-templated prompt, the
next-token logits of "negative" / "positive" are softmaxed over those two words. The base model
is used zero-shot; the ensemble's members are trained on a small seeded sample of SST-2 train and
everything is evaluated on a seeded sample of SST-2 dev (held out: GLUE dev is not in train).

Reported, all measured in this one run:
* accuracy, ECE (15 equal-width bins, top-label confidence), NLL, Brier of the base model, of
  the SVE ensemble (mean of member probabilities) and of the average single member;
* member diversity: pairwise disagreement of member predictions, mean variance of the members'
  P(positive), mean mutual information (entropy of the mean - mean entropy), collapse check;
* the parameter overhead (counted vs the paper's 5(M-1)/(4d));
* forward cost: ensemble / single base forward on the same batch, with the shared prefix and
  with plain folding (M copies through every block).

Writes ``<out>/README.md``, ``<out>/reliability.png`` and ``<out>/results.json``.
Training state is checkpointed under ``--work``: an interrupted run resumes.

    .venv/bin/python benchmarks/sve.py            # defaults: M=4, last 4 blocks, 120 steps
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from guarduq import layout
from guarduq.calibration import brier, ece, reliability_bins
from guarduq.calibration.datasets import default_data_dir
from guarduq.cli.sve import SST2_LABEL_WORDS, read_sst2
from guarduq.models import cache_root, load_model
from guarduq.sve import KNOWN_TARGETS, SVEnsemble


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", type=Path, default=default_data_dir(), help="shared data folder")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--last-n-blocks", type=int, default=4)
    p.add_argument("--sigma-init", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=2, help="items per member per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--train-n", type=int, default=1000, help="SST-2 train sample size")
    p.add_argument("--eval-n", type=int, default=250, help="SST-2 dev sample size")
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is fastest on a CPU shared with other jobs")
    p.add_argument("--out", type=Path, default=Path("docs/sve"))
    p.add_argument("--work", type=Path, default=cache_root() / "bench-sve")
    p.add_argument("--render", action="store_true",
                   help="only redraw README.md and reliability.png from <out>/results.json")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- metrics


def metrics(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy, ECE, NLL and Brier of [N, C] class probabilities."""
    pred = probs.argmax(1)
    conf = probs.max(1)
    correct = (pred == labels).astype(float)
    p_true = np.clip(probs[np.arange(len(labels)), labels], 1e-12, 1.0)
    return {
        "accuracy": float(correct.mean()),
        "mean_confidence": float(conf.mean()),
        "ece": ece(conf, correct),
        "nll": float(-np.log(p_true).mean()),
        "brier": brier(conf, correct),
    }


def entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(-1)


def diversity(member_probs: np.ndarray) -> dict[str, float]:
    """How different the members are; near-zero everywhere would mean a collapsed ensemble."""
    m = member_probs.shape[0]
    preds = member_probs.argmax(-1)
    pairs = [(a, b) for a in range(m) for b in range(a + 1, m)]
    mean = member_probs.mean(0)
    return {
        "pairwise_disagreement": float(np.mean([(preds[a] != preds[b]).mean() for a, b in pairs])),
        "mean_var_p_positive": float(member_probs[..., 1].var(0).mean()),
        "max_var_p_positive": float(member_probs[..., 1].var(0).max()),
        "mean_mutual_information": float((entropy(mean) - entropy(member_probs).mean(0)).mean()),
        "mean_abs_p_diff_to_base_member0": float(np.abs(member_probs[0, :, 1] - mean[:, 1]).mean()),
    }


# --------------------------------------------------------------------------- base model


def base_label_logits(model: Any, batch_ids: list[list[int]], label_ids: list[int], pad: int) -> torch.Tensor:
    """The base model's label-word logits at each prompt's last token (right padding)."""
    width = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(batch_ids):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    last = hidden[torch.arange(len(batch_ids)), mask.sum(1) - 1]
    return model.get_output_embeddings()(last)[:, label_ids].float()


def base_proba(model: Any, tok: Any, prompts: list[Any], label_ids: list[int], batch: int) -> np.ndarray:
    encoded = [layout.prompt_ids(tok, p) for p in prompts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = []
    with torch.no_grad():
        for i in range(0, len(encoded), batch):
            out.append(torch.softmax(base_label_logits(model, encoded[i : i + batch], label_ids, pad), -1))
    return torch.cat(out).numpy()


# --------------------------------------------------------------------------- cost


def timed(fn: Any, reps: int = 2) -> float:
    """Median seconds of ``reps`` calls after one warm-up (the CPU is shared: medians, not means)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_costs(ens: SVEnsemble, model: Any, tok: Any, prompts: list[Any], label_ids: list[int]) -> dict[str, float]:
    encoded = [layout.prompt_ids(tok, p) for p in prompts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = ens._collate([(x, len(x), 0) for x in encoded])
    m = ens.members

    def base() -> None:
        with torch.no_grad():
            base_label_logits(model, encoded, label_ids, pad)

    def shared() -> None:
        with torch.no_grad(), ens._fan_out(len(encoded)) as fold:
            ens.label_logits(fold(batch.input_ids), fold(batch.attention_mask), batch.lengths.repeat(m), label_ids)

    def folded() -> None:  # no prefix sharing: all M·B rows through every block
        with torch.no_grad():
            ens.label_logits(batch.input_ids.repeat(m, 1), batch.attention_mask.repeat(m, 1),
                              batch.lengths.repeat(m), label_ids)

    t_base, t_shared, t_folded = timed(base), timed(shared), timed(folded)
    return {
        "batch": len(encoded),
        "mean_prompt_tokens": float(np.mean([len(x) for x in encoded])),
        "base_s": t_base,
        "ensemble_shared_prefix_s": t_shared,
        "ensemble_folded_s": t_folded,
        "ratio_shared_prefix": t_shared / t_base,
        "ratio_folded": t_folded / t_base,
    }


def full_model_member_params(model: Any) -> int:
    """Per-member parameters if every known target layer of every block were an SVE layer."""
    total = 0
    for name, mod in model.named_modules():
        if name.rpartition(".")[2] in KNOWN_TARGETS and hasattr(mod, "weight") and mod.weight.dim() == 2:
            rows, cols = mod.weight.shape
            out = cols if type(mod).__name__ == "Conv1D" else rows
            total += min(rows, cols) + out
    return total


# --------------------------------------------------------------------------- report


def reliability_png(res: dict[str, Any], path: Path) -> None:
    """Reliability diagrams of base and SVE, and the members' training loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = np.array(res["items"]["labels"])
    m = res["settings"]["members"]
    curves = {
        "base (zero-shot)": np.array(res["items"]["p_base"]),
        f"SVE ensemble (M={m})": np.array(res["items"]["p_members"]).mean(0),
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    width = 1 / 15
    for ax, (name, probs) in zip(axes, curves.items(), strict=False):
        conf = probs.max(1)
        correct = (probs.argmax(1) == labels).astype(float)
        bins = reliability_bins(conf, correct)
        ax.bar([b["lo"] for b in bins], [b["accuracy"] for b in bins], width=width, align="edge",
               edgecolor="black", alpha=0.7, label="accuracy in bin")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        for b in bins:
            ax.annotate(str(b["count"]), (b["lo"] + width / 2, b["accuracy"]), ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{name}\nECE {ece(conf, correct):.3f}, acc {correct.mean():.3f}, n {len(labels)}")
        ax.set_xlabel("confidence (top-label probability)")
        ax.set_xlim(0.45, 1.0)
        ax.set_ylim(0, 1.08)
        ax.set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    loss = np.array(res["train_loss"])
    k = min(10, len(loss))
    axes[2].plot(np.arange(1, len(loss) + 1), loss, color="0.7", lw=0.8, label="per step")
    axes[2].plot(np.arange(k, len(loss) + 1), np.convolve(loss, np.ones(k) / k, "valid"), color="C0",
                 label=f"mean of {k} steps")
    axes[2].set_title(f"training loss (cross-entropy, all {m} members)")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: dict[str, dict[str, float]]) -> str:
    head = "| model | accuracy | mean confidence | ECE | NLL | Brier |\n|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {name} | {r['accuracy']:.3f} | {r['mean_confidence']:.3f} | {r['ece']:.3f} | "
        f"{r['nll']:.3f} | {r['brier']:.3f} |\n"
        for name, r in rows.items()
    )


def reading(res: dict[str, Any]) -> str:
    """Plain-language statements computed from the numbers (so they cannot drift from them)."""
    base, sve, single = res["metrics"].values()
    d = res["diversity"]
    lines = [
        f"- Accuracy {base['accuracy']:.3f} → {sve['accuracy']:.3f} "
        f"({sve['accuracy'] - base['accuracy']:+.3f}); NLL {base['nll']:.3f} → {sve['nll']:.3f}; "
        f"Brier {base['brier']:.3f} → {sve['brier']:.3f}.",
        f"- ECE {base['ece']:.3f} (base) vs {sve['ece']:.3f} (SVE) vs {single['ece']:.3f} (single member).",
    ]
    gap = sve["accuracy"] - sve["mean_confidence"]
    if abs(gap) > 0.02:
        kind = "under" if gap > 0 else "over"
        lines.append(
            f"- The ensemble is {kind}-confident on average: mean confidence "
            f"{sve['mean_confidence']:.3f} vs accuracy {sve['accuracy']:.3f}."
        )
    if sve["mean_confidence"] < single["mean_confidence"]:
        lines.append(
            f"- Averaging the members lowers confidence (single member {single['mean_confidence']:.3f}, "
            f"ensemble {sve['mean_confidence']:.3f}): where members disagree the mean moves towards 0.5."
        )
    collapsed = d["pairwise_disagreement"] < 0.01 and d["mean_var_p_positive"] < 1e-5
    lines.append(
        f"- Members {'have collapsed to one model' if collapsed else 'stay distinct'}: they disagree on "
        f"{d['pairwise_disagreement']:.1%} of items (pairs of members), mean variance of P(positive) "
        f"{d['mean_var_p_positive']:.1e}."
    )
    if res.get("resumed_from_step"):
        lines.append(f"- Training resumed from a checkpoint at step {res['resumed_from_step']}; "
                     "the fit time covers only the steps run in this invocation.")
    return "\n".join(lines)


def write_markdown(res: dict[str, Any], path: Path) -> None:
    s, o, c, d = res["settings"], res["overhead"], res["cost"], res["diversity"]
    text = f"""# Singular Value Ensemble on SST-2 (SmolLM2-135M-Instruct, CPU)

Produced by `benchmarks/sve.py` in one run: {res['wall_s'] / 60:.1f} min wall on a 2-core CPU shared
with other jobs (base eval {res['timings_s']['base_eval']:.0f} s, fit {res['timings_s']['fit']:.0f} s,
SVE eval {res['timings_s']['sve_eval']:.0f} s).
Classification by label-word probabilities ("negative" / "positive" as the first assistant token
after a chat-templated prompt). Base = the model zero-shot; SVE = mean of {s['members']} members
trained on {s['train_n']} SST-2 train sentences for {s['steps']} steps (batch {s['batch_size']} per
member, AdamW lr {s['lr']}, σ_init {s['sigma_init']}); "single member" = the average of the
members' own metrics. Evaluated on n = {s['eval_n']} sentences of SST-2 dev (held out).

To fit in minutes on a shared CPU, SVE targets only the **last {s['last_n_blocks']} of
{o['total_blocks']} blocks** (all seven projections in each: q, k, v, o, gate, up, down).

{table(res['metrics'])}
{reading(res)}

![reliability diagrams and training loss](reliability.png)

Bar labels are the number of items in each confidence bin.

## Member diversity (does the implicit ensemble collapse?)

| measure | value |
|---|---|
| pairwise disagreement of member predictions | {d['pairwise_disagreement']:.4f} |
| mean variance of member P(positive) | {d['mean_var_p_positive']:.2e} |
| max variance of member P(positive) | {d['max_var_p_positive']:.2e} |
| mean mutual information (nats) | {d['mean_mutual_information']:.2e} |

## Parameter overhead

| | value |
|---|---|
| trainable parameters per member | {o['per_member_params']:,} |
| all members (what `save` stores) | {o['member_params']:,} |
| extra over one model, (M−1) × per member | {o['extra_params']:,} |
| base model parameters | {o['base_params']:,} |
| measured extra / base ({o['targeted_blocks']} blocks targeted) | {o['ratio']:.4%} |
| measured extra / base if all {o['total_blocks']} blocks were targeted | {res['overhead_all_blocks_ratio']:.4%} |
| paper formula 5(M−1)/(4d), d = {o['hidden_size']} | {o['formula']:.4%} |

The formula assumes a GPT-style block (4d² attention, 4d MLP, biases everywhere) and ignores
embeddings; SmolLM2 has grouped-query attention (k/v are d/3 wide), a SwiGLU MLP with three
matrices of width {res['intermediate_size']}, and a 28M-parameter embedding, so the measured share
differs from the formula.

## Forward cost (batch of {c['batch']} prompts, {c['mean_prompt_tokens']:.0f} tokens on average; medians of 2 after a warm-up)

| forward | seconds | × single base forward |
|---|---|---|
| base model | {c['base_s']:.3f} | 1.00 |
| SVE, {s['members']} members, shared prefix (default) | {c['ensemble_shared_prefix_s']:.3f} | {c['ratio_shared_prefix']:.2f} |
| SVE, {s['members']} members, folded through every block | {c['ensemble_folded_s']:.3f} | {c['ratio_folded']:.2f} |

Blocks before the first SVE block are identical for all members, so the ensemble runs them once
per input and fans out to M members only from there. Timings come from a CPU shared with other
jobs, so ratios are indicative.
"""
    path.write_text(text)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        res = json.loads((args.out / "results.json").read_text())
        reliability_png(res, args.out / "reliability.png")
        write_markdown(res, args.out / "README.md")
        print(table(res["metrics"]))
        return 0
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    rng = random.Random(args.seed)
    train_all = read_sst2(args.data / "sst2" / "train.tsv")
    dev_all = read_sst2(args.data / "sst2" / "dev.tsv")
    train = rng.sample(train_all, min(args.train_n, len(train_all)))
    dev = rng.sample(dev_all, min(args.eval_n, len(dev_all)))
    prompts = [p for p, _ in dev]
    labels = np.array([y for _, y in dev])
    print(f"train {len(train)} / eval {len(dev)} items", file=sys.stderr)

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    ens = SVEnsemble.from_model(
        loaded, members=args.members, sigma_init=args.sigma_init,
        last_n_blocks=args.last_n_blocks, seed=args.seed,
    )
    label_ids = ens.label_token_ids(SST2_LABEL_WORDS)

    t0 = time.perf_counter()
    p_base = base_proba(model, tok, prompts, label_ids, args.eval_batch)
    t_base_eval = time.perf_counter() - t0
    print(f"base eval {t_base_eval:.0f}s: {metrics(p_base, labels)}", file=sys.stderr)

    ckpt = args.work / f"ckpt-{loaded.info.fingerprint}-m{args.members}-k{args.last_n_blocks}-s{args.seed}.safetensors"
    resumed = 0
    if ckpt.is_file():
        with safe_open(str(ckpt), framework="pt") as f:
            resumed = int((f.metadata() or {}).get("steps_done", 0))
    t0 = time.perf_counter()
    ens.fit(train, label_words=SST2_LABEL_WORDS, steps=args.steps, batch_size=args.batch_size,
            lr=args.lr, checkpoint=ckpt, checkpoint_every=25)
    t_fit = time.perf_counter() - t0

    t0 = time.perf_counter()
    member = ens.member_proba(prompts, SST2_LABEL_WORDS, batch_size=args.eval_batch)  # [M, N, 2]
    t_sve_eval = time.perf_counter() - t0
    p_sve = member.mean(0)
    per_member = [metrics(member[m], labels) for m in range(args.members)]
    single = {k: float(np.mean([r[k] for r in per_member])) for k in per_member[0]}

    cost = forward_costs(ens, model, tok, prompts[: args.eval_batch], label_ids)
    overhead = ens.overhead()
    all_blocks = full_model_member_params(model)
    res = {
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "eval_n": len(dev), "train_n": len(train)},
        "model": {"name": loaded.info.name, "fingerprint": loaded.info.fingerprint},
        "metrics": {"base (zero-shot)": metrics(p_base, labels),
                    f"SVE ensemble (M={args.members})": metrics(p_sve, labels),
                    "single SVE member (mean)": single},
        "per_member": per_member,
        "diversity": diversity(member),
        "overhead": overhead.to_dict(),
        "overhead_all_blocks_ratio": (args.members - 1) * all_blocks / overhead.base_params,
        "intermediate_size": int(getattr(model.config, "intermediate_size", 0)),
        "cost": cost,
        "timings_s": {"base_eval": t_base_eval, "fit": t_fit, "sve_eval": t_sve_eval},
        "resumed_from_step": resumed,
        "train_loss": ens.history_,
        "items": {"labels": labels.tolist(), "p_base": np.round(p_base, 6).tolist(),
                  "p_members": np.round(member, 6).tolist()},
        "wall_s": time.perf_counter() - t_start,
    }
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    reliability_png(res, args.out / "reliability.png")
    write_markdown(res, args.out / "README.md")
    print(table(res["metrics"]))
    print(json.dumps({"diversity": res["diversity"], "overhead_ratio": overhead.ratio,
                      "formula": overhead.formula, "cost": cost, "timings_s": res["timings_s"]}, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
