"""Long prompts: reusing generation's hidden states, checkpointing, and the parameter set a score
(and a calibrator) is bound to. Every fast path is compared with the plain full forward+backward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guarduq import Guard
from guarduq.calibration import Calibrator
from guarduq.calibration._artifact import Artifact
from guarduq.errors import CalibrationError, InputError
from guarduq.scoring import reuse
from guarduq.scoring.uncertainty import (
    GradientScorer,
    parameter_set_id,
    parse_parameter_set,
    select_parameters,
)
from tests.conftest import make_tokenizer, tiny_llama

REL = 1e-9  # float64 on tiny models: the reuse path differs from the full one by rounding only


def close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def same_scores(a, b, rel: float = REL) -> None:
    assert a.valid and b.valid
    assert a.n_tokens == b.n_tokens and a.parameter_set == b.parameter_set
    assert close(a.epistemic, b.epistemic, rel), (a.epistemic, b.epistemic)
    assert all(close(x, y, rel) for x, y in zip(a.token_probs, b.token_probs, strict=True))
    assert a.grad_profile.keys() == b.grad_profile.keys()
    assert all(close(a.grad_profile[k], b.grad_profile[k], rel) for k in a.grad_profile)


def no_blank(tok) -> dict:
    return {"suppress_tokens": tok.convert_tokens_to_ids(["Ġ", "Ċ", "ĉ", "č"])}


class GradCalls:
    """Counts calls of a block made with gradients enabled (scoring; generation runs without)."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.n = 0
        self.handle = block.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.n += int(torch.is_grad_enabled())


@pytest.fixture
def tok():
    return make_tokenizer()


@pytest.fixture
def deep_guard(tok):
    model = tiny_llama(layers=4).double()
    return Guard((model, tok), last_n_blocks=2, max_new_tokens=10)


def test_reuse_block_follows_the_selection(tok):
    tied, untied = tiny_llama(layers=4), tiny_llama(layers=4, tie=False)
    assert GradientScorer(tied, last_n_blocks=2).reuse_block == 2
    assert GradientScorer(tied, last_n_blocks=4).reuse_block is None  # nothing to skip
    assert GradientScorer(tied).reuse_block is None  # embeddings scored: backward reaches them
    # the tied head is the embedding: selecting it needs the backward down to the input
    assert GradientScorer(tied, parameters=[r"layers\.3\.", "lm_head", "embed"]).reuse_block is None
    # an untied head and the final norm sit above the blocks
    assert GradientScorer(untied, parameters=[r"layers\.[23]\.", r"model\.norm", "lm_head"]).reuse_block == 2


@pytest.mark.parametrize("path", ["generate", "generate_ended", "generate_batch", "stream"])
def test_reuse_equals_the_full_path(deep_guard, tok, path):
    """Scores computed from the states generation recorded equal a fresh full forward's, and the
    blocks below the scored ones never run with gradients."""
    blocks = reuse.decoder_blocks(deep_guard.model)
    low, high = GradCalls(blocks[1].mlp), GradCalls(blocks[2].mlp)  # inside: a stood-aside block still fires its own hooks
    prompts = ["hello there", "a much longer prompt than the others", "what now"]
    if path == "generate":
        replies = [deep_guard.generate(prompts[0], **no_blank(tok))]
    elif path == "generate_ended":  # the end-of-turn token closes the scored sequence
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        replies = [deep_guard.generate(prompts[0], max_new_tokens=6, forced_eos_token_id=im_end, **no_blank(tok))]
        assert replies[0].ended
    elif path == "generate_batch":
        replies = deep_guard.generate_batch(prompts, **no_blank(tok))  # left-padded rows
    else:
        replies = [list(deep_guard.stream(prompts[1], **no_blank(tok)))[-1]]
        prompts = prompts[1:]
    assert low.n == 0 and high.n >= 1  # scoring ran blocks 2..3 only
    for p, r in zip(prompts, replies, strict=False):
        same_scores(r.scores, deep_guard.score(p, r.text, ended=r.ended))
    assert low.n >= 1  # the teacher-forced reference did run the full model


