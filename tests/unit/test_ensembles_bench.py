"""benchmarks/ensembles.py: the cached frozen-block path equals the full model, members stay
independent, and the --quick run produces every method's row and resumes to the same result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _ensemble_methods import (  # noqa: E402
    FAMILIES,
    Example,
    SVEMethod,
    Top,
    encode_split,
)

from guarduq.sve import LLAMA_TARGETS  # noqa: E402
from tests.conftest import make_tokenizer, tiny_llama, tiny_qwen2  # noqa: E402


def tiny_gemma3() -> torch.nn.Module:
    """Gemma-3's text model, tiny: scaled embeddings, q/k norms, sliding and global layers.

    The packed mask is passed as is, so a sliding window shorter than a sequence would not
    apply: the harness refuses such sequences (Gemma-3-270m's window is 512; its prompts are
    far shorter), and the window here is longer than any test sequence."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.conftest import VOCAB

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return Gemma3ForCausalLM(cfg).eval()


# Fits compared after training run in float64: Adam divides each gradient by its own running
# norm, so on a near-zero gradient float32 rounding becomes a step of about lr, and two equal
# fits differ by ~1e-4 depending on the CPU's kernels; in float64 they differ by ~1e-13.
FIT_REL = 1e-9

MODELS = {"llama": lambda: tiny_llama(seed=0, layers=4), "gemma3": tiny_gemma3, "qwen2": tiny_qwen2}


def examples(n: int = 6) -> list[Example]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        k = 3 + i % 2  # three- and four-option items: the padding option is masked
        options = tuple(f"option {j}" + " more" * int(rng.integers(0, 3)) for j in range(k))
        out.append(Example(f"question {i}?", options, int(rng.integers(0, k))))
    return out


WIDTH = 4


@pytest.fixture(params=sorted(MODELS))
def top(request: pytest.FixtureRequest) -> Top:
    model = MODELS[request.param]().requires_grad_(False)
    return Top(model, make_tokenizer(), 2)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a))
    a, b = a.detach(), b.detach()
    scale = float(b[finite].abs().max())
    assert float((a[finite] - b[finite]).abs().max()) <= 1e-5 * scale + 1e-6


def test_base_scores_are_the_models_own_option_log_probabilities(top: Top) -> None:
    """Independent of the harness: each option's mean token log-probability from model(...).logits."""
    from guarduq import layout

    exs = examples()
    enc = encode_split(top, exs, WIDTH)
    for i, ex in enumerate(exs):
        prompt = layout.prompt_ids(top.tok, ex.prompt)
        for j, option in enumerate(ex.options):
            ids = torch.tensor([prompt + layout.response_ids(top.tok, option, ended=True)])
            logp = torch.log_softmax(top.model(input_ids=ids).logits[0].float(), -1)
            targets = ids[0, len(prompt):]
            expected = logp[len(prompt) - 1 : -1].gather(-1, targets.unsqueeze(-1)).mean()
            assert float(enc.base_logits[i, j]) == pytest.approx(float(expected), abs=1e-5)
        assert torch.isinf(enc.base_logits[i, ex.n_options :]).all()


@pytest.mark.parametrize("family", ["sve", "lora", "deep"])
def test_cached_path_equals_full_forward(top: Top, family: str) -> None:
    """Every member's logits from the cached states equal a plain forward with its blocks swapped in."""
    enc = encode_split(top, examples(), WIDTH)
    members = 3 if family == "sve" else 2
    method = SVEMethod(members, 1e-2, sigma_init=0.1) if family == "sve" else FAMILIES[family](members, 1e-2)
    method.build(top)
    method.fit(top, enc, steps=2, batch=2, progress=False)  # members now differ from the base
    rows = list(range(len(enc)))
    cached = method.member_logits(top, enc, rows)
    if family == "sve":  # members are folded member-major into one batch
        full = top.full_logits(enc, rows * members, member=method.blocks).reshape(members, len(enc), -1)
    else:
        full = torch.stack([top.full_logits(enc, rows, member=c) for c in method.copies])
    _close(cached, full)
    assert float((cached[0] - cached[1]).detach().nan_to_num(0, 0, 0).abs().max()) > 1e-4  # members differ


