"""benchmarks/ensembles.py, issue 33: rate grids that grow past an edge, equal members, a deep
ensemble whose members start apart, SVE's one transferred rate, Qwen cells that skip cleanly, and
figures whose texts never overlap."""

from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _ensemble_methods import DeepMethod, Top  # noqa: E402
from _ensemble_select import search_rate  # noqa: E402

from tests.conftest import make_tokenizer, tiny_llama  # noqa: E402

# --------------------------------------------------------------------------- rate search


def test_an_interior_best_keeps_the_grid() -> None:
    tried = []
    s = search_rate("lora", [1e-4, 3e-4, 1e-3], lambda lr: tried.append(lr) or (np.log10(lr) + 3.5) ** 2)
    assert tried == [1e-4, 3e-4, 1e-3] and s.chosen == 3e-4 and s.extensions == 0 and s.at_edge is None


def test_a_best_at_the_low_edge_extends_by_the_edges_own_spacing_until_it_turns() -> None:
    # dev NLL is lowest at 1e-5: from 1e-4 (step 3 at that edge) the grid tries 3.3e-5, 1.1e-5, 3.7e-6
    s = search_rate("deep", [1e-4, 3e-4, 1e-3], lambda lr: (np.log10(lr) + 5) ** 2)
    assert sorted(s.dev_nll) == pytest.approx([3.7e-6, 1.1e-5, 3.3e-5, 1e-4, 3e-4, 1e-3])
    assert s.chosen == pytest.approx(1.1e-5) and s.at_edge is None and s.extensions == 3


def test_the_bound_stops_the_search_and_the_edge_is_marked() -> None:
    s = search_rate("sve", [1e-2, 3e-2, 1e-1], lambda lr: -lr, max_extensions=2)  # always better higher
    assert sorted(s.dev_nll) == pytest.approx([1e-2, 3e-2, 1e-1, 0.33, 1.1])  # steps 0.1 / 0.03, then 0.33 / 0.1
    assert s.extensions == 2 and s.chosen == pytest.approx(1.1) and s.at_edge == "high"
    assert s.to_json()["curve"][-1][0] == pytest.approx(1.1)
    one = search_rate("sve", [1e-2], lambda lr: 1.0)
    assert one.chosen == 1e-2 and one.at_edge is None and one.extensions == 0


# --------------------------------------------------------------------------- deep-ensemble starts


def test_deep_members_start_apart_by_noisytune_noise_seeded_per_member() -> None:
    model = tiny_llama(seed=0, layers=4).requires_grad_(False)
    top = Top(model, make_tokenizer(), 2)
    pretrained = {n: p.detach().clone() for n, p in torch.nn.ModuleList(top.frozen_blocks()).named_parameters()}
    lam = 0.2
    plain, noisy, alone = DeepMethod(2, 1e-3), DeepMethod(2, 1e-3, perturb=lam), DeepMethod(1, 1e-3, perturb=lam)
    for m in (plain, noisy, alone):
        m.build(top)
    for copy in plain.copies:  # λ = 0: every member is the pretrained blocks
        for n, p in copy.named_parameters():
            assert torch.equal(p, pretrained[n])
    starts = [dict(c.named_parameters()) for c in noisy.copies]
    for n, w in pretrained.items():
        if w.numel() < 64:
            continue
        bound = lam / 2 * float(w.double().std())
        d0, d1 = starts[0][n].detach() - w, starts[1][n].detach() - w
        assert float(d0.abs().max()) <= bound * (1 + 1e-5) and float(d0.abs().max()) > 0.5 * bound
        assert float(d0.std()) == pytest.approx(lam * float(w.double().std()) / 12**0.5, rel=0.25)  # uniform
        assert not torch.allclose(d0, d1)  # each member its own seed
        assert torch.equal(dict(alone.copies[0].named_parameters())[n], starts[0][n])  # member 0 = the M=1 model
    assert noisy.settings()["perturb"] == lam


# --------------------------------------------------------------------------- whole runs