def test_reuse_with_an_untied_head_and_final_norm(tok):
    model = tiny_llama(layers=4, tie=False).double()
    guard = Guard((model, tok), parameters=[r"layers\.3\.", r"model\.norm", "lm_head"], max_new_tokens=8)
    assert guard.scorer.reuse_block == 3
    low = GradCalls(reuse.decoder_blocks(model)[2].mlp)
    letters = set(tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz")))
    r = guard.generate("hi there", suppress_tokens=[i for i in range(len(tok)) if i not in letters])
    assert low.n == 0  # block 2 was stood aside: the states it would have made were recorded
    same_scores(r.scores, guard.score("hi there", r.text, ended=r.ended))
    assert set(r.scores.grad_profile) == {"block.3.norm", "block.3.attn", "block.3.mlp", "final_norm", "head"}


def test_states_that_do_not_match_the_scored_tokens_are_not_used(deep_guard):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    states = torch.zeros(1, 4, 32, dtype=torch.float64)
    assert reuse.states_for(((5, 6, 7, 8), states), ids) is not None
    assert reuse.states_for(((5, 6, 9, 8), states), ids) is None  # a different token
    assert reuse.states_for(((5, 6, 7), states[:, :3]), ids) is None  # too few positions
    assert reuse.states_for(None, ids) is None
    assert not reuse.plain_decoding({"num_beams": 2})
    assert reuse.plain_decoding({"do_sample": True})
    assert not reuse.plain_decoding({"num_beams": "many"})  # generate() refuses it, typed


def test_states_without_a_reusable_selection_are_refused(tok):
    scorer = GradientScorer(tiny_llama(layers=2))
    with pytest.raises(InputError, match="skipping"):
        scorer.score(torch.tensor([[5, 6, 7, 8]]), 2, states=torch.zeros(1, 3, 32))


@pytest.mark.parametrize("selection", [{}, {"last_n_blocks": 2}])
def test_checkpointing_equals_the_stored_activations(selection):
    model = tiny_llama(layers=3).double()
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    top = []
    reuse.decoder_blocks(model)[2].mlp.register_forward_pre_hook(lambda *_: top.append(1))  # a pre-hook: the
    # recompute stops as soon as it has what the backward needs, inside the MLP, before forward hooks
    plain = GradientScorer(model, checkpoint_tokens=None, **selection).score(ids, 25)
    assert len(top) == 1
    checked = GradientScorer(model, checkpoint_tokens=16, **selection)
    assert checked._checkpointed(ids)
    same_scores(checked.score(ids, 25), plain, rel=1e-12)
    assert len(top) == 3  # checkpointed: the block ran again in the backward
    assert not any("forward" in vars(b) for b in reuse.decoder_blocks(model))  # nothing left behind
    # score_batch sends the long sequence to the checkpointed lean path, the short one batched
    short = ids[:, :12]
    got = checked.score_batch([(ids, 25), (short, 6)])
    same_scores(got[0], plain, rel=1e-12)
    same_scores(got[1], GradientScorer(model, **selection).score(short, 6), rel=1e-9)
    assert not any(p.requires_grad is False for p in model.parameters())  # model left as found


def test_profile_sums_equal_scoring_the_subset():
    """The all-parameter profile restricted to some groups is the gradient over those groups:
    the frontier in benchmarks/long_context.py reads subsets off one all-parameter pass."""
    model = tiny_llama(layers=4, tie=False).double()
    ids = torch.randint(5, 200, (1, 30), generator=torch.Generator().manual_seed(2))
    full = GradientScorer(model).score(ids, 20).grad_profile
    for n in (1, 2):
        sub = GradientScorer(model, last_n_blocks=n).score(ids, 20)
        part = math.fsum(v for k, v in full.items() if k.startswith("block.") and int(k.split(".")[1]) >= 4 - n)
        assert close(sub.epistemic, part)
    mlp = GradientScorer(model, parameters=r"\.mlp\.").score(ids, 20)
    assert close(mlp.epistemic, math.fsum(v for k, v in full.items() if k.endswith(".mlp")))


def test_head_sees_only_answer_positions():
    model = tiny_llama(layers=2, tie=False)
    seen = []
    model.lm_head.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[-2]))
    ids = torch.randint(5, 200, (1, 50), generator=torch.Generator().manual_seed(3))
    GradientScorer(model).score(ids, 45)  # 5 response tokens
    GradientScorer(model).score_batch([(ids, 45), (ids[:, :30], 27)])
    assert seen[0] <= 6 and seen[1] == 5 + 3  # lean: +1 (the last position); batched: packed


