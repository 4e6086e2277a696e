"""The scale-free SVE (#33): Σᵐ = Σ ⊙ exp(δᵐ), biases b₀ + s·βᵐ, and the raw one still loadable."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from guarduq.errors import ArtifactError, SVEError
from guarduq.sve import SVELinear, SVEnsemble
from tests.conftest import make_tokenizer as tiny_tokenizer
from tests.conftest import tiny_llama
from tests.unit.test_sve import (
    CLASS_DATA,
    MAKERS,
    arch,
    ids,
    materialised_member,
    model_dir,
    rel_err,
    tiny_gpt2,
    tiny_llama64,
)

__all__ = ["arch", "model_dir"]  # fixtures, imported for pytest

DATA = Path(__file__).resolve().parents[1] / "data"
FIT = {"label_words": ["positive", "negative"], "batch_size": 2, "progress": False}


def test_relative_spectrum_is_positive_for_any_delta():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(6, generator=g, dtype=torch.float64) + 0.1
    layer = SVELinear(torch.eye(6, dtype=torch.float64), s, torch.eye(6, dtype=torch.float64), None,
                      members=3, sigma_init=0.1, generator=g)
    with torch.no_grad():
        layer.delta.copy_(torch.randn(3, 6, generator=g, dtype=torch.float64) * 30)
    assert bool((layer.spectrum() > 0).all())
    torch.testing.assert_close(layer.spectrum(), s * torch.exp(layer.delta))


def test_relative_init_keeps_sigma_init_as_the_relative_spread():
    """δ ~ N(0, σ_init²): the members' log-spectra spread by σ_init, as the raw (1 + ε) did to first order."""
    g = torch.Generator().manual_seed(1)
    s = torch.full((4000,), 3.0, dtype=torch.float64)
    layer = SVELinear(torch.zeros(2, 4000, dtype=torch.float64), s, torch.zeros(2, 4000, dtype=torch.float64),
                      None, members=2, sigma_init=0.05, generator=g)
    ratio = (layer.spectrum().detach() / s).log()
    assert abs(float(ratio.std()) - 0.05) < 0.005 and abs(float(ratio.mean())) < 0.005


@pytest.mark.parametrize("bias", ["scaled", "none"])
def test_zero_delta_and_beta_reproduce_the_base_model(arch, bias):
    base = MAKERS[arch]()
    ens = SVEnsemble.from_model(base, members=3, sigma_init=0.0, bias=bias)
    x = ids()
    with torch.no_grad():
        expected = base(input_ids=x).logits
    got = ens.member_logits(x)
    for m in range(3):
        assert rel_err(got[m], expected) <= 1e-5


def test_scaled_bias_is_on_the_layers_output_scale(arch):
    """s = ‖W‖_F/√out, and b = b₀ + s·β: a unit β moves every output by one output RMS."""
    base = MAKERS[arch]()
    ens = SVEnsemble.from_model(base, members=2, sigma_init=0.1)
    for name, layer in ens.layers.items():
        w = base.get_submodule(name).weight.detach().double()
        expected = float(w.norm() / layer.out_features**0.5)
        assert float(layer.bias_scale) == pytest.approx(expected, rel=1e-5)
        b0 = base.get_submodule(name).bias
        b0 = torch.zeros(layer.out_features) if b0 is None else b0.detach()
        with torch.no_grad():
            layer.beta.fill_(1.0)
        torch.testing.assert_close(layer.member_bias(), (b0 + expected).expand(2, -1), rtol=1e-5, atol=1e-6)


def _scaled_copy(base: torch.nn.Module, c: float) -> torch.nn.Module:
    """W_q ← c·W_q, W_k ← W_k/c in block 0: the same function (q·k is unchanged), other scales."""
    other = copy.deepcopy(base)
    attn = other.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(c)
        attn.k_proj.weight.div_(c)
    return other


def _fit_pair(parametrisation: str, bias: str, tmp_path: Path, c: float) -> tuple[SVEnsemble, SVEnsemble]:
    base = tiny_llama64()
    other = _scaled_copy(base, c)
    x = ids()
    with torch.no_grad():  # the premise: the two models compute the same function
        assert rel_err(other(input_ids=x).logits, base(input_ids=x).logits) < 1e-12
    kw = {"members": 2, "sigma_init": 0.1, "seed": 5, "parametrisation": parametrisation, "bias": bias}
    fits = []
    for i, model in enumerate((base, other)):
        ens = SVEnsemble.from_model(model, tiny_tokenizer(), cache_dir=tmp_path / str(i), **kw)
        fits.append(ens.fit(CLASS_DATA, steps=6, lr=0.05, **FIT))
    return fits[0], fits[1]


def _relative_change(ens: SVEnsemble, name: str) -> torch.Tensor:
    layer = ens.layers[name]
    return layer.spectrum().detach() / layer.S


def test_one_relative_rate_trains_a_rescaled_layer_identically(tmp_path):
    """The scale-free property: with q_proj ×8 and k_proj ÷8 (a power of two, so SVE's float32 SVD cache rounds both alike), δ and β follow the same trajectory
    (the raw parametrisation's relative changes of Σ do not: its step is in Σ's units)."""
    a, b = _fit_pair("relative", "scaled", tmp_path / "rel", 8.0)
    assert a.history_ == pytest.approx(b.history_, rel=1e-9)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-7, atol=1e-9)
    q = "model.layers.0.self_attn.q_proj"
    init = SVEnsemble.from_model(tiny_llama64(), members=2, sigma_init=0.1, seed=5, cache_dir=tmp_path / "init")
    assert float((a.layers[q].delta - init.layers[q].delta).detach().abs().max()) > 1e-2  # training moved δ

    ra, rb = _fit_pair("raw", "raw", tmp_path / "raw", 8.0)
    gap = (_relative_change(ra, q) - _relative_change(rb, q)).abs().max()
    assert float(gap) > 1e-2


