"""A readable calibration report: ``report.html`` plus PNGs, drawn from held-out per-item data.

``write_report(calibrator_or_evaluation, out_dir)`` accepts a fitted/loaded ``Calibrator`` (it uses
the evaluation embedded in the artifact) or an ``Evaluation`` (e.g. from ``guarduq evaluate``).
Figures: reliability diagram (before/after calibration), risk-coverage curve with the chosen
operating points, ROC curves per signal, score histograms by label.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from guarduq.calibration import (  # noqa: E402
    EPISTEMIC_FLOOR,
    SIGNALS,
    Calibrator,
    Evaluation,
    reliability_bins,
    risk_coverage,
    roc_points,
    signal_values,
)
from guarduq.errors import CalibrationError  # noqa: E402

FIGURES = {
    "reliability": "reliability.png",
    "risk_coverage": "risk_coverage.png",
    "roc": "roc.png",
    "histograms": "histograms.png",
}
_LABELS = {
    "epistemic": "epistemic ‖∇p̄‖²",
    "aleatoric": "aleatoric p̄(1−p̄)",
    "combined": "z(log epi) + z(ale)",
    "mean_logprob": "−mean log p",
    "risk": "calibrated risk",
}


def write_report(source: Calibrator | Evaluation, out_dir: str | os.PathLike[str]) -> Path:
    """Write ``report.html`` and its PNGs into ``out_dir``; returns the HTML path."""
    calibrator = source if isinstance(source, Calibrator) else None
    evaluation = calibrator.evaluation_ if calibrator is not None else source
    if not isinstance(evaluation, Evaluation):
        raise CalibrationError(
            "nothing to report: this calibrator carries no evaluation data (fit it with held-out "
            "test items, or run `guarduq evaluate --report DIR`)"
        )
    if evaluation.labels.size == 0:
        raise CalibrationError("nothing to report: the evaluation has no valid items")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _reliability(evaluation, out / FIGURES["reliability"])
    _risk_coverage(evaluation, out / FIGURES["risk_coverage"])
    _roc(evaluation, out / FIGURES["roc"])
    _histograms(evaluation, out / FIGURES["histograms"])
    page = out / "report.html"
    tmp = page.with_suffix(".html.tmp")
    tmp.write_text(_html(evaluation, calibrator), encoding="utf-8")
    os.replace(tmp, page)
    return page


# --------------------------------------------------------------------------- figures


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _reliability(ev: Evaluation, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    pairs = [
        ("before: p̄ as confidence", ev.signals["mean_token_prob"], ev.metrics.get("ece_before")),
        ("after: 1 − risk", 1 - ev.signals["risk"], ev.metrics.get("ece_after")),
    ]
    for ax, (title, conf, e) in zip(axes, pairs, strict=True):
        bins = reliability_bins(conf, ev.labels)
        width = 1 / 15
        ax.bar(
            [b["lo"] for b in bins],
            [b["accuracy"] for b in bins],
            width=width,
            align="edge",
            edgecolor="black",
            alpha=0.7,
            label="accuracy in bin",
        )
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "o", color="C1", label="(mean conf, acc)")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        for b in bins:
            ax.annotate(str(b["count"]), (b["lo"] + width / 2, b["accuracy"]), ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{title}\nECE = {_fmt(e)}")
        ax.set_xlabel("confidence (P correct)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Reliability (n = {ev.labels.size}; bar labels = items per bin)")
    _save(fig, path)


def _risk_coverage(ev: Evaluation, path: Path) -> None:
    wrong = 1 - ev.labels
    oriented = signal_values(ev.signals)
    fig, ax = plt.subplots(figsize=(6.5, 4.6))
    for i, name in enumerate(SIGNALS):
        cov, risk = risk_coverage(oriented[name], wrong)
        ax.plot(cov, risk, color=f"C{i}", lw=2.2 if name == "risk" else 1.2, label=_LABELS[name])
    n, k = wrong.size, wrong.sum()
    cov = np.arange(1, n + 1) / n
    ax.plot(cov, np.maximum(0, np.arange(1, n + 1) - (n - k)) / np.arange(1, n + 1), "k:", lw=1, label="oracle")
    ax.axhline(wrong.mean(), color="grey", ls="--", lw=1, label=f"random ({wrong.mean():.2f})")
    for g in ev.guarantees:
        if g.get("threshold") is None or g.get("error_rate") is None:
            continue
        ax.plot(g["coverage"], g["error_rate"], "s", color="red", ms=7)
        ax.annotate(
            f"α={g['alpha']:g}" + ("" if g.get("held") else " (missed)"),
            (g["coverage"], g["error_rate"]),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=8,
            color="red",
        )
        ax.axhline(g["alpha"], color="red", ls=":", lw=0.6)
    ax.set_xlabel("coverage (fraction of answers accepted)")
    ax.set_ylabel("error rate among accepted")
    ax.set_title(f"Risk–coverage (AURC = {_fmt(ev.metrics.get('aurc'))}; red = operating points)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)


def _roc(ev: Evaluation, path: Path) -> None:
    wrong = 1 - ev.labels
    oriented = signal_values(ev.signals)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for i, name in enumerate(SIGNALS):
        pts = roc_points(wrong, oriented[name])
        if pts is None:
            continue
        auc = ev.metrics["auroc"].get(name)
        ax.plot(pts[0], pts[1], color=f"C{i}", lw=2.2 if name == "risk" else 1.2, label=f"{_LABELS[name]} ({_fmt(auc)})")
    ax.plot([0, 1], [0, 1], "k--", lw=1)
    ax.set_xlabel("false positive rate (correct flagged)")
    ax.set_ylabel("true positive rate (wrong flagged)")
    ax.set_title("Detecting wrong answers: ROC (AUROC)")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)


def _histograms(ev: Evaluation, path: Path) -> None:
    panels = [
        ("log10 epistemic", np.log10(np.maximum(ev.signals["epistemic"], EPISTEMIC_FLOOR))),
        ("aleatoric p̄(1−p̄)", ev.signals["aleatoric"]),
        ("mean log p", ev.signals["mean_logprob"]),
        ("calibrated risk", ev.signals["risk"]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    correct = ev.labels == 1
    for ax, (title, x) in zip(axes.ravel(), panels, strict=True):
        edges = np.histogram_bin_edges(x, bins=30)
        if correct.any():
            ax.hist(x[correct], bins=edges, alpha=0.55, density=True, label=f"correct (n={correct.sum()})")
        if (~correct).any():
            ax.hist(x[~correct], bins=edges, alpha=0.55, density=True, label=f"wrong (n={(~correct).sum()})")
        ax.set_title(title)
        ax.set_ylabel("density")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Scores by label")
    _save(fig, path)


# --------------------------------------------------------------------------- html


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if not np.isfinite(x):
            return "–"
        return f"{x:.{digits}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{digits}f}"
    return html.escape(str(x))


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def metrics_rows(metrics_by_name: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the metrics table (one row per data set); shared with the CLI."""
    headers = ["data", "n", "accuracy", *[f"AUROC {s}" for s in SIGNALS], "ECE before", "ECE after", "ECE floor (95%)", "Brier", "AURC", "PRR"]
    rows = []
    for name, m in metrics_by_name.items():
        au = m.get("auroc") or {}
        rows.append(
            [name, m.get("n"), m.get("accuracy"), *[au.get(s) for s in SIGNALS],
             m.get("ece_before"), m.get("ece_after"), _floor(m), m.get("brier"), m.get("aurc"), m.get("prr")]
        )
    return headers, rows