def _quick(tmp_path: Path, *extra: str) -> dict:
    import ensembles

    assert ensembles.main(["--quick", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra]) == 0
    return json.loads((tmp_path / "out" / "results.json").read_text())


@pytest.mark.bench  # the harness end to end (make test-bench): keeps make test under 10 min
def test_quick_run_tunes_every_family_alike_and_reports_equal_members(tmp_path: Path) -> None:
    res = _quick(tmp_path, "--sve-parametrisation", "relative")["tiny:synthetic"]
    f = res["facts"]
    assert [s["family"].split("-")[0] for s in f["rate_search"]] == ["sve", "lora", "deep"]
    for s in f["rate_search"]:
        rates = [lr for lr, _ in s["curve"]]
        assert len(rates) >= 3 and s["chosen"] in rates
        best = min(s["curve"], key=lambda c: c[1])[0]
        assert s["chosen"] == best
        assert (s["at_edge"] is not None) == (best in (rates[0], rates[-1]))
        assert s["extensions"] == len(rates) - len(s["initial"])
        family = s["family"].split("-")[0]
        assert f["chosen_lr"][family] == s["chosen"]
    assert f["equal_m"] == [2, 4] and f["deep_perturb"] == 0.15
    rows = {r["name"]: r for r in res["methods"]}
    for family in ("SVE", "LoRA-Ensemble", "deep ensemble"):
        two, four = rows[f"{family} M=2"], rows[f"{family} M=4"]
        assert two["train_loss"]["first"] == four["train_loss"]["first"][:2]  # M=2 is the first two of M=4
        assert two["stored"] * 2 == four["stored"]
    assert rows["deep ensemble M=4"]["settings"]["perturb"] == 0.15
    for m in (2, 4):
        for other in ("LoRA-Ensemble", "deep ensemble"):
            assert f"SVE M={m} - {other} M={m}: ece" in res["paired"]
    vs = res["paired_vs_best"]
    assert vs["reference"] in ("LoRA-Ensemble M=4", "deep ensemble M=4")
    assert vs["reference"] not in [n for n, _ in vs["rows"]] and len(vs["rows"]) >= 8
    page = (tmp_path / "out" / "README.md").read_text()
    assert "learning rate on dev" in page and "tiny-synthetic-dev-curves.png" in page
    assert "fewer than 3 rates" not in page and "not selected**" not in page
    one = _quick(tmp_path, "--sve-parametrisation", "relative", "--lr-lora", "3e-3", "--lr-deep", "1e-3,3e-3")
    page = (tmp_path / "out" / "README.md").read_text()
    assert "| lora (**one rate given: not selected**)" in page and "deep-np0.15 (**a grid of 2" in page
    assert one["tiny:synthetic"]["facts"]["chosen_lr"]["lora"] == 3e-3
    for png in ("paired", "dev-curves", "tradeoff", "reliability"):
        assert (tmp_path / "out" / f"tiny-synthetic-{png}.png").stat().st_size > 0


