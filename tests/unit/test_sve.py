"""Singular Value Ensemble on tiny random Llama and GPT-2 models (no downloads, seconds)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from guarduq import layout
from guarduq.answers import same_answer
from guarduq.errors import ArtifactError, CacheCorruptError, FingerprintMismatchError, SVEError
from guarduq.scoring.reuse import decoder_blocks
from guarduq.sve import SVELinear, SVEnsemble
from guarduq.sve.layers import _same_logits
from guarduq.sve.training import member_batch
from tests.conftest import make_tokenizer as tiny_tokenizer
from tests.conftest import tiny_gpt2 as conftest_gpt2
from tests.conftest import tiny_llama


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    model = conftest_gpt2(seed)
    with torch.no_grad():  # GPT-2 initialises biases to 0; random ones make the bias path count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


MAKERS = {"llama": tiny_llama, "gpt2": tiny_gpt2}

# Fits compared after training run in float64. Adam divides each gradient by its own running
# norm, so on a near-zero gradient it turns rounding noise into a step of about lr: in float32
# two mathematically equal fits then differ by ~1e-4 (how much depends on the CPU's kernels),
# in float64 by ~1e-13 on these tiny models.
FIT_REL = 1e-9


def tiny_llama64(layers: int = 2) -> nn.Module:
    return tiny_llama(layers=layers).double()


@pytest.fixture(params=sorted(MAKERS))
def arch(request) -> str:
    return request.param


def ids(batch: int = 3, length: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 200, (batch, length), generator=g)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def materialised_member(ens: SVEnsemble, base: nn.Module, m: int) -> nn.Module:
    """Member m as an ordinary model: W = U diag(Σᵐ) Vᵀ written into a copy of the base layers."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, layer in ens.layers.items():
            target = model.get_submodule(name)
            w = layer.U @ torch.diag(layer.spectrum()[m]) @ layer.V.T  # [out, in]
            target.weight.copy_(w.T if isinstance(target, Conv1D) else w)
            b = layer.member_bias()
            if b is None:
                continue
            b = b.expand(ens.members, -1)[m].clone()
            if target.bias is None:
                target.bias = nn.Parameter(b)
            else:
                target.bias.copy_(b)
    return model


# --------------------------------------------------------------------------- exactness


def test_sigma_init_zero_members_reproduce_base_logits(arch):
    base = MAKERS[arch]()
    ens = SVEnsemble.from_model(base, members=3, sigma_init=0.0)
    x = ids()
    with torch.no_grad():
        expected = base(input_ids=x).logits
    got = ens.member_logits(x)
    assert got.shape == (3, *expected.shape)
    for m in range(3):
        assert rel_err(got[m], expected) <= 1e-5


@pytest.mark.parametrize("last_n_blocks", [None, 1])
def test_batched_member_forward_equals_separate_forwards(arch, last_n_blocks):
    base = MAKERS[arch]()
    ens = SVEnsemble.from_model(base, members=3, sigma_init=0.3, seed=4, last_n_blocks=last_n_blocks)
    x = ids()
    got = ens.member_logits(x)
    for m in range(3):
        with torch.no_grad():
            separate = materialised_member(ens, base, m)(input_ids=x).logits
        assert rel_err(got[m], separate) <= 1e-5
    # the noise makes members really differ, so the comparison above is not trivially true
    assert rel_err(got[0], got[1]) > 1e-3


def test_prefix_before_the_first_sve_block_runs_once_per_row(arch):
    base = MAKERS[arch]()
    shared = SVEnsemble.from_model(base, members=3, sigma_init=0.3, last_n_blocks=1)
    folded = SVEnsemble.from_model(base, members=3, sigma_init=0.3, last_n_blocks=1, share_prefix=False)
    blocks = [m for n, m in shared.model.named_modules() if n.endswith(("layers.0", "layers.1", "h.0", "h.1"))]
    seen: list[int] = []
    for block in blocks:
        block.register_forward_hook(lambda mod, a, out: seen.append((out[0] if isinstance(out, tuple) else out).shape[0]))
    x = ids(batch=2)
    got = shared.member_logits(x)
    assert seen == [2, 6]  # block 0 once per row, block 1 (targeted) once per member and row
    torch.testing.assert_close(got, folded.member_logits(x), rtol=1e-5, atol=1e-6)