def test_no_bias_variant_trains_no_bias(arch):
    base = MAKERS[arch]()
    ens = SVEnsemble.from_model(base, tiny_tokenizer(), members=2, sigma_init=0.1, bias="none")
    assert all(p is layer.delta for layer, p in zip(ens.layers.values(), ens.parameters(), strict=True))
    assert ens.overhead().per_member_params == sum(layer.S.numel() for layer in ens.layers.values())
    ens.fit(CLASS_DATA, steps=3, lr=0.05, **FIT)
    for name, layer in ens.layers.items():  # the base bias (GPT-2 has them) is kept as it was
        b0 = base.get_submodule(name).bias
        got = layer.member_bias()
        assert (got is None) == (b0 is None)
        if b0 is not None:
            torch.testing.assert_close(got[0], b0.detach(), rtol=0, atol=0)
    x = ids()
    for m in range(2):
        with torch.no_grad():
            expected = materialised_member(ens, base, m)(input_ids=x).logits
        assert rel_err(ens.member_logits(x)[m], expected) <= 1e-5


def test_new_members_are_scale_free_and_record_it(tmp_path):
    ens = SVEnsemble.from_model(tiny_llama(), members=2)
    assert (ens.parametrisation, ens.bias_mode) == ("relative", "scaled")
    path = ens.save(tmp_path / "sve.safetensors")
    loaded = SVEnsemble.load(path, tiny_llama())
    assert (loaded.parametrisation, loaded.bias_mode) == ("relative", "scaled")
    raw = SVEnsemble.from_model(tiny_llama(), members=2, parametrisation="raw", bias="raw")
    with pytest.raises(ArtifactError, match="relative/scaled members"):
        raw._check_compatible(json.loads(json.dumps(_meta(path))), path)
    with pytest.raises(SVEError, match="parametrisation must be one of"):
        SVEnsemble.from_model(tiny_llama(), members=2, parametrisation="log")
    with pytest.raises(SVEError, match="bias must be one of"):
        SVEnsemble.from_model(tiny_llama(), members=2, bias="zero")


def _meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata())


def test_old_artifact_loads_and_predicts_as_the_old_code_did(tmp_path):
    """tests/data/sve-v1-tiny-gpt2*.safetensors were written by the pre-#33 code (d0a0dca): a
    format-1 file of 2 members trained 3 steps on a tiny GPT-2 (random biases), the model's weights
    and those members' logits. The current code must give the same logits."""
    ref = load_file(str(DATA / "sve-v1-tiny-gpt2-reference.safetensors"))
    base = tiny_gpt2()
    state = {k.removeprefix("model."): v for k, v in ref.items() if k.startswith("model.")}
    missing, unexpected = base.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith((".attn.bias", "lm_head.weight", "masked_bias")) for k in missing)
    path = DATA / "sve-v1-tiny-gpt2.safetensors"
    assert _meta(path)["format_version"] == "1" and "parametrisation" not in _meta(path)
    ens = SVEnsemble.load(path, base, tiny_tokenizer(), cache_dir=tmp_path)
    assert (ens.parametrisation, ens.bias_mode) == ("raw", "raw")
    torch.testing.assert_close(ens.member_logits(ref["input_ids"]), ref["member_logits"], rtol=1e-5, atol=1e-5)

    resaved = ens.save(tmp_path / "again.safetensors")  # a raw ensemble saves and reloads as raw
    again = SVEnsemble.load(resaved, base, tiny_tokenizer(), cache_dir=tmp_path)
    torch.testing.assert_close(again.member_logits(ref["input_ids"]), ref["member_logits"], rtol=1e-5, atol=1e-5)


def test_old_artifact_without_its_tensors_is_refused(tmp_path):
    base = tiny_llama()
    ens = SVEnsemble.from_model(base, members=2, parametrisation="raw", bias="raw")
    path = ens.save(tmp_path / "raw.safetensors")
    meta = {k: v for k, v in _meta(path).items() if k not in ("parametrisation", "bias")}
    meta["format_version"] = "1"
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.endswith(".bias")}
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata=meta)
    with pytest.raises(ArtifactError, match="bias is missing"):
        SVEnsemble.load(tmp_path / "v1.safetensors", base)


def test_cli_trains_the_chosen_parametrisation(model_dir, tmp_path, capsys):
    from guarduq.cli import main
    from guarduq.models import load_model

    tsv = tmp_path / "sst2.tsv"
    tsv.write_text("sentence\tlabel\na good film \t1\na dull plot \t0\nfun \t1\nawful \t0\n")
    out = tmp_path / "members.safetensors"
    argv = ["sve", "train", "--model", model_dir, "--dataset", "sst2", "--data", str(tsv), "--members", "2",
            "--steps", "2", "--batch-size", "2", "--last-n-blocks", "1", "--out", str(out)]
    assert main([*argv, "--parametrisation", "raw", "--bias", "none"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["parametrisation"], summary["bias"]) == ("raw", "none") and summary["first_loss"] > 0
    ens = SVEnsemble.load(out, load_model(model_dir))
    assert (ens.parametrisation, ens.bias_mode) == ("raw", "none")
    assert main(argv) == 0  # the default: scale-free
    assert (SVEnsemble.load(out, load_model(model_dir)).parametrisation) == "relative"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--parametrisation", "log"])