@pytest.mark.bench  # the harness end to end (make test-bench): keeps make test under 10 min
def test_sve_rate_transfers_unchanged_and_the_cells_own_best_is_shown(tmp_path: Path) -> None:
    import ensembles

    results = _quick(tmp_path, "--sve-parametrisation", "relative")
    source = json.loads(json.dumps(results["tiny:synthetic"]))
    source["facts"]["chosen_lr"]["sve"] = 0.02  # a rate none of the cell's own grid holds
    (tmp_path / "out" / "results.json").write_text(json.dumps({**results, "src:cell": source}))
    with pytest.raises(SystemExit, match="raw"):  # a relative rate is no raw one
        ensembles.main(["--quick", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                        "--sve-transfer-from", "src:cell"])
    res = _quick(tmp_path, "--sve-parametrisation", "relative", "--sve-transfer-from", "src:cell")["tiny:synthetic"]
    f, t = res["facts"], res["facts"]["sve_transfer"]
    assert f["chosen_lr"]["sve"] == 0.02 and t["lr"] == 0.02 and t["from"] == "src:cell"
    sve_search = next(s for s in f["rate_search"] if s["family"].startswith("sve"))
    own_curve = dict(map(tuple, sve_search["curve"]))
    assert t["own_best_lr"] == min((lr for lr in own_curve if lr != 0.02), key=own_curve.__getitem__)
    assert t["dev_nll"] == pytest.approx(own_curve[0.02])  # the transferred rate's own one-member dev fit
    for name in ("SVE M=4", "SVE M=2", "fine-tuned (SVE M=1)"):
        assert next(r for r in res["methods"] if r["name"] == name)["settings"]["lr"] == 0.02
    page = (tmp_path / "out" / "README.md").read_text()
    assert "transferred unchanged from src:cell" in page
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (tmp_path / "out" / "results.json").write_text(json.dumps({**results, "other:cell": res}))
    with pytest.raises(SystemExit, match="itself transferred"):  # a transferred cell is no source
        ensembles.main(["--quick", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                        "--sve-parametrisation", "relative", "--sve-transfer-from", "other:cell"])
    # the source cell itself, first of a run of several, chooses its own rate
    own = _quick(tmp_path, "--sve-parametrisation", "relative", "--sve-transfer-from", "tiny:synthetic")
    assert "sve_transfer" not in own["tiny:synthetic"]["facts"]
    assert own["tiny:synthetic"]["facts"]["chosen_lr"]["sve"] == t["own_best_lr"]


def test_print_sve_choice_gives_the_source_cells_rate_and_spread_for_its_parametrisation(tmp_path, capsys) -> None:
    """What `make sve-scale` trains the 1.5B's SVE at: the rate and initial spread one finished cell
    chose, refused for another parametrisation or a cell whose rate was itself transferred."""
    import ensembles

    facts = {"chosen_lr": {"sve": 0.005, "lora": 3e-4}, "sigma_init": 0.02,
             "sve_parametrisation": {"parametrisation": "relative", "bias": "scaled"}}
    moved = {**facts, "sve_transfer": {"from": "src:cell"}}
    (tmp_path / "results.json").write_text(json.dumps({"src:cell": {"facts": facts}, "dst:cell": {"facts": moved}}))
    args = ["--out", str(tmp_path), "--sve-parametrisation", "relative", "--print-sve-choice"]
    assert ensembles.main([*args, "src:cell"]) == 0
    assert capsys.readouterr().out.split() == ["0.005", "0.02", "relative", "scaled"]
    with pytest.raises(SystemExit, match="raw"):
        ensembles.main(["--out", str(tmp_path), "--print-sve-choice", "src:cell"])
    with pytest.raises(SystemExit, match="itself transferred"):
        ensembles.main([*args, "dst:cell"])
    with pytest.raises(SystemExit, match="no finished run"):
        ensembles.main([*args, "smollm2:arc"])


@pytest.mark.bench  # the harness end to end (make test-bench): keeps make test under 10 min
def test_a_page_from_before_issue_33_renders_again(tmp_path: Path) -> None:
    """``--render`` of results written before rate searches, equal members and paired-vs-best."""
    import ensembles

    res = _quick(tmp_path)["tiny:synthetic"]
    for key in ("rate_search", "equal_m", "deep_perturb"):
        res["facts"].pop(key)
    res.pop("paired_vs_best")
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.json").write_text(json.dumps({"tiny:synthetic": res}))
    assert ensembles.main(["--render", "--out", str(old)]) == 0
    page = (old / "README.md").read_text()
    assert "Paired bootstrap" in page and "dev-curves" not in page and not (old / "tiny-synthetic-paired.png").exists()