def test_parameter_set_names_round_trip():
    for patterns, n in [(None, None), (None, 2), (r"mlp\.", None), ([r"a;b", "c"], 3)]:
        name = parameter_set_id(patterns, n)
        back = parse_parameter_set(name)
        assert parameter_set_id(*back) == name
    assert parameter_set_id(None, None) == "all"
    for bad in ["", "last_n_blocks=x", "parameters=[1", "nonsense", "last_n_blocks=2;x"]:
        with pytest.raises(InputError):
            parse_parameter_set(bad)


def _fitted(scores, labels) -> Calibrator:
    return Calibrator("paper", C=1.0).fit(scores, labels)


def test_calibrator_is_bound_to_its_parameter_set(tmp_path, tok):
    model = tiny_llama(layers=4)
    rng = torch.Generator().manual_seed(4)
    items = [(torch.randint(5, 200, (1, 20), generator=rng), 15) for _ in range(24)]
    last2 = GradientScorer(model, last_n_blocks=2).score_batch(items)
    labels = [i % 2 for i in range(24)]
    cal = _fitted(last2, labels)
    assert cal.parameter_set_ == "last_n_blocks=2"
    path = tmp_path / "c.json"
    cal.save(path)
    loaded = Calibrator.load(path)
    assert loaded.parameter_set_ == "last_n_blocks=2"
    assert loaded.predict_risk(last2).shape == (24,)
    with pytest.raises(CalibrationError, match="last_n_blocks=2"):
        loaded.predict_risk(GradientScorer(model).score_batch(items[:2]))
    with pytest.raises(CalibrationError, match="different parameter sets"):
        _fitted(last2[:12] + GradientScorer(model).score_batch(items[12:]), labels)
    # a Guard takes the calibrator's set, and refuses another one named explicitly
    assert Guard((model, tok), calibrator=loaded).scorer.parameter_set == "last_n_blocks=2"
    with pytest.raises(InputError, match="fitted on gradients over parameters .last_n_blocks=2., not .all."):
        Guard((model, tok), calibrator=loaded, parameters="all")
    # a reply that cannot be scored gets risk 1.0 (fail closed), not a parameter-set error
    guarded = Guard((model, tok), calibrator=loaded, max_new_tokens=3)
    blank = guarded.generate("Hi", suppress_tokens=list(range(5, len(tok))))
    assert not blank.scores.valid and blank.scores.parameter_set == "last_n_blocks=2" and blank.risk == 1.0
    # an artifact from before the field existed was fitted on all parameters
    old = {k: v for k, v in loaded.to_dict().items() if k != "parameter_set"}
    assert Calibrator._from_artifact(Artifact.model_validate(old), path).parameter_set_ == "all"


def test_select_parameters_is_unchanged_by_reuse():
    model = tiny_llama(layers=4)
    names = [n for n, _ in select_parameters(model, None, 2)]
    assert names and all(".layers.2." in n or ".layers.3." in n for n in names)


def test_restrict_profile_matches_scoring_the_subset():
    """The helper the frontier uses: a subset's score dict read off an all-parameter pass."""
    from guarduq.calibration.features import restrict_profile

    model = tiny_llama(layers=4, tie=False).double()
    ids = torch.randint(5, 200, (1, 30), generator=torch.Generator().manual_seed(5))
    full = GradientScorer(model).score(ids, 22).to_dict()
    sub = GradientScorer(model, last_n_blocks=2).score(ids, 22)
    got = restrict_profile(full, lambda g: g.startswith(("block.2.", "block.3.")), sub.parameter_set)
    assert got["parameter_set"] == "last_n_blocks=2" and got["grad_profile"].keys() == sub.grad_profile.keys()
    assert close(got["epistemic"], sub.epistemic)
    assert got["token_probs"] == list(sub.token_probs)