def test_right_padding_does_not_change_member_logits():
    base = tiny_llama()
    ens = SVEnsemble.from_model(base, members=2, sigma_init=0.2)
    x = ids(batch=1, length=5)
    padded = torch.cat([x, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1] * 5 + [0] * 3])
    short = ens.member_logits(x)
    long = ens.member_logits(padded, attention_mask=mask)[:, :, :5]
    assert rel_err(long, short) <= 1e-5


def test_layer_rejects_a_batch_that_is_not_folded():
    layer = SVELinear(
        torch.eye(4), torch.ones(4), torch.eye(4), None,
        members=3, sigma_init=0.0, generator=torch.Generator(),
    )
    with pytest.raises(SVEError, match="multiple of M=3"):
        layer(torch.randn(2, 5, 4))


# --------------------------------------------------------------------------- structure


def test_only_singular_values_and_biases_receive_gradients(arch):
    base = MAKERS[arch]()
    ens = SVEnsemble.from_model(base, members=2, sigma_init=0.1)
    trainable = {id(p) for p in ens.parameters()}
    # U and V are buffers, never parameters
    assert all(not isinstance(getattr(layer, n), nn.Parameter) for layer in ens.layers.values() for n in "UV")
    out = ens.model(input_ids=ids().repeat(2, 1)).logits
    out.square().mean().backward()
    with_grad = {id(p) for p in ens.model.parameters() if p.grad is not None}
    assert with_grad == trainable
    assert all(p.grad.abs().sum() > 0 for p in ens.parameters())


def test_targets_last_blocks_and_expected_layers():
    base = tiny_llama()
    ens = SVEnsemble.from_model(base, members=2, targets=["q_proj", "down_proj"], last_n_blocks=1)
    assert list(ens.layers) == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    assert isinstance(ens.model.get_submodule("model.layers.0.self_attn.q_proj"), nn.Linear)
    assert ens.overhead().targeted_blocks == 1