def test_an_unprovisioned_qwen_cell_is_skipped_with_how_to_provision_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import ensembles

    from guarduq.aliases import ALIASES
    from guarduq.errors import ModelNotFoundError

    assert {ensembles.MODELS["qwen05"], ensembles.MODELS["qwen15"]} <= set(ALIASES)
    asked = []

    def missing(name: str) -> Path:
        asked.append(name)
        raise ModelNotFoundError(f"model '{name}' is not provisioned; provision it with: {ALIASES[name].provision}")

    monkeypatch.setattr(ensembles, "resolve_alias", missing)
    monkeypatch.setattr(ensembles, "run_cell", lambda *a: pytest.fail("a skipped cell must not run"))
    assert ensembles.main(["--cells", "qwen05:arc,qwen15:arc", "--out", str(tmp_path), "--work", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert asked == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    assert "skipping qwen05:arc" in err and "make model-qwen-0.5b" in err and "make model-qwen-1.5b" in err


# --------------------------------------------------------------------------- figures


def _overlaps(fig: object) -> list[tuple[str, str]]:
    """Pairs of drawn, non-empty texts of ``fig`` whose boxes intersect (a tick's label counts only
    where its tick lies inside the axis's view: matplotlib keeps labels of ticks it does not draw)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    undrawn = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for ticks, locs in ((axis.get_major_ticks(), axis.get_majorticklocs()),
                                (axis.get_minor_ticks(), axis.get_minorticklocs())):
                for tick, loc in zip(ticks, locs, strict=False):
                    if not lo * (1 - 1e-9) <= loc <= hi * (1 + 1e-9):
                        undrawn |= {id(tick.label1), id(tick.label2)}
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in undrawn]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for (a, ba), (b, bb) in combinations(boxes, 2) if ba.overlaps(bb)]


def _rows() -> list[dict]:
    """A real cell's crowd: SVE M=4/8/16 and LoRA M=1 / LoRA-Ensemble almost on top of each other."""
    names = [("base", 0, 0.45, 0.05), ("fine-tuned (SVE M=1)", 16896, 0.50, 0.07), ("SVE M=4", 67584, 0.52, 0.066),
             ("SVE M=8", 135168, 0.521, 0.065), ("SVE M=16", 270336, 0.522, 0.065), ("LoRA (M=1)", 1.6e6, 0.46, 0.046),
             ("LoRA-Ensemble M=4", 6.5e6, 0.461, 0.046), ("LoRA-Ensemble M=8", 1.3e7, 0.462, 0.045),
             ("full fine-tune (M=1)", 7e6, 0.45, 0.04), ("deep ensemble M=4", 2.8e7, 0.453, 0.039),
             ("deep ensemble M=8", 5.6e7, 0.454, 0.039), ("SVE M=8, lr 0.01", 135168, 0.51, 0.06)]
    return [{"name": n, "stored": s, "accuracy": [a, a - 0.02, a + 0.02], "ece": [e, e - 0.01, e + 0.01]}
            for n, s, a, e in names]


def test_tradeoff_and_paired_figures_have_no_colliding_texts() -> None:
    from _ensemble_plots import paired_figure, tradeoff_figure

    rows = _rows()
    fig = tradeoff_figure(rows, "cell: accuracy and ECE against stored parameters")
    assert _overlaps(fig) == []
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == sorted(r["name"] for r in rows)
    diffs = [(r["name"], {"ece": [0.01, -0.01, 0.03], "accuracy": [0.0, -0.02, 0.02]}) for r in rows[:-1]]
    assert _overlaps(paired_figure(diffs, rows[-1]["name"], "cell: paired")) == []


def test_reliability_counts_are_legible_and_apart() -> None:
    from _ensemble_plots import reliability_figure

    from guarduq.calibration import reliability_bins

    rng = np.random.default_rng(0)
    conf = rng.uniform(0.25, 1.0, 2376)
    bins = reliability_bins(conf, (rng.random(2376) < conf).astype(float))
    fig = reliability_figure([(f"method {i}", bins, 0.05) for i in range(5)], "cell: test reliability")
    assert _overlaps(fig) == []
    counts = [t for ax in fig.axes for t in ax.texts]
    assert len(counts) == 5 * len(bins) and min(t.get_fontsize() for t in counts) >= 7
    assert {t.get_text() for t in counts[: len(bins)]} == {f"{b['count'] / 1000:.1f}k" if b["count"] >= 1000
                                                            else str(b["count"]) for b in bins}