def _floor(m: Mapping[str, Any]) -> str | None:
    """"mean (95th percentile)" of a perfect calibrator's ECE; None for artifacts older than it."""
    if m.get("ece_floor") is None or m.get("ece_floor_p95") is None:
        return None
    return f"{m['ece_floor']:.3f} ({m['ece_floor_p95']:.3f})"


def _guarantee_rows(guarantees: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [g["alpha"], g["delta"], g.get("threshold"), g.get("coverage"), g.get("n_accepted"), g.get("error_rate"), g.get("held")]
        for g in guarantees
    ]


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.85em}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}td:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}
code{background:#f5f5f5;padding:1px 4px}.note{color:#555;font-size:0.9em}
"""


def _html(ev: Evaluation, cal: Calibrator | None) -> str:
    model = ev.model or {}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>guarduq calibration report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>guarduq calibration report</h1>",
        f"<p>Model <code>{_fmt(model.get('name'))}</code>, fingerprint <code>{_fmt(model.get('fingerprint'))}</code>. "
        f"Generated {datetime.now(UTC).isoformat(timespec='seconds')}.</p>",
    ]
    if cal is not None:
        lg = cal.pipeline_.named_steps["logistic"]
        coefs = ", ".join(f"{f}: {c:+.3f}" for f, c in zip(cal.features, lg.coef_[0], strict=True))
        parts += [
            "<h2>Calibrator</h2>",
            f"<p>Artifact sha256 <code>{_fmt(cal.sha256)}</code>, created {_fmt(cal.created_)}. "
            f"Feature set <code>{_fmt(cal.feature_set or 'custom')}</code>, gradients over parameters "
            f"<code>{_fmt(cal.parameter_set_)}</code> (scores over another set are refused); L2 strength C = "
            f"{cal.C_:.3g} ({'chosen by ' + str(cal.cv_['folds']) + '-fold CV on log loss' if cal.cv_ else 'fixed'}). "
            f"Logistic regression on standardised features (coefficients on P(wrong): {coefs}; "
            f"intercept {lg.intercept_[0]:+.3f}) fitted on {cal.n_fit_} items ({cal.n_fit_invalid_} invalid excluded); it predicts "
            "risk = P(wrong | scores). "
            + (f"Directions learned within each dataset ({_fmt(', '.join(cal.groups_))}): one free "
               "intercept per dataset while fitting, one shared intercept to serve.</p>"
               if cal.groups_ else "Directions learned across the pooled data.</p>"),
        ]
        if cal.datasets_:
            parts.append(
                _table(
                    ["dataset", "file", "sha256", "items scored", "fit", "threshold", "test"],
                    [[d.get("name"), d.get("file"), str(d.get("sha256", ""))[:16] + "…", d.get("n"),
                      d.get("n_fit"), d.get("n_threshold"), d.get("n_test")] for d in cal.datasets_],
                )
            )
        parts += [
            "<h3>Thresholds chosen on the calibration split</h3>",
            "<p class='note'>Accept an answer when risk ≤ threshold. Each threshold is the loosest one whose "
            "accepted set has error ≤ α with probability ≥ 1 − δ (exact Clopper–Pearson test, fixed "
            "sequence strict → loose). The start is the fit split's strongest point: when it lies past "
            "the first testable threshold, a second sequence ran from it, each at δ/2.</p>",
            _table(
                ["α", "δ", "start", "threshold", "coverage", "accepted", "errors", "upper bound", "note"],
                [[t.alpha, t.delta, t.start, t.threshold, t.coverage, t.n_accepted, t.errors,
                  t.upper_bound, t.message or ""] for t in cal.thresholds_],
            ),
        ]
    by_name: dict[str, Mapping[str, Any]] = {"all": ev.metrics}
    by_name.update(ev.per_dataset)
    headers, rows = metrics_rows(by_name)
    parts += [
        f"<h2>Held-out metrics (n = {ev.labels.size}, {ev.n_invalid} invalid excluded)</h2>",
        "<p class='note'>AUROC for detecting wrong answers, every signal oriented higher = more uncertain "
        "(mean log p negated; combined = z(log epistemic) + z(aleatoric)). ECE (15 bins) and Brier: before = "
        "mean token probability p̄ as the confidence, after = 1 − risk; ECE floor = the ECE a perfectly "
        "calibrated risk would show on these items, mean (95th percentile): sampling noise at this n; an ECE "
        "after above the 95% figure is miscalibration. AURC: area under the risk–coverage "
        "curve (lower is better). PRR: prediction rejection ratio of the risk (1 = oracle, 0 = random).</p>",
        _table(headers, rows),
        "<h3>Guarantees on this data</h3>",
        _table(["α", "δ", "threshold", "coverage", "accepted", "error rate", "held"], _guarantee_rows(ev.guarantees)),
        *(f"<p><b>Uneven coverage:</b> {html.escape(n)}.</p>" for n in ev.coverage_notes()),
    ]
    for name, m in ev.per_dataset.items():
        if m.get("guarantees"):
            parts += [f"<h4>{html.escape(name)}</h4>",
                      _table(["α", "δ", "threshold", "coverage", "accepted", "error rate", "held"], _guarantee_rows(m["guarantees"]))]
    for key, title in [
        ("reliability", "Reliability diagram"),
        ("risk_coverage", "Risk–coverage curve"),
        ("roc", "ROC curves per signal"),
        ("histograms", "Score histograms by label"),
    ]:
        parts.append(f"<h2>{title}</h2><img src='{FIGURES[key]}' alt='{title}'>")
    parts.append("</body></html>")
    return "\n".join(parts)