def test_score_cache_reads_the_last_blocks_off_an_all_parameter_record(tmp_path):
    """A calibrator over the last 2 blocks from a cache scored over all parameters: the cache's
    derived record equals scoring those blocks directly (float64, relative 1e-9), a record scored
    over the set itself wins, and a set the profile cannot give exactly is not derived."""
    from types import SimpleNamespace

    from guarduq.calibration.evaluation import ScoreCache, ScoredItem

    model = tiny_llama(layers=4, tie=False).double()
    ids = torch.randint(5, 200, (1, 30), generator=torch.Generator().manual_seed(7))
    full = GradientScorer(model).score(ids, 22).to_dict()
    sub = GradientScorer(model, last_n_blocks=2).score(ids, 22)
    cache = ScoreCache(tmp_path / "c.jsonl")
    cache.append(ScoredItem(id="q1", dataset="d", kind="qa", prompt_hash="h", model_fingerprint="f",
                            response="r", label=1, scores=full, split="fit"))
    item = SimpleNamespace(id="q1", prompt_hash="h")
    got = ScoreCache(tmp_path / "c.jsonl").get(item, "f", "last_n_blocks=2")
    assert got is not None and got.parameter_set == "last_n_blocks=2" and got.response == "r" and got.label == 1
    assert math.isclose(got.scores["epistemic"], sub.epistemic, rel_tol=1e-9)
    assert set(got.scores["grad_profile"]) == set(sub.grad_profile)
    assert cache.get(item, "f", 'parameters=["mlp\\."]') is None  # not a union of whole blocks' groups
    assert cache.get(item, "f", "last_n_blocks=2").scores["epistemic"] < full["epistemic"]
    scored = {**sub.to_dict(), "epistemic": 123.0}  # a record over the set itself comes first
    cache.append(ScoredItem(id="q1", dataset="d", kind="qa", prompt_hash="h", model_fingerprint="f",
                            response="r", label=1, scores=scored, split="fit"))
    assert ScoreCache(tmp_path / "c.jsonl").get(item, "f", "last_n_blocks=2").scores["epistemic"] == 123.0


def test_score_cache_keeps_one_record_per_parameter_set(tmp_path):
    from types import SimpleNamespace

    from guarduq.calibration.evaluation import ScoreCache, ScoredItem

    def rec(pset: str | None, label: int) -> ScoredItem:
        scores = {"valid": True, **({"parameter_set": pset} if pset else {})}
        return ScoredItem(id="q1", dataset="d", kind="qa", prompt_hash="h", model_fingerprint="f",
                          response="r", label=label, scores=scores, split="fit")

    cache = ScoreCache(tmp_path / "c.jsonl")
    cache.append(rec(None, 1))  # a line from before the field: scored over all parameters
    cache.append(rec("last_n_blocks=2", 0))
    again = ScoreCache(tmp_path / "c.jsonl")
    item = SimpleNamespace(id="q1", prompt_hash="h")
    assert again.get(item, "f").label == 1
    assert again.get(item, "f", "last_n_blocks=2").label == 0
    assert again.get(item, "f", "last_n_blocks=1") is None
    # an item a last-2 run could not score is remembered for that run, not for "all"
    from guarduq.calibration.evaluation import _record

    failed = _record(SimpleNamespace(id="q2", dataset="d", kind="qa", prompt_hash="h", split="fit"),
                     "f", InputError("too long"), 0.0, "last_n_blocks=2")
    assert failed.scores is None and failed.key == ("q2", "h", "f", "last_n_blocks=2")


def test_resolve_selection_precedence():
    from guarduq.scoring.parameters import resolve_selection

    assert resolve_selection(None, None, None, default_last_n_blocks=2) == {"parameters": None, "last_n_blocks": 2}
    assert resolve_selection("all", None, None, default_last_n_blocks=2) == {"parameters": None, "last_n_blocks": None}
    assert resolve_selection(None, None, "last_n_blocks=1", default_last_n_blocks=2)["last_n_blocks"] == 1
    assert resolve_selection(None, 1, "last_n_blocks=1")["last_n_blocks"] == 1
    with pytest.raises(InputError, match="exclude"):
        resolve_selection("all", 2, None)
    with pytest.raises(InputError, match="fitted on gradients"):
        resolve_selection(None, 2, "all")


