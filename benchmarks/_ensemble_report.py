"""One cell's report: every method's metrics on test (and OOD), with and without a dev temperature,
at equal member counts, with paired bootstrap differences on the same test items.

Why equal members (issue 33): the first page set SVE's 8-16 members against the baselines' 4.
Every family now trains ``M`` members once and reports its first ``m`` members as the M=m
ensemble for each m of ``--report-m`` (members never share a gradient or a data order, so the
first m of a run are an m-member run; ``test_ensembles_bench`` checks it for each family).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
from _ensemble_metrics import (
    apply_temperature,
    diversity,
    evaluate,
    fit_temperature,
    loss_ends,
    mutual_information,
    paired_diff,
)

from guarduq.calibration import reliability_bins

FAMILY_ROW = {"sve": "SVE", "lora": "LoRA-Ensemble", "deep": "deep ensemble"}
METRICS = ("ece", "accuracy", "nll")


def report_sizes(total: int, wanted: list[int]) -> list[int]:
    """The ensemble sizes a family of ``total`` members reports: each wanted m below it, and itself."""
    return sorted({m for m in wanted if m < total} | {total})


def subset(arrays: dict[str, np.ndarray], m: int) -> dict[str, np.ndarray]:
    return {s: a[:m] for s, a in arrays.items()}


def first_members(arrays: dict[str, np.ndarray], info: dict[str, Any], m: int) -> tuple[dict[str, np.ndarray],
                                                                                      dict[str, Any]]:
    """The first ``m`` members of a run of M as an m-member ensemble; its costs (stored parameters,
    train seconds, seconds per item) are the run's times m / M."""
    total = next(iter(arrays.values())).shape[0]
    if m == total:
        return arrays, info
    fit = {**info.get("fit", {})}
    if fit.get("seconds") is not None:
        fit["seconds"] *= m / total
    return subset(arrays, m), {
        **info, "fit": fit, "stored": info["stored"] * m // total,
        "seconds_per_item": {s: v * m / total for s, v in info.get("seconds_per_item", {}).items()},
        "settings": {**info.get("settings", {}), "members": m, "first_of": total}}