def test_gpt2_targets_fused_conv1d_layers():
    ens = SVEnsemble.from_model(tiny_gpt2(), members=2)
    kinds = {name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] for name in ens.layers}
    assert kinds == {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
    assert len(ens.layers) == 8


def test_original_model_untouched(arch):
    base = MAKERS[arch]()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    types_before = [type(m) for m in base.modules()]
    ens = SVEnsemble.from_model(base, tiny_tokenizer(), members=2, sigma_init=0.2)
    ens.fit([("the film is good", "positive")] * 4, steps=2, batch_size=2, lr=0.05, progress=False)
    after = base.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [type(m) for m in base.modules()] == types_before
    assert all(p.requires_grad for p in base.parameters())


def test_overhead_counts_match_the_layer_shapes():
    base = tiny_llama()
    ens = SVEnsemble.from_model(base, members=4)
    d, inter, kv = 32, 64, 2 * 8  # hidden, MLP width, key/value width (2 heads of 8)
    # per block: rank (min(in, out)) + out for q, k, v, o, gate, up, down
    per_block = (d + d) + (kv + kv) * 2 + (d + d) + (d + inter) * 2 + (d + d)
    o = ens.overhead()
    assert o.per_member_params == 2 * per_block
    assert o.member_params == 4 * o.per_member_params
    assert o.extra_params == 3 * o.per_member_params
    assert o.base_params == sum(p.numel() for p in base.parameters())
    assert o.ratio == pytest.approx(o.extra_params / o.base_params)
    assert o.formula == pytest.approx(5 * 3 / (4 * d))


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    base = tiny_llama()
    with pytest.raises(SVEError, match="members >= 2"):
        SVEnsemble.from_model(base, members=1)
    with pytest.raises(SVEError, match="unknown SVE target"):
        SVEnsemble.from_model(base, members=2, targets=["q_proj", "attention"])
    with pytest.raises(SVEError, match="no linear/Conv1D layers"):
        SVEnsemble.from_model(base, members=2, targets=["c_attn"])
    with pytest.raises(SVEError, match="no linear/Conv1D layers"):
        SVEnsemble.from_model(nn.Sequential(nn.Linear(3, 3)), members=2)
    with pytest.raises(SVEError, match="sigma_init"):
        SVEnsemble.from_model(base, members=2, sigma_init=-1.0)
    with pytest.raises(SVEError, match="last blocks"):
        SVEnsemble.from_model(base, members=2, last_n_blocks=0)
    ens = SVEnsemble.from_model(base, members=2)
    with pytest.raises(SVEError, match="tokenizer"):
        ens.second_opinion("hi", "there")


def test_generation_without_a_key_value_cache_is_an_error(monkeypatch):
    """A model that returns no cache would let every step see only its last token: refused."""
    import guarduq.sve.ensemble as ensemble_module

    ens = SVEnsemble.from_model(tiny_llama(), members=2, tokenizer=tiny_tokenizer())
    assert isinstance(ens.generate("hi", max_new_tokens=2), str)  # with a cache it generates
    real = ensemble_module.forward_with_cache
    monkeypatch.setattr(ensemble_module, "forward_with_cache", lambda *a, **kw: (real(*a, **kw)[0], None))
    with pytest.raises(SVEError, match="no key/value cache"):
        ens.generate("hi", max_new_tokens=2)


# --------------------------------------------------------------------------- SVD cache


def test_svd_is_cached_by_fingerprint(tmp_path, monkeypatch):
    base = tiny_llama()
    first = SVEnsemble.from_model(base, members=2, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.safetensors"))
    assert [f.stem for f in files] == [first.base_fingerprint]

    def no_svd(*a, **k):
        raise AssertionError("SVD recomputed despite the cache")

    monkeypatch.setattr(torch.linalg, "svd", no_svd)
    second = SVEnsemble.from_model(base, members=2, sigma_init=0.0, cache_dir=tmp_path)
    with torch.no_grad():
        expected = base(input_ids=ids()).logits
    assert rel_err(second.member_logits(ids())[0], expected) <= 1e-5


def test_corrupt_svd_cache_names_the_file(tmp_path):
    base = tiny_llama()
    SVEnsemble.from_model(base, members=2, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    path.write_bytes(b"not safetensors")
    with pytest.raises(CacheCorruptError, match=path.name):
        SVEnsemble.from_model(base, members=2, cache_dir=tmp_path)


# --------------------------------------------------------------------------- training


CLASS_DATA = [
    ("the film is good", 1), ("the film is bad", 0), ("a great movie", 1), ("an awful movie", 0),
    ("the acting was fun", 1), ("the plot was dull", 0), ("not very good", 0), ("very great fun", 1),
]


def test_member_batches_are_per_member_permutations():
    n, b = 8, 3
    streams = [[i for s in range(8) for i in member_batch(n, m, s, b, seed=0)] for m in range(3)]
    for stream in streams:  # each epoch of n consecutive items is a permutation
        for e in range(len(stream) // n):
            assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    assert streams[0] != streams[1] != streams[2]


def test_fit_classification_lowers_the_loss_and_moves_only_member_params():
    base = tiny_llama()
    ens = SVEnsemble.from_model(base, tiny_tokenizer(), members=2, sigma_init=0.05)
    frozen = {k: v.clone() for k, v in ens.model.state_dict().items() if not k.endswith((".delta", ".beta"))}
    start = [p.detach().clone() for p in ens.parameters()]
    ens.fit(CLASS_DATA, label_words=["positive", "negative"], steps=25, batch_size=4, lr=0.02, progress=False)
    assert len(ens.history_) == 25 and ens.steps_done_ == 25
    assert sum(ens.history_[-5:]) < sum(ens.history_[:5])
    after = ens.model.state_dict()
    assert all(torch.equal(frozen[k], after[k]) for k in frozen)
    assert any(not torch.equal(a, p) for a, p in zip(start, ens.parameters(), strict=True))


def test_fit_lm_loss_on_answer_tokens():
    ens = SVEnsemble.from_model(tiny_gpt2(), tiny_tokenizer(), members=2, sigma_init=0.05)
    pairs = [("is the film good", "very good"), ("is the plot fun", "not fun")]
    before = ens.second_opinion(*pairs[0]).mean_prob
    ens.fit(pairs, steps=15, batch_size=2, lr=0.03, progress=False)
    assert ens.second_opinion(*pairs[0]).mean_prob > before


def test_fit_rejects_bad_data():
    ens = SVEnsemble.from_model(tiny_llama(), tiny_tokenizer(), members=2)
    with pytest.raises(SVEError, match="no training data"):
        ens.fit([], progress=False)
    with pytest.raises(SVEError, match="pairs"):
        ens.fit([("a", 1)], progress=False)
    with pytest.raises(SVEError, match="out of range"):
        ens.fit([("a", 5)], label_words=["positive", "negative"], progress=False)
    with pytest.raises(SVEError, match="share a first token"):
        ens.fit([("a", 0)], label_words=["good", "good"], progress=False)


def test_interrupted_fit_resumes_from_checkpoint_to_the_same_result(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    kw = dict(label_words=["positive", "negative"], steps=6, batch_size=2, lr=0.02, progress=False)
    straight = SVEnsemble.from_model(tiny_llama64(), tok, members=2, sigma_init=0.1).fit(CLASS_DATA, **kw)

    ckpt = tmp_path / "ckpt.safetensors"
    crashing = SVEnsemble.from_model(tiny_llama64(), tok, members=2, sigma_init=0.1)
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def flaky_step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit(CLASS_DATA, checkpoint=ckpt, checkpoint_every=2, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)

    resumed = SVEnsemble.from_model(tiny_llama64(), tok, members=2, sigma_init=0.1)
    resumed.fit(CLASS_DATA, checkpoint=ckpt, checkpoint_every=2, **kw)
    assert resumed.steps_done_ == 6
    assert resumed.history_ == pytest.approx(straight.history_, rel=FIT_REL)
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=FIT_REL, atol=FIT_REL)

    with pytest.raises(SVEError, match="other training settings"):
        SVEnsemble.from_model(tiny_llama(), tok, members=2, sigma_init=0.1).fit(
            CLASS_DATA[:4], checkpoint=ckpt, **kw
        )


# --------------------------------------------------------------------------- save / load


def test_save_load_round_trip(arch, tmp_path):
    base = MAKERS[arch]()
    ens = SVEnsemble.from_model(base, tiny_tokenizer(), members=3, sigma_init=0.2, last_n_blocks=1)
    ens.fit(CLASS_DATA, label_words=["positive", "negative"], steps=3, batch_size=2, progress=False)
    path = ens.save(tmp_path / "sve.safetensors")

    with safe_open(str(path), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert keys == {f"{n}.{a}" for n in ens.layers for a in ("delta", "beta")}
    assert meta["fingerprint"] == ens.base_fingerprint and meta["members"] == "3"
    assert json.loads(meta["last_n_blocks"]) == 1 and meta["format_version"] == "2"
    assert (meta["parametrisation"], meta["bias"]) == ("relative", "scaled")

    loaded = SVEnsemble.load(path, base, tiny_tokenizer())
    assert loaded.steps_done_ == 3
    torch.testing.assert_close(loaded.member_logits(ids()), ens.member_logits(ids()), rtol=0, atol=0)


def test_load_refuses_another_model(tmp_path):
    ens = SVEnsemble.from_model(tiny_llama(seed=0), members=2)
    path = ens.save(tmp_path / "sve.safetensors")
    with pytest.raises(FingerprintMismatchError, match="not on this model"):
        SVEnsemble.load(path, tiny_llama(seed=1))


def test_load_rejects_non_sve_files(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 20)
    with pytest.raises(ArtifactError):
        SVEnsemble.load(bad, tiny_llama())
    with pytest.raises(ArtifactError, match="not found"):
        SVEnsemble.load(tmp_path / "missing.safetensors", tiny_llama())


# --------------------------------------------------------------------------- inference


def test_predict_proba_matches_base_when_members_equal_it():
    base, tok = tiny_llama(), tiny_tokenizer()
    ens = SVEnsemble.from_model(base, tok, members=2, sigma_init=0.0)
    prompts = [p for p, _ in CLASS_DATA[:5]]
    words = ["positive", "negative"]
    label_ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in words]
    expected = []
    with torch.no_grad():
        for p in prompts:
            logits = base(input_ids=torch.tensor([layout.prompt_ids(tok, p)])).logits[0, -1, label_ids]
            expected.append(torch.softmax(logits, -1))
    got = ens.predict_proba(prompts, words, batch_size=2)
    assert got.shape == (5, 2)
    torch.testing.assert_close(torch.from_numpy(got), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert ens.member_proba(prompts, words).shape == (2, 5, 2)


def test_second_opinion_equal_members_have_no_spread():
    base, tok = tiny_llama(), tiny_tokenizer()
    ens = SVEnsemble.from_model(base, tok, members=3, sigma_init=0.0)
    op = ens.second_opinion("is the film good", "very good")
    enc = layout.encode(tok, base, "is the film good", "very good")
    with torch.no_grad():
        logp = torch.log_softmax(base(input_ids=enc.input_ids).logits[0], -1)
    targets = enc.input_ids[0, enc.response_start :]
    expected = logp[enc.response_start - 1 : -1].gather(-1, targets[:, None]).exp().mean()
    assert op.n_tokens == len("very good") + 1  # one byte per token + end of turn
    assert op.member_mean_probs == pytest.approx([float(expected)] * 3, rel=1e-5)
    assert op.mean_prob == pytest.approx(float(expected), rel=1e-5)
    assert op.variance == pytest.approx(0.0, abs=1e-12)
    assert op.mutual_information == pytest.approx(0.0, abs=1e-6)
    assert op.answer is None and op.agrees is None


def test_second_opinion_spread_and_mutual_information_follow_their_definitions():
    tok = tiny_tokenizer()
    ens = SVEnsemble.from_model(tiny_gpt2(), tok, members=3, sigma_init=0.5, seed=2)
    op = ens.second_opinion("is the film good", "very good")
    enc = layout.encode(tok, ens.model, "is the film good", "very good")
    s = enc.response_start
    logp = torch.log_softmax(ens.member_logits(enc.input_ids)[:, 0, s - 1 : -1].double(), -1)
    p = logp.exp()
    pbar = p.mean(0)
    mi = (-(pbar * pbar.log()).sum(-1) + (p * logp).sum(-1).mean(0)).mean()
    member = p.gather(-1, enc.input_ids[0, s:].expand(3, -1)[..., None]).squeeze(-1).mean(1)
    assert op.member_mean_probs == pytest.approx(member.tolist(), rel=1e-9)
    assert op.variance == pytest.approx(float(member.var(unbiased=False)), rel=1e-9)
    assert op.mutual_information == pytest.approx(float(mi), rel=1e-9)
    assert op.mutual_information > 0 and op.variance > 0


def test_second_opinion_greedy_answer_matches_base_greedy_when_members_equal_it():
    base, tok = tiny_llama(), tiny_tokenizer()
    ens = SVEnsemble.from_model(base, tok, members=2, sigma_init=0.0)
    prompt = "is the film good"
    x = torch.tensor([layout.prompt_ids(tok, prompt)])
    stops = set(layout.stop_token_ids(tok))
    new = []
    with torch.no_grad():
        for _ in range(4):
            nxt = int(base(input_ids=x).logits[0, -1].argmax())
            if nxt in stops:
                break
            new.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    expected = tok.decode(new, skip_special_tokens=True)
    op = ens.second_opinion(prompt, "very good", max_new_tokens=4)
    assert op.answer == expected
    assert op.agrees == same_answer(expected, "very good")


@pytest.mark.parametrize(
    ("answer", "response", "same"),
    [
        ("Paris", "The capital is Paris.", True),
        ("paris!", "PARIS", True),
        ("a", "cat", False),
        ("London", "Paris", False),
        ("", "Paris", False),
    ],
)
def test_answer_agreement_is_word_level(answer, response, same):
    assert same_answer(answer, response) is same


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def model_dir(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_cli_train_sst2_writes_members_bound_to_the_model(model_dir, tmp_path, capsys):
    from guarduq.cli import main
    from guarduq.models import load_model

    tsv = tmp_path / "sst2.tsv"
    tsv.write_text("sentence\tlabel\na good film \t1\na dull plot \t0\nfun \t1\nawful \t0\n")
    out = tmp_path / "members.safetensors"
    argv = ["sve", "train", "--model", model_dir, "--dataset", "sst2", "--data", str(tsv),
            "--members", "2", "--steps", "2", "--batch-size", "2", "--last-n-blocks", "1", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["items"] == 4
    assert summary["overhead"]["members"] == 2 and summary["overhead"]["targeted_blocks"] == 1
    loaded = load_model(model_dir)
    ens = SVEnsemble.load(out, loaded)
    assert ens.members == 2 and ens.steps_done_ == 2 and ens.last_n_blocks == 1


def test_cli_train_arc_uses_the_lm_loss(model_dir, tmp_path, capsys):
    from guarduq.cli import main

    rows = [
        {"id": f"q{i}", "question": {"stem": f"pick {i}", "choices": [
            {"label": "A", "text": "good"}, {"label": "B", "text": "bad"}]}, "answerKey": "A"}
        for i in range(3)
    ]
    src = tmp_path / "arc.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "arc.safetensors"
    assert main(["sve", "train", "--model", model_dir, "--dataset", "arc", "--data", str(src),
                 "--members", "2", "--steps", "1", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["items"] == 3 and out.is_file()


def test_cli_train_on_several_datasets_leaves_out_what_calibrate_scores(model_dir, tmp_path, capsys):
    """--exclude-limit N: nothing `calibrate --limit N` scores of a file is trained on, nor any item
    asking one of its questions in another file (TruthfulQA's gen and mc modes share questions)."""
    from guarduq.calibration.datasets import load_dataset
    from guarduq.cli import main

    def arc_row(i: int, stem: str) -> dict:
        return {"id": f"q{i}", "question": {"stem": stem, "choices": [
            {"label": "A", "text": "good"}, {"label": "B", "text": "bad"}]}, "answerKey": "A"}

    arc = tmp_path / "arc.jsonl"
    arc.write_text("\n".join(json.dumps(arc_row(i, f"pick {i}")) for i in range(12)))
    trivia = tmp_path / "trivia.jsonl"
    # item t0 asks arc's q0 question; the rest are new
    trivia.write_text("\n".join(json.dumps({"id": f"t{i}", "question": f"pick {i}" if i == 0 else f"name {i}",
                                            "answers": ["x"]}) for i in range(6)))
    scored = {it.question for it in load_dataset("arc", arc, limit=5)}
    scored |= {it.question for it in load_dataset("triviaqa", trivia, limit=2)}
    out = tmp_path / "m.safetensors"
    argv = ["sve", "train", "--model", model_dir, "--dataset", "arc", "--data", str(arc),
            "--dataset", "triviaqa", "--data", str(trivia), "--exclude-limit", "5", "--exclude-limit", "triviaqa=2",
            "--members", "2", "--steps", "1", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    left_arc = [it for it in load_dataset("arc", arc) if it.question not in scored]
    left_trivia = [it for it in load_dataset("triviaqa", trivia) if it.question not in scored]
    assert summary["items"] == len(left_arc) + len(left_trivia)
    assert len(left_arc) == 12 - 5 and len(left_trivia) == 6 - 2 - 1  # t0 asks a question arc's subset scores
    assert summary["datasets"] == ["arc", "triviaqa"]
    # --limit then caps each dataset, in hash order
    assert main([*argv[:-2], "--limit", "2", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["items"] == 4


def test_outside_limits_is_the_complement_of_the_limit_subset() -> None:
    from guarduq.calibration.datasets import Item
    from guarduq.calibration.splits import limit_subset, outside_limits

    items = [Item(id=f"d:{i}", dataset="d", kind="qa", prompt=f"q{i}", question=f"q{i}", grader="aliases", answers=("a",))
             for i in range(50)]
    other = [Item(id=f"e:{i}", dataset="e", kind="qa", prompt=f"q{i}", question=f"Q{i} ", grader="aliases", answers=("a",))
             for i in range(50)]  # the same questions up to case and spacing
    kept = {it.id for it in limit_subset(items, 20)}
    left = outside_limits({"d": items}, {"d": 20})
    assert {it.id for it in left["d"]} == {it.id for it in items} - kept
    left = outside_limits({"d": items, "e": other}, {"d": 20, "": 50})
    assert left == {"d": [], "e": []}  # e is scored whole, and asks every question d asks
    left = outside_limits({"d": items, "e": other}, {"": 20})
    asked = {it.question for it in limit_subset(items, 20)} | {it.question.strip().lower() for it in limit_subset(other, 20)}
    assert all(it.question not in asked for it in left["d"])
    assert all(it.question.strip().lower() not in asked for it in left["e"])
    assert len(left["d"]) < 30  # e's scored questions are left out of d too


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--members", "1"], "members >= 2"), (["--targets", "qproj"], "unknown SVE target"),
     # a folder as checkpoint or output: refused before training, not by os.replace after it
     (["--checkpoint", "."], "checkpoint .: it is a directory"),
     (["--out", "."], "SVE output .: it is a directory")],
)
def test_cli_train_bad_input_is_one_line(model_dir, tmp_path, capsys, extra, needle):
    from guarduq.cli import main

    tsv = tmp_path / "sst2.tsv"
    tsv.write_text("sentence\tlabel\ngood \t1\n")
    argv = ["sve", "train", "--model", model_dir, "--dataset", "sst2", "--data", str(tsv),
            "--out", str(tmp_path / "x.safetensors"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("guarduq: error:") and needle in err and err.count("\n") == 1


def test_prefix_sharing_check_tolerates_rounding_not_a_wrong_fan_out() -> None:
    logits = torch.randn(4, 5, 50, generator=torch.Generator().manual_seed(0)) * 10
    rounded = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)) * 1e-5
    assert _same_logits(rounded, logits)  # fp32 noise of another kernel, also on logits near 0
    assert not _same_logits(logits[[1, 0, 2, 3]], logits)  # rows fanned out to the wrong member
    assert not _same_logits(logits + 0.05, logits)


def test_members_train_apart_an_m_member_fit_equals_its_members_fitted_in_a_smaller_one():
    """Member m's loss, gradient and clipping are its own: members 0-1 of a 3-member fit equal
    those of a 2-member fit (σ_init 0, so they start alike; each has its own data order).
    A joint mean loss with one clipping norm over all members fails this."""
    tok = tiny_tokenizer()
    kw = dict(label_words=["positive", "negative"], steps=5, batch_size=2, lr=0.05,
              max_grad_norm=0.01, progress=False)  # a small norm: clipping acts on every step
    two = SVEnsemble.from_model(tiny_llama64(), tok, members=2, sigma_init=0.0).fit(CLASS_DATA, **kw)
    three = SVEnsemble.from_model(tiny_llama64(), tok, members=3, sigma_init=0.0).fit(CLASS_DATA, **kw)
    for a, b in zip(two.parameters(), three.parameters(), strict=True):
        torch.testing.assert_close(b[:2], a, rtol=FIT_REL, atol=FIT_REL)
    assert any(not torch.allclose(p[0], p[1]) for p in two.parameters())  # orders differ


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fit_from_cached_frozen_states_ends_where_a_plain_fit_does(arch):
    """Blocks below the first SVE block run once per item, not once per step, and the members
    end where a fit that runs every block each step ends."""
    tok = tiny_tokenizer()
    make = (lambda: tiny_llama64(layers=3)) if arch == "llama" else (lambda: conftest_gpt2().double())
    kw = dict(label_words=["positive", "negative"], steps=6, batch_size=2, lr=0.05, progress=False)
    fits = {}
    for reuse in (True, False):
        ens = SVEnsemble.from_model(make(), tok, members=2, sigma_init=0.1, last_n_blocks=1)
        calls = []
        first_block = decoder_blocks(ens.model)[0]
        mlp = first_block.mlp
        mlp.register_forward_pre_hook(lambda *a, calls=calls: calls.append(1))
        ens.fit(CLASS_DATA, reuse_states=reuse, **kw)
        fits[reuse] = (ens, len(calls))
    for a, b in zip(fits[True][0].parameters(), fits[False][0].parameters(), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=FIT_REL, atol=FIT_REL)
    assert fits[False][1] == 6  # once per step without reuse
    if arch == "llama":  # Llama blocks return plain tensors: states cached, block 0 ran once
        assert fits[True][1] == 1


def test_frozen_states_are_not_kept_when_they_would_not_fit_in_memory():
    from guarduq.sve.frozen import FrozenStates

    ens = SVEnsemble.from_model(tiny_llama(layers=3), tiny_tokenizer(), members=2, last_n_blocks=1)
    ids = [[5, 6, 7, 8]] * 3
    kept = FrozenStates.compute(ens.model, 2, ids, 0)
    assert kept is not None and len(kept.states) == 3 and kept.states[0].shape == (4, 32)
    assert FrozenStates.compute(ens.model, 2, ids, 0, max_bytes=100) is None  # 3 x 4 x 32 x 4 bytes > 100