def tiny_gemma3():
    """Gemma-3's layout: sliding and full attention layers, scaled embeddings, q/k norms."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.conftest import VOCAB

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    return Gemma3ForCausalLM(cfg).eval().double()


def test_gemma3_reuse_and_checkpointing_equal_the_full_path(tok):
    model = tiny_gemma3()
    guard = Guard((model, tok), last_n_blocks=2, max_new_tokens=8)
    calls = GradCalls(reuse.decoder_blocks(model)[1].mlp)
    letters = set(tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz")))
    only_letters = {"suppress_tokens": [i for i in range(len(tok)) if i not in letters]}  # text re-encodes alike
    prompts = ["hello there, a longer prompt", "what now"]
    replies = guard.generate_batch(prompts, **only_letters)
    assert calls.n == 0
    for p, r in zip(prompts, replies, strict=True):
        same_scores(r.scores, guard.score(p, r.text, ended=r.ended))
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(6))
    # the scoring forward keeps no KV cache (Gemma makes one by default), so a checkpointed
    # block's second forward sees the same keys as its first
    same_scores(GradientScorer(model, checkpoint_tokens=8).score(ids, 30),
                GradientScorer(model, checkpoint_tokens=None).score(ids, 30), rel=1e-12)


@given(
    patterns=st.none() | st.lists(st.text(max_size=12), min_size=1, max_size=3),
    last_n=st.none() | st.integers(min_value=1, max_value=64),
)
def test_parameter_set_names_round_trip_any_selection(patterns, last_n):
    name = parameter_set_id(patterns, last_n)
    assert parameter_set_id(*parse_parameter_set(name)) == name


@given(name=st.text(max_size=40))
def test_any_parameter_set_name_parses_or_is_refused_typed(name):
    """Whatever an artifact or a flag holds: a typed refusal, or a name that is its own canonical form."""
    try:
        parsed = parse_parameter_set(name)
    except InputError:
        return
    assert parameter_set_id(*parsed) == name


def test_calibrator_with_a_malformed_parameter_set_is_refused(tmp_path):
    import json

    from guarduq.errors import ArtifactError

    model = tiny_llama(layers=2)
    rng = torch.Generator().manual_seed(7)
    items = [(torch.randint(5, 200, (1, 16), generator=rng), 12) for _ in range(20)]
    cal = _fitted(GradientScorer(model).score_batch(items), [i % 2 for i in range(20)])
    path = tmp_path / "c.json"
    cal.save(path)
    doc = json.loads(path.read_text())
    doc["parameter_set"] = "last_n_blocks=two"
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="malformed parameter set"):
        Calibrator.load(path)


def test_block_overrides_restore_a_forward_already_there():
    """A dispatch hook (accelerate's ``device_map``) sets ``forward`` on a block; standing blocks
    aside or checkpointing them must put it back, also when scoring raises."""
    from guarduq.scoring.memory import checkpoint_blocks

    model = tiny_llama(layers=4).double()
    blocks = reuse.decoder_blocks(model)
    calls = []

    def hooked(*args, _orig=blocks[1].forward, **kwargs):
        calls.append(1)
        return _orig(*args, **kwargs)

    blocks[1].forward = hooked
    ids = torch.randint(5, 200, (1, 30), generator=torch.Generator().manual_seed(8))
    scorer = GradientScorer(model, last_n_blocks=2, checkpoint_tokens=0)
    plain = GradientScorer(model, checkpoint_tokens=None).score(ids, 20)
    assert calls
    same_scores(GradientScorer(model, checkpoint_tokens=0).score(ids, 20), plain, rel=1e-12)
    scorer.score(ids, 20, states=torch.zeros(1, 29, 32, dtype=torch.float64))
    assert vars(blocks[1])["forward"] is hooked and "forward" not in vars(blocks[0])
    with pytest.raises(RuntimeError), checkpoint_blocks(blocks, 0):
        assert vars(blocks[1])["forward"] is not hooked
        raise RuntimeError("scoring failed")
    assert vars(blocks[1])["forward"] is hooked and "forward" not in vars(blocks[3])


def test_the_scored_block_list_is_the_one_holding_the_scored_parameters():
    """A model with two block lists (a multimodal model's vision encoder and language decoder):
    the decoder, whose blocks hold the scored parameters, is the one stood aside."""

    class TwoTowers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision = torch.nn.Module()
            self.vision.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(4)])

    m = TwoTowers()
    selected = [(n, p) for n, p in m.named_parameters() if n.startswith("model.layers.3.")]
    assert reuse.decoder_blocks(m, selected) is m.model.layers
    assert reuse.first_scored_block(m, selected, ["block.3.other"] * len(selected)) == 3
    everything = list(m.named_parameters())
    assert reuse.decoder_blocks(m, everything) is m.model.layers  # the larger list
    assert reuse.first_scored_block(m, everything, ["x"] * len(everything)) is None