def first_member(arrays: dict[str, np.ndarray], info: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Member 0 of a LoRA or deep ensemble as its one-member row (its one rate was not selected:
    member 0 is the model an M=1 run trains, ``test_ensembles_bench`` checks it)."""
    total = next(iter(arrays.values())).shape[0]
    arrays, info = first_members(arrays, info, 1)
    return arrays, {**info, "settings": {**info.get("settings", {}), "from": f"member 0 of the M={total} ensemble"}}


def _methods(singles: dict[str, Any], finals: dict[str, Any], wanted: list[int],
             base_logp: dict[str, np.ndarray]) -> tuple[list[tuple[str, dict[str, np.ndarray], dict[str, Any]]],
                                                        dict[str, list[int]]]:
    methods = [
        ("base", base_logp, {"stored": 0, "trainable_per_member": 0}),
        ("fine-tuned (SVE M=1)", *singles["sve"]),
        ("LoRA (M=1)", *singles["lora"]),
        ("full fine-tune (M=1)", *singles["deep"]),
    ]
    sizes = {}
    for family, row in FAMILY_ROW.items():
        arrays, info = finals[family]
        sizes[family] = report_sizes(arrays["test"].shape[0], wanted)
        for m in sizes[family]:
            methods.append((f"{row} M={m}", *first_members(arrays, info, m)))
    for key, (arrays, info) in finals.items():
        if key.startswith("sve-lr"):
            methods.append((f"SVE M={arrays['test'].shape[0]}, lr {key.removeprefix('sve-lr')}", arrays, info))
    return methods, sizes


def _row(name: str, arrays: dict[str, np.ndarray], info: dict[str, Any], labels: dict[str, np.ndarray],
         ts: bool) -> tuple[dict[str, Any], np.ndarray]:
    dev = np.exp(arrays["dev"]).mean(0)
    t = fit_temperature(dev, labels["dev"]) if ts else 1.0
    test = apply_temperature(np.exp(arrays["test"]).mean(0), t)
    members = arrays["test"].shape[0]
    mi = mutual_information(arrays["test"]) if members > 1 else None
    ood = ood_mi = None
    if "ood" in arrays:
        ood = apply_temperature(np.exp(arrays["ood"]).mean(0), t)
        ood_mi = mutual_information(arrays["ood"]) if members > 1 else None
    metrics = evaluate(test, labels["test"], mi=mi, ood_probs=ood, ood_mi=ood_mi)
    conf, correct = test.max(1), (test.argmax(1) == labels["test"]).astype(float)
    fit = info.get("fit", {})
    return {
        "name": f"{name} + TS" if ts else name, "members": members, "temperature": t, **metrics,
        "stored": info["stored"] + (1 if ts else 0), "trainable_per_member": info["trainable_per_member"],
        "train_seconds": fit.get("seconds"), "peak_rss_mb": fit.get("peak_rss_mb"),
        "seconds_per_item": info.get("seconds_per_item", {}).get("test"),
        "diversity": diversity(arrays["test"]), "settings": info.get("settings"),
        "reliability": reliability_bins(conf, correct),
        "history": fit.get("history"), "train_loss": loss_ends(fit, members),
    }, test


def _paired(probs: dict[str, np.ndarray], labels: np.ndarray, a: str, b: str, out: dict[str, Any]) -> None:
    for metric in METRICS:
        out[f"{a} - {b}: {metric}"] = paired_diff(probs[a], probs[b], labels, metric)


def report_cell(cell: str, task: Any, enc: dict[str, Any], labels: dict[str, np.ndarray],
                singles: dict[str, Any], finals: dict[str, Any], args: argparse.Namespace,
                facts: dict[str, Any]) -> dict[str, Any]:
    """Every method's metrics on test (and OOD), with and without a temperature fitted on dev."""
    base_logp = {s: torch.log_softmax(e.base_logits, -1).numpy()[None] for s, e in enc.items()}
    wanted = [int(x) for x in str(args.report_m).split(",") if x.strip()]
    methods, sizes = _methods(singles, finals, wanted, base_logp)
    rows, probs = [], {}
    for name, arrays, info in methods:
        for ts in (False, True):
            row, probs[row["name"]] = _row(name, arrays, info, labels, ts)
            rows.append(row)
    y = labels["test"]
    equal = sorted(set(sizes["sve"]) & set(sizes["lora"]) & set(sizes["deep"]))
    largest = [f"{FAMILY_ROW[f]} M={sizes[f][-1]}" for f in FAMILY_ROW]
    paired: dict[str, Any] = {}
    for m in equal:  # SVE against each baseline at the same M, and against the base model
        for other in (f"LoRA-Ensemble M={m}", f"deep ensemble M={m}", "base"):
            _paired(probs, y, f"SVE M={m}", other, paired)
    if not equal:
        for other in (*largest[1:], "base"):
            _paired(probs, y, largest[0], other, paired)
    _paired(probs, y, largest[0], "base", paired)
    for name, arrays, _ in methods:  # sensitivity rows: against each family at their M (else its largest)
        if name.startswith("SVE M=") and ", lr " in name:
            m = arrays["test"].shape[0]
            for family, big in zip(FAMILY_ROW, largest, strict=True):
                _paired(probs, y, name, f"{FAMILY_ROW[family]} M={m}" if m in sizes[family] else big, paired)
    # SVE diagnostics: averaging the members in log space instead of probability space
    logit_mean = np.exp(finals["sve"][0]["test"].mean(0))
    logit_mean /= logit_mean.sum(1, keepdims=True)
    at = equal[-1] if equal else None
    baselines = [f"{FAMILY_ROW[f]} M={at}" for f in ("lora", "deep")] if at else largest[1:]
    reference = min(baselines, key=lambda n: next(r["ece"][0] for r in rows if r["name"] == n))
    vs_best = [[r["name"], {k: paired_diff(probs[r["name"]], probs[reference], y, k) for k in METRICS}]
               for r in rows if not r["name"].endswith("+ TS") and r["name"] != reference]
    return {"cell": cell, "task": task.name, "ood": task.ood_name, "facts": {**facts, "equal_m": equal},
            "methods": rows, "sve_diagnostics": {"logit_space_mean": evaluate(logit_mean, y)}, "paired": paired,
            "paired_vs_best": {"reference": reference, "rows": vs_best},
            "args": {k: str(v) for k, v in vars(args).items()}}
