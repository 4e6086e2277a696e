"""The ensemble page (docs/ensembles/README.md's generated block) from results.json: per cell the
issue's goals at equal member counts, the metrics table, paired differences, each family's dev
curve and each member's training loss, and the figures (``_ensemble_plots``).

Rendering reads only results.json, so a page written before a section existed renders again
(``ensembles.py --render``): a section whose figures that run did not record is left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _ensemble_metrics import loss_cell, loss_ends
from _ensemble_plots import (
    dev_curves_figure,
    paired_figure,
    reliability_figure,
    save,
    tradeoff_figure,
)
from _pages import write_page


def fmt(v: list[float] | None, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v[0]:.{digits}f} [{v[1]:.{digits}f}, {v[2]:.{digits}f}]"


def compared(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(SVE, LoRA-Ensemble, deep ensemble) row names the goals compare: each equal M of the run;
    a run from before equal members (its SVE larger than the baselines): its largest of each."""
    equal = res["facts"].get("equal_m")
    if equal:
        return [(f"SVE M={m}", f"LoRA-Ensemble M={m}", f"deep ensemble M={m}") for m in equal]
    lora = next(r["name"] for r in res["methods"] if r["name"].startswith("LoRA-Ensemble") and "+" not in r["name"])
    deep = next(r["name"] for r in res["methods"] if r["name"].startswith("deep ensemble") and "+" not in r["name"])
    return [(f"SVE M={res['args'].get('sve_members', '16')}", lora, deep)]


def mark(ok: bool) -> str:
    return "met" if ok else "**not met**"


def goals(res: dict[str, Any], names: tuple[str, str, str]) -> list[str]:
    """The issue's goals for one cell at one M, each with the measured figures."""
    rows = {r["name"]: r for r in res["methods"]}
    sve, lora, deep = (rows[n] for n in names)
    base, f, paired = rows["base"], res["facts"], res["paired"]
    best_base = min((lora, deep), key=lambda r: r["ece"][0])
    best_acc = max(lora["accuracy"][0], deep["accuracy"][0])
    out = ["| goal | measured | |", "|---|---|---|"]
    ece_diff = paired.get(f"{sve['name']} - {best_base['name']}: ece")
    out.append(f"| ECE ≤ the lower of LoRA-Ensemble's and the deep ensemble's | {sve['name']} {fmt(sve['ece'])} vs "
               f"{best_base['name']} {fmt(best_base['ece'])}; paired difference {fmt(ece_diff)} | "
               f"{mark(sve['ece'][0] <= best_base['ece'][0])} |")
    if ece_diff is not None:
        out.append(f"| its paired interval against the better baseline does not lie above 0 | {fmt(ece_diff)} | "
                   f"{mark(ece_diff[1] <= 0)} |")
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
        d = paired.get(f"{sve['name']} - base: {metric}")
        out.append(f"| {metric.upper()} not worse than the base model's | {sve[metric][0]:.3f} vs "
                   f"{base[metric][0]:.3f}; paired difference {fmt(d)} | {mark(sve[metric][0] <= base[metric][0])} |")
    return out


def _facts(res: dict[str, Any]) -> list[str]:
    f = res["facts"]
    kind = f.get("sve_parametrisation", {"parametrisation": "raw", "bias": "raw"})
    parts = [
        f"- n: {f['sizes']}; blocks trained: the last {f['blocks'] - f['k']} of {f['blocks']} (every method); "
        f"chosen learning rates {f['chosen_lr']}, SVE σ_init {f['sigma_init']}; SVE parametrisation "
        f"{'/'.join(kind.values())} (Σ/bias: raw = in their own units; relative = Σ ⊙ exp(δ); scaled = b₀ + s·β).",
    ]
    if "deep_perturb" in f:
        parts.append(f"- Deep-ensemble members: each its own data order and, with λ = {f['deep_perturb']:g}, its own "
                     "seeded NoisyTune start (every tensor W + U(−λ/2, λ/2)·std(W); λ = 0: data order only).")
    if f.get("median_singular_value") is not None:
        parts.append(f"- Median singular value of the trained blocks' targeted matrices: "
                     f"{f['median_singular_value']:.2f} (SVE's raw step relative to Σ is about lr / Σ).")
    if res.get("ood"):
        parts.append(f"- OOD items: {res['ood']}.")
    for r in res["methods"]:
        s = r.get("settings") or {}
        if s.get("from") and not r["name"].endswith("+ TS"):
            parts.append(f"- {r['name']}: {s['from']} (its one rate was not selected on dev; "
                         "train seconds and ms/item are the ensemble's divided by M).")
    firsts = sorted({(r["members"], r["settings"]["first_of"]) for r in res["methods"]
                     if (r.get("settings") or {}).get("first_of") and r["members"] > 1})
    if firsts:
        parts.append("- " + "; ".join(f"M={m} rows: the first {m} members of the M={t} run" for m, t in firsts)
                     + " (its train seconds, ms/item and stored parameters scaled by m / M).")
    parts.append(f"- Frozen blocks, once per item: {max(f['encode_seconds_per_item'].values()):.3f} s/item "
                 "(cached states).\n")
    return parts