def test_cached_gradient_equals_full(top: Top) -> None:
    enc = encode_split(top, examples(), WIDTH)
    method = SVEMethod(2, 1e-2, sigma_init=0.1)
    method.build(top)
    labels = torch.as_tensor(enc.labels)
    grads = []
    for cached in (True, False):
        for p in method.parameters():
            p.grad = None
        rows = list(range(len(enc)))
        if cached:
            logits = top.logits(enc, rows * 2, method.blocks)
        else:
            logits = top.full_logits(enc, rows * 2, member=method.blocks)
        torch.nn.functional.cross_entropy(logits, labels.repeat(2)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in method.parameters()]))
    _close(grads[0], grads[1])


def test_sve_members_never_share_a_gradient() -> None:
    """Member 0 of a jointly trained M=2 ensemble = the same member trained alone (σ_init 0).

    This is what makes the first M members of one run a valid M-member ensemble."""
    model = tiny_llama(seed=0, layers=4).double().requires_grad_(False)  # see FIT_REL
    top = Top(model, make_tokenizer(), 2)
    enc = encode_split(top, examples(8), WIDTH)
    alone, joint = SVEMethod(1, 3e-2, sigma_init=0.0), SVEMethod(2, 3e-2, sigma_init=0.0)
    for m in (alone, joint):
        m.build(top)
        m.fit(top, enc, steps=4, batch=3, max_grad_norm=0.05, progress=False)  # clipping active
    for a, b in zip(alone.parameters(), joint.parameters(), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(b[0], a[0], rtol=FIT_REL, atol=FIT_REL)
    assert any(not torch.allclose(p[0], p[1]) for p in joint.parameters())  # member 1: its own order


@pytest.mark.parametrize("family", ["lora", "deep"])
def test_copies_member_zero_is_the_one_member_model(family: str) -> None:
    """What lets a one-rate run report LoRA/deep M=1 as member 0 of the ensemble (``first_member``)."""
    import ensembles

    model = tiny_llama(seed=0, layers=4).double().requires_grad_(False)  # see FIT_REL
    top = Top(model, make_tokenizer(), 2)
    enc = encode_split(top, examples(8), WIDTH)
    alone, joint = FAMILIES[family](1, 1e-3), FAMILIES[family](2, 1e-3)
    for m in (alone, joint):
        m.build(top)
        m.fit(top, enc, steps=3, batch=3, max_grad_norm=0.05, progress=False)
    pa, pj = alone.predict(top, enc), joint.predict(top, enc)
    # predict() rounds its float64 logits to float32: fits equal to ~1e-13 agree to float32's ulp
    np.testing.assert_allclose(pj[0], pa[0], rtol=4 * np.finfo(np.float32).eps, atol=1e-7)
    assert not np.allclose(pj[0], pj[1])  # member 1 is another model
    arrays, info = ensembles.first_member({"test": pj}, {"stored": 10, "fit": {"seconds": 4.0},
                                                         "seconds_per_item": {"test": 2.0}})
    assert arrays["test"].shape[0] == 1 and info["stored"] == 5 and info["fit"]["seconds"] == 2.0


@pytest.mark.bench  # the harness end to end (make test-bench): keeps make test under 10 min
def test_quick_run_reports_every_method_and_resumes(tmp_path: Path) -> None:
    import ensembles

    args = ["--quick", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    assert ensembles.main(args) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())["tiny:synthetic"]
    names = [r["name"] for r in res["methods"]]
    for expected in ("base", "base + TS", "fine-tuned (SVE M=1)", "SVE M=4", "LoRA-Ensemble M=2",
                     "deep ensemble M=2", "LoRA (M=1)", "full fine-tune (M=1)"):
        assert expected in names
    for family in ("SVE", "LoRA-Ensemble", "deep ensemble"):  # equal members: M=2 and M=4 of every family
        assert {f"{family} M=2", f"{family} M=4"} <= set(names)
    rows = {r["name"]: r for r in res["methods"]}
    per_member = {n: rows[n]["trainable_per_member"] for n in ("SVE M=4", "LoRA-Ensemble M=2", "deep ensemble M=2")}
    assert per_member["SVE M=4"] < per_member["LoRA-Ensemble M=2"] < per_member["deep ensemble M=2"]
    for r in res["methods"]:
        assert 0.0 <= r["accuracy"][0] <= 1.0 and r["accuracy"][1] <= r["accuracy"][0] <= r["accuracy"][2]
        assert r["nll"][0] > 0 and r["ece_floor"][0] > 0
    import statistics

    expected_median = statistics.median(  # every singular value of the targeted matrices of the trained blocks
        float(v) for block in list(tiny_llama(seed=0, layers=4).model.layers)[-2:]
        for name, m in block.named_modules() if name.rpartition(".")[2] in LLAMA_TARGETS
        for v in torch.linalg.svdvals(m.weight.detach().float()))
    assert res["facts"]["median_singular_value"] == pytest.approx(expected_median, rel=1e-5)
    assert (tmp_path / "out" / "tiny-synthetic-reliability.png").stat().st_size > 0
    page = (tmp_path / "out" / "README.md").read_text()
    assert "SVE M=4" in page and "Paired bootstrap" in page
    # a rerun reads every saved stage instead of training again, and reports the same numbers
    assert ensembles.main(args) == 0
    again = json.loads((tmp_path / "out" / "results.json").read_text())["tiny:synthetic"]
    assert again["methods"] == res["methods"]
    # a sensitivity fit with fewer members: its own row, paired with the chosen SVE and both baselines at its M
    assert ensembles.main([*args, "--sve-lr-also", "3e-2", "--sve-lr-also-members", "2"]) == 0
    also = json.loads((tmp_path / "out" / "results.json").read_text())["tiny:synthetic"]
    assert [r["members"] for r in also["methods"] if r["name"] == "SVE M=2, lr 0.03"] == [2]
    assert {"SVE M=2, lr 0.03 - LoRA-Ensemble M=2: ece", "SVE M=2, lr 0.03 - SVE M=2: nll"} <= set(also["paired"])
    # a rate check (--select-only) lands beside the cell's results, which it leaves as they were
    assert ensembles.main([*args, "--select-only", "--lr-sve", "1e-2,3e-2", "--max-extensions", "0"]) == 0
    checked = json.loads((tmp_path / "out" / "results.json").read_text())["tiny:synthetic"]
    assert checked["methods"] == also["methods"]
    assert sorted(s["lr"] for s in checked["selection_only"] if s["family"] == "sve") == [1e-2, 3e-2]
    assert "--select-only" in (tmp_path / "out" / "README.md").read_text()



@pytest.mark.bench  # the harness end to end (make test-bench): keeps make test under 10 min
def test_quick_run_reports_each_members_losses_and_the_sve_parametrisation(tmp_path: Path) -> None:
    """Every method's row carries each member's first and last training loss (from its own per-step
    losses); --sve-parametrisation relative trains scale-free members under their own stage keys."""
    import ensembles

    args = ["--quick", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    assert ensembles.main(args) == 0
    raw = json.loads((tmp_path / "out" / "results.json").read_text())["tiny:synthetic"]
    assert raw["facts"]["sve_parametrisation"] == {"parametrisation": "raw", "bias": "raw"}
    saved = sorted(p.name for p in (tmp_path / "work" / "tiny-synthetic").glob("*sve*.json"))
    assert saved and not any("relative" in n for n in saved)  # raw stages keep their old keys
    for r in raw["methods"]:
        if r["name"].startswith("base"):
            continue
        ends = r["train_loss"]
        assert len(ends["first"]) == len(ends["last"]) == r["members"]
        if not {"from", "first_of"} & set(r["settings"]):  # a whole run: its mean loss is its members'
            first_step = np.asarray(r["history"][: ends["window"]]).mean()
            assert np.mean(ends["first"]) == pytest.approx(first_step, rel=1e-6)
    page = (tmp_path / "out" / "README.md").read_text()
    assert "Training loss of each member" in page and "fall)" in page

    assert ensembles.main([*args, "--sve-parametrisation", "relative"]) == 0
    rel = json.loads((tmp_path / "out" / "results.json").read_text())["tiny:synthetic"]
    assert rel["facts"]["sve_parametrisation"] == {"parametrisation": "relative", "bias": "scaled"}
    sve_rows = [r for r in rel["methods"] if r["name"].startswith(("SVE", "fine-tuned (SVE"))]
    assert sve_rows and all(r["settings"]["parametrisation"] == "relative" for r in sve_rows)
    assert any("relative-scaled" in p.name for p in (tmp_path / "work" / "tiny-synthetic").glob("*sve*.json"))
    lora = {r["name"]: r["nll"] for r in raw["methods"] if r["name"].startswith("LoRA")}
    assert lora == {r["name"]: r["nll"] for r in rel["methods"] if r["name"].startswith("LoRA")}  # reused
    sve4 = [next(r["nll"] for r in res["methods"] if r["name"] == "SVE M=4") for res in (raw, rel)]
    assert sve4[0] != sve4[1]
    assert ensembles.main([*args, "--sve-parametrisation", "relative", "--sve-bias", "none"]) == 0
    nobias = json.loads((tmp_path / "out" / "results.json").read_text())["tiny:synthetic"]
    rows = {r["name"]: r for r in nobias["methods"]}
    assert rows["SVE M=4"]["trainable_per_member"] < {r["name"]: r for r in rel["methods"]}["SVE M=4"][
        "trainable_per_member"]


def test_vectorised_metrics_match_the_librarys() -> None:
    """The bootstrap's row-wise ECE and AUROC equal guarduq's own one-at-a-time metrics."""
    from _ensemble_metrics import _ece_rows, evaluate

    from guarduq.calibration import ece
    from guarduq.calibration.metrics import auroc

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(300, 4)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = rng.integers(0, 4, 300)
    conf, correct = probs.max(1), (probs.argmax(1) == labels).astype(float)
    assert _ece_rows(conf[None], correct[None])[0] == pytest.approx(ece(conf, correct), abs=1e-12)
    res = evaluate(probs, labels)
    entropy = -(probs * np.log(probs)).sum(1)
    assert res["auroc_entropy"][0] == pytest.approx(auroc(1 - correct, entropy), abs=1e-12)
    assert res["accuracy"][1] < correct.mean() < res["accuracy"][2]


def test_temperature_never_gives_mass_to_an_absent_option() -> None:
    from _ensemble_metrics import apply_temperature, fit_temperature

    probs = np.array([[0.7, 0.3, 0.0], [0.2, 0.5, 0.3], [0.6, 0.4, 0.0]])
    labels = np.array([1, 1, 0])
    t = fit_temperature(probs, labels)
    scaled = apply_temperature(probs, t)
    assert t > 1.0  # the first item is confidently wrong: the fit softens
    assert scaled[0, 2] == 0.0 and scaled[2, 2] == 0.0
    np.testing.assert_allclose(scaled.sum(1), 1.0)
    np.testing.assert_allclose(apply_temperature(probs, 1.0), probs, atol=1e-12)


def test_a_sequence_longer_than_the_sliding_window_is_refused() -> None:
    model = tiny_gemma3()
    model.config.sliding_window = 8
    top = Top(model.requires_grad_(False), make_tokenizer(), 2)
    with pytest.raises(ValueError, match="sliding window"):
        encode_split(top, examples(), WIDTH)
