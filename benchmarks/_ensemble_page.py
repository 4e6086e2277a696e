"""The ensemble page's figures: interval formatting and the issue's goals, measured per cell."""

from __future__ import annotations

from typing import Any


def fmt(v: list[float] | None, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v[0]:.{digits}f} [{v[1]:.{digits}f}, {v[2]:.{digits}f}]"


def goals(res: dict[str, Any]) -> list[str]:
    """The issue's goals for one cell, each with the measured figures (largest SVE ensemble)."""
    rows = {r["name"]: r for r in res["methods"]}
    sve = rows[f"SVE M={res['args'].get('sve_members', '16')}"]
    lora = next(r for r in res["methods"] if r["name"].startswith("LoRA-Ensemble") and "+" not in r["name"])
    deep = next(r for r in res["methods"] if r["name"].startswith("deep ensemble") and "+" not in r["name"])
    base, f = rows["base"], res["facts"]
    best_base = min((lora, deep), key=lambda r: r["ece"][0])
    best_acc = max(lora["accuracy"][0], deep["accuracy"][0])
    paired = res["paired"]

    def mark(ok: bool) -> str:
        return "met" if ok else "**not met**"

    out = ["| goal | measured | |", "|---|---|---|"]
    ece_diff = paired[f"{sve['name']} - {best_base['name']}: ece"]
    out.append(f"| ECE ≤ the lower of LoRA-Ensemble's and the deep ensemble's | {sve['name']} {fmt(sve['ece'])} vs "
               f"{best_base['name']} {fmt(best_base['ece'])}; paired difference {fmt(ece_diff)} | "
               f"{mark(sve['ece'][0] <= best_base['ece'][0])} |")
    out.append(f"| accuracy within 1 point of the better baseline | {sve['accuracy'][0]:.3f} vs {best_acc:.3f} "
               f"({100 * (sve['accuracy'][0] - best_acc):+.1f} points) | {mark(sve['accuracy'][0] >= best_acc - 0.01)} |")
    for key, label in (("auroc_entropy", "misclassification AUROC (entropy)"), ("auroc_mi", "misclassification AUROC (MI)"),
                       ("ood_auroc_entropy", "OOD AUROC (entropy)"), ("ood_auroc_mi", "OOD AUROC (MI)")):
        if sve.get(key) is None or lora.get(key) is None or deep.get(key) is None:
            continue
        best = max(lora[key][0], deep[key][0])
        out.append(f"| {label} ≥ the better baseline's − 0.01 | {sve[key][0]:.3f} vs {best:.3f} | "
                   f"{mark(sve[key][0] >= best - 0.01)} |")
    extra = sve["stored"] - sve["trainable_per_member"]  # beyond one fine-tuned member
    out.append(f"| ≤ 1% extra parameters | (M−1) × {sve['trainable_per_member']:,} = {extra:,} = "
               f"{100 * extra / f['base_params']:.3f}% of {f['base_params']:,} | {mark(extra <= 0.01 * f['base_params'])} |")
    out.append(f"| ≤ 1/10 of LoRA-Ensemble's stored parameters | {sve['stored']:,} vs {lora['stored']:,} "
               f"({sve['stored'] / lora['stored']:.3f}) | {mark(sve['stored'] <= lora['stored'] / 10)} |")
    for metric in ("ece", "nll"):
        d = paired[f"{sve['name']} - base: {metric}"]
        out.append(f"| {metric.upper()} not worse than the base model's | {sve[metric][0]:.3f} vs "
                   f"{base[metric][0]:.3f}; paired difference {fmt(d)} | {mark(sve[metric][0] <= base[metric][0])} |")
    return out