def _metrics_table(res: dict[str, Any]) -> list[str]:
    f = res["facts"]
    parts = ["| method | M | accuracy | ECE (floor) | NLL | Brier | AUROC entropy | AUROC MI | "
             "OOD AUROC entropy | OOD AUROC MI | stored params | % of model | train s | infer ms/item | peak RSS MB |",
             "|---|---:|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in res["methods"]:
        pct = 100 * r["stored"] / f["base_params"]
        parts.append(
            f"| {r['name']} | {r['members']} | {fmt(r['accuracy'])} | {fmt(r['ece'])} ({r['ece_floor'][0]:.3f}) "
            f"| {fmt(r['nll'])} | {fmt(r['brier'])} | {fmt(r.get('auroc_entropy'))} | {fmt(r.get('auroc_mi'))} "
            f"| {fmt(r.get('ood_auroc_entropy'))} | {fmt(r.get('ood_auroc_mi'))} | {r['stored']:,} | {pct:.3f} "
            f"| {r['train_seconds'] or 0:.0f} | {1000 * (r['seconds_per_item'] or 0):.1f} | {r['peak_rss_mb'] or 0:.0f} |")
    return parts


def _diversity_and_losses(res: dict[str, Any]) -> list[str]:
    parts = ["\nMember diversity on test, and the temperature each ensemble's mean got on dev:\n",
             "| method | pairwise disagreement | mean MI (nats) | dev temperature |\n|---|---:|---:|---:|"]
    ts = {r["name"].removesuffix(" + TS"): r["temperature"] for r in res["methods"] if r["name"].endswith("+ TS")}
    plain = [r for r in res["methods"] if not r["name"].endswith("+ TS")]
    for r in plain:
        if r["members"] > 1:
            d = r["diversity"]
            parts.append(f"| {r['name']} | {d['pairwise_disagreement']:.3f} | {d['mean_mi']:.4f} "
                         f"| {ts.get(r['name'], float('nan')):.2f} |")
    parts.append("\nTraining loss of each member, first → last (each the mean of w steps; a member whose loss "
                 "does not fall has not been tuned):\n")
    parts.append("| method | w | per member |\n|---|---:|---|")
    flat = []
    for r in plain:
        if r["name"] != "base":
            ends = r.get("train_loss") or loss_ends({"history": r.get("history")})  # older results: mean
            parts.append(f"| {r['name']} | {ends['window'] if ends else '–'} | {loss_cell(ends)} |")
            if ends and not ends.get("mean_only") and not (r.get("settings") or {}).get("first_of"):  # once a run
                flat += [(r["name"], i) for i, (a, b) in enumerate(zip(ends["first"], ends["last"], strict=True))
                         if b >= a]
    if flat:
        parts.append("\n**Members whose training loss did not fall** (not tuned): "
                     + "; ".join(f"{n} member {i}" for n, i in flat) + ".")
    return parts


def _added(search: dict[str, Any], lr: float) -> str:
    if lr == search.get("transferred"):
        return " (transferred)"
    return " +" if lr not in search["initial"] else ""


def _rate_search(res: dict[str, Any]) -> list[str]:
    """Each family's dev curve (rate → dev NLL), and the transferred SVE rate against this cell's own."""
    f = res["facts"]
    searches = f.get("rate_search")
    if not searches:
        return []
    parts = ["\nEach family's learning rate on dev (one member each; the grid grows one step past an edge its best "
             f"sits at, at most {res['args'].get('max_extensions', '?')} times):\n",
             "| family | rate → dev NLL (★ chosen, + added past the edge) | rates added | chosen |\n|---|---|---:|---|"]
    for s in searches:
        curve = ", ".join(f"{lr:g} → {nll:.4f}{' ★' if lr == s['chosen'] else ''}{_added(s, lr)}"
                          for lr, nll in s["curve"])
        edge = f" — **still at the grid's {s['at_edge']} edge**" if s["at_edge"] else ""
        few = f" (**a grid of {len(s['initial'])}: fewer than 3 rates**)" if len(s["initial"]) < 3 else ""
        parts.append(f"| {s['family']}{few} | {curve} | {s['extensions']} | {s['chosen']:g}{edge} |")
    searched = {s["family"].split("-")[0] for s in searches}
    for family, lr in f["chosen_lr"].items():
        if family not in searched:
            parts.append(f"| {family} (**one rate given: not selected**) | – | – | {lr:g} |")
    t = f.get("sve_transfer")
    if t:
        parts.append(f"\nSVE's rate is transferred unchanged from {t['from']}: {t['lr']:g} (dev NLL {t['dev_nll']:.4f} "
                     f"here). This cell's own best rate: {t['own_best_lr']:g} (dev NLL {t['own_best_dev_nll']:.4f}"
                     f"{', at its grid edge' if t['own_best_at_edge'] else ''}); the transferred rate is "
                     f"{t['lr'] / t['own_best_lr']:.3g}× it and costs {t['dev_nll'] - t['own_best_dev_nll']:+.4f} "
                     "dev NLL.")
    return parts


def _selection(res: dict[str, Any]) -> list[str]:
    f = res["facts"]
    parts = []
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
    return parts


def _figures(cell: str, res: dict[str, Any], out: Path) -> list[str]:
    slug = cell.replace(":", "-")
    shown = [r for r in res["methods"] if not r["name"].endswith("+ TS") or r["name"] == "base + TS"]
    save(reliability_figure([(r["name"], r["reliability"], r["ece"][0]) for r in shown], f"{cell}: test reliability"),
         out / f"{slug}-reliability.png")
    save(tradeoff_figure([{"name": r["name"], "stored": r["stored"], "accuracy": r["accuracy"], "ece": r["ece"]}
                          for r in res["methods"] if not r["name"].endswith("+ TS")],
                         f"{cell}: accuracy and ECE against stored parameters"), out / f"{slug}-tradeoff.png")
    parts = [f"\n![reliability]({slug}-reliability.png)\n\n![tradeoff]({slug}-tradeoff.png)\n"]
    vs = res.get("paired_vs_best")
    if vs:
        save(paired_figure(vs["rows"], vs["reference"], f"{cell}: each method − the best baseline ({vs['reference']}), "
                           "paired on the same test items"), out / f"{slug}-paired.png")
        parts.append(f"![paired differences against the best baseline]({slug}-paired.png)\n")
    searches = res["facts"].get("rate_search")
    if searches:
        t = res["facts"].get("sve_transfer")
        save(dev_curves_figure(searches, f"{cell}: dev NLL against learning rate", t["lr"] if t else None),
             out / f"{slug}-dev-curves.png")
        parts.append(f"![dev curves]({slug}-dev-curves.png)\n")
    return parts


def render(results: dict[str, Any], out: Path) -> None:
    parts = []
    for cell, res in results.items():
        if "facts" not in res:  # a rate check only, so far
            continue
        parts.append(f"## {cell}\n")
        level = bool(res["facts"].get("equal_m"))
        for names in compared(res):
            parts.append(f"Goals of issues 24 and 33 on this cell ({names[0]} against the baselines' rows "
                         f"{names[1]}, {names[2]}"
                         f"{'' if level else '; a run from before equal members, so not the M issue 33 asks'}):\n")
            parts += goals(res, names)
            parts.append("")
        parts += _facts(res)
        parts += _metrics_table(res)
        parts.append("\nPaired bootstrap differences on the same test items:\n")
        parts.append("| difference | value [95%] |\n|---|---|")
        parts += [f"| {k} | {fmt(v)} |" for k, v in res["paired"].items()]
        parts += _diversity_and_losses(res)
        logit = res["sve_diagnostics"]["logit_space_mean"]
        sve_row = next(r for r in res["methods"] if r["name"] == f"SVE M={res['args'].get('sve_members', '16')}")
        parts.append(f"\nAveraging {sve_row['name']}'s members in log space instead (renormalised geometric mean): "
                     f"ECE {fmt(logit['ece'])}, NLL {fmt(logit['nll'])}, accuracy {fmt(logit['accuracy'])} "
                     f"(probability space: ECE {fmt(sve_row['ece'])}, NLL {fmt(sve_row['nll'])}).")
        parts += _rate_search(res)
        parts += _selection(res)
        parts += _figures(cell, res, out)
    write_page(out / "README.md", "\n".join(parts), "SVE against LoRA-Ensemble and deep ensembles")
