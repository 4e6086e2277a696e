"""Batched generation, multiple-choice forwards and dataset scoring equal the one-at-a-time paths;
device and dtype placement (bf16 on CPU against fp32; CUDA only where there is a GPU)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from guarduq import Guard, batching, layout
from guarduq.calibration.datasets import load_dataset
from guarduq.calibration.evaluation import ScoreCache, score_dataset
from guarduq.errors import InputError
from guarduq.models import fingerprint, resolve_device, resolve_dtype
from guarduq.scoring.uncertainty import mean_token_prob
from tests.conftest import make_tokenizer, tiny_gemma, tiny_gpt2, tiny_llama, tiny_qwen2

PROMPTS = ["Hi", "Tell me a long story about the sea and ships", "What?", "abc def ghi jkl mno pqr stu",
           "Why is the sky blue, and why?"]
NUMERIC = ("epistemic", "aleatoric", "mean_token_prob", "mean_logprob", "min_token_prob", "mean_entropy")


def no_blank(tokenizer) -> dict:
    return {"suppress_tokens": tokenizer.convert_tokens_to_ids(["Ġ", "Ċ", "ĉ", "č"])}


def _replies(rs) -> list[tuple[str, bool]]:
    return [(r.text, r.ended) for r in rs]


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("make", [lambda: tiny_llama(tie=False), tiny_gpt2], ids=["llama", "gpt2"])
def test_generate_batch_equals_one_at_a_time(make, tokenizer) -> None:
    guard = Guard((make(), tokenizer), max_new_tokens=12)
    kw = no_blank(tokenizer)
    single = [guard.generate(p, **kw) for p in PROMPTS]
    for size in (2, 5):
        batch = guard.generate_batch(PROMPTS, batch_size=size, **kw)
        assert _replies(batch) == _replies(single)
        for a, b in zip(single, batch, strict=True):
            assert b.scores.epistemic == pytest.approx(a.scores.epistemic, rel=1e-6)
            assert b.scores.mean_token_prob == pytest.approx(a.scores.mean_token_prob, rel=1e-6)


def test_rows_are_cut_where_each_stopped_even_when_pad_is_end_of_turn(tokenizer) -> None:
    """Rows stop at different steps, some at end-of-turn, some at a stop string; HF pads finished
    rows with pad_token_id, here the end-of-turn id, which must not read as 'ended'."""
    guard = Guard((tiny_llama(tie=False), tokenizer), max_new_tokens=12)
    eot = layout.end_of_turn_id(tokenizer)
    kw = {**no_blank(tokenizer), "stop_strings": ["\x0f"], "tokenizer": tokenizer, "pad_token_id": eot}
    single = [guard.generate(p, **kw) for p in PROMPTS]
    assert {r.ended for r in single} == {True, False}  # the case under test is present
    assert len({len(r.text) for r in single}) > 1
    assert _replies(guard.generate_batch(PROMPTS, batch_size=5, **kw)) == _replies(single)


def test_generate_batch_writes_one_audit_line_per_response(tokenizer, tmp_path: Path) -> None:
    guard = Guard((tiny_llama(tie=False), tokenizer), max_new_tokens=6, audit=tmp_path / "audit.jsonl")
    rs = guard.generate_batch(PROMPTS[:3], batch_size=3, **no_blank(tokenizer))
    lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [x["request_id"] for x in lines] == [r.request_id for r in rs]


@pytest.mark.parametrize("bad, match", [("one prompt", "list of prompts"), (["ok", ""], "empty")])
def test_generate_batch_bad_input(tokenizer, bad, match) -> None:
    guard = Guard((tiny_llama(), tokenizer), max_new_tokens=4)
    with pytest.raises(InputError, match=match):
        guard.generate_batch(bad)
    with pytest.raises(InputError, match="batch_size"):
        guard.generate_batch(["ok"], batch_size=0)


# --------------------------------------------------------------------------- multiple choice


OPTION_MODELS = [tiny_llama, lambda: tiny_llama(tie=False), tiny_gpt2, tiny_gemma, tiny_qwen2]


@pytest.mark.parametrize("make", OPTION_MODELS)
@pytest.mark.parametrize("ended", [True, False])
def test_option_probs_equal_each_option_scored_alone(make, ended, tokenizer) -> None:
    """Each option's p̄ is the one a forward over prompt + that option alone gives (float32,
    rel 1e-6); the prompt is longer than tiny Gemma's sliding window (8)."""
    model = make()
    guard = Guard((model, tokenizer))
    options = [" a", " a much longer option than the others", " mid length", "x\n"]
    got = guard.option_probs("Which one?", options, ended=ended)
    for option, p in zip(options, got, strict=True):
        enc = layout.encode(tokenizer, model, "Which one?", option, ended=ended)
        assert p == pytest.approx(mean_token_prob(model, enc.input_ids, enc.response_start), rel=1e-6)


@pytest.mark.parametrize("make", OPTION_MODELS)
@pytest.mark.parametrize("prompt_len, lengths", [(1, [1]), (3, [2, 5, 1]), (6, [5, 9, 1]), (40, [1, 7, 3, 2, 12])])
def test_shared_prompt_path_equals_the_padded_path_in_float64(make, prompt_len, lengths, monkeypatch) -> None:
    """The fast path (the prompt once, options from its cache) equals the prompt in every row to
    1e-10 in float64, and really ran: the padded path is not called."""
    model = make().double()
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(5, 200, (prompt_len,), generator=gen).tolist()
    options = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in lengths]
    want = batching.padded_option_mean_probs(model, prompt, options, 0, torch.device("cpu"))
    monkeypatch.setattr(batching, "padded_option_mean_probs", lambda *a: pytest.fail("padded path taken"))
    got = batching.option_mean_probs(model, prompt, options, 0, torch.device("cpu"))
    assert got == pytest.approx(want, rel=1e-10)


class _Wrapped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_llama().double()


class _NoCacheArgument(_Wrapped):
    """A custom forward that takes neither a cache nor use_cache."""

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep)


class _NoCacheReturned(_Wrapped):
    """A forward that returns no transformers Cache (older or custom models)."""

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False, **kw):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)
        out["past_key_values"] = None
        return out


@pytest.mark.parametrize("wrapper", [_NoCacheArgument, _NoCacheReturned])
def test_a_model_without_a_repeatable_cache_takes_the_padded_path(wrapper) -> None:
    """Such a model still gets each option's p̄: the prompt then runs in every row."""
    model, prompt, options = wrapper(), [5, 6, 7], [[8], [9, 10, 11]]
    want = batching.padded_option_mean_probs(model.inner, prompt, options, 0, torch.device("cpu"))
    assert batching.option_mean_probs(model, prompt, options, 0, torch.device("cpu")) == pytest.approx(want, rel=1e-12)


# --------------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=0, tie=False).save_pretrained(d)
    make_tokenizer(chat_template=True).save_pretrained(d)
    return d


def _mixed_items(tmp_path: Path) -> list:
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"id": str(i), "question": q, "answers": ["x"]}) + "\n" for i, q in
                          enumerate(["Capital of Peru?", "Who wrote Hamlet?", "Largest planet?", "Two plus two?",
                                     "Colour of the sky?"])))
    arc = tmp_path / "arc.jsonl"
    arc.write_text("".join(json.dumps({"id": f"a{i}", "question": {"stem": f"Pick {i}", "choices": [
        {"label": "A", "text": "yes"}, {"label": "B", "text": "no, not at all"}, {"label": "C", "text": f"{i}"}]},
        "answerKey": "B"}) + "\n" for i in range(5)))
    lab = tmp_path / "lab.jsonl"
    lab.write_text("".join(json.dumps({"id": f"l{i}", "prompt": f"Say {i}", "response": "ok " * (i + 1),
                                       "label": i % 2}) + "\n" for i in range(5)))
    return [*load_dataset("triviaqa", qa).items, *load_dataset("arc", arc).items,
            *load_dataset("arc", arc, prompt_style="fewshot").items, *load_dataset("jsonl", lab).items]


def test_token_budget_chunks() -> None:
    chunks = batching.token_budget_chunks
    assert list(chunks([50, 40, 30, 10, 10], 4, 100, min_fill=0)) == [[0, 1], [2, 3, 4]]
    assert list(chunks([500, 20, 10], 8, 100, min_fill=0)) == [[0], [1, 2]]  # too long: alone
    assert list(chunks([5] * 10, 4, 10_000)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(chunks([], 4, 100)) == []
    # a row shorter than 3/4 of its batch's longest starts the next batch: padding costs a full row
    assert list(chunks([100, 80, 75, 74, 60, 56, 55], 8, 10_000)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(chunks([50, 40, 30, 10, 10], 4, 100)) == [[0, 1], [2], [3, 4]]


@pytest.mark.parametrize("sizes, budget", [
    ((28, 1536, 8960), 442),  # Qwen2.5-1.5B: 4.6x SmolLM2's width per token
    ((24, 896, 4864), 939),  # Qwen2.5-0.5B
    ((30, 576, 1536), 2048),  # SmolLM2-135M, for which 2048 was measured
    ((18, 640, 2048), 2048),  # Gemma-3-270m: narrower still, never above 2048
    ((200, 8192, 28672), 256),  # a 70B-class width: never below 256
])
def test_token_budget_scales_with_the_models_width(sizes, budget) -> None:
    from transformers import LlamaConfig

    layers, hidden, inter = sizes
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter)
    assert batching.token_budget(SimpleNamespace(config=cfg)) == budget
    assert batching.token_budget(SimpleNamespace()) == batching.MAX_BATCH_TOKENS  # no config: the default


def test_score_batch_splits_long_pairs_within_the_token_budget(tokenizer, monkeypatch) -> None:
    guard = Guard((tiny_llama(seed=3), tokenizer))
    pairs = [(p, "some answer " * (i + 1)) for i, p in enumerate(PROMPTS)]
    unbounded = guard.score_batch(pairs, batch_size=5)
    seen: list[tuple[int, int]] = []  # (rows, longest row) of each forward+backward
    real = guard.scorer.score_batch

    def spy(items, **kw):
        seen.append((len(items), max(int(ids.shape[1]) for ids, _ in items)))
        return real(items, **kw)

    monkeypatch.setattr(guard.scorer, "score_batch", spy)
    monkeypatch.setattr(batching, "token_budget", lambda model: 130)
    monkeypatch.setattr(batching, "MIN_FILL", 0.0)  # the budget alone splits here
    bounded = guard.score_batch(pairs, batch_size=5)
    assert sum(r for r, _ in seen) == 5 and 1 < len(seen) < 5, seen  # split, but not one by one
    assert all(rows == 1 or rows * longest <= 130 for rows, longest in seen), seen
    for a, b in zip(unbounded, bounded, strict=True):
        assert b.epistemic == pytest.approx(a.epistemic, rel=1e-6)
        assert b.mean_token_prob == pytest.approx(a.mean_token_prob, rel=1e-6)


def test_score_batch_keeps_rows_of_like_length_together(tokenizer, monkeypatch) -> None:
    """Every scoring batch holds rows of at least MIN_FILL of its longest, and the scores are
    those of each pair scored alone."""
    guard = Guard((tiny_llama(seed=3), tokenizer))
    pairs = [("Q?", "word " * n) for n in (1, 40, 2, 38, 20, 3, 21)]
    whole = guard.score_batch(pairs, batch_size=1)
    seen: list[list[int]] = []
    real = guard.scorer.score_batch

    def spy(items, **kw):
        seen.append([int(ids.shape[1]) for ids, _ in items])
        return real(items, **kw)

    monkeypatch.setattr(guard.scorer, "score_batch", spy)
    got = guard.score_batch(pairs, batch_size=8)
    assert 1 < len(seen) < len(pairs) and all(min(b) >= batching.MIN_FILL * max(b) for b in seen), seen
    assert [s.epistemic for s in got] == pytest.approx([s.epistemic for s in whole], rel=1e-6)


def test_score_dataset_batch_4_writes_the_records_of_batch_1(tiny_dir: Path, tmp_path: Path) -> None:
    guard = Guard(str(tiny_dir))
    items = _mixed_items(tmp_path)
    one = score_dataset(guard, items, tmp_path / "b1.jsonl", batch_size=1, progress=False, max_new_tokens=8)
    four = score_dataset(guard, items, tmp_path / "b4.jsonl", batch_size=4, progress=False, max_new_tokens=8)
    assert len(ScoreCache(tmp_path / "b4.jsonl").entries) == len(items)
    assert {r.kind for r in one} == {"qa", "mc", "labelled"} and all(r.error is None for r in one)
    for a, b in zip(one, four, strict=True):
        da, db = asdict(a), asdict(b)
        for k in ("seconds", "scores", "option_probs"):
            da.pop(k), db.pop(k)
        assert da == db
        assert b.option_probs == (pytest.approx(a.option_probs, rel=1e-6) if a.option_probs else None)
        for k in NUMERIC:
            assert b.scores[k] == pytest.approx(a.scores[k], rel=1e-6, nan_ok=True), (a.id, k)
        assert b.scores["token_probs"] == pytest.approx(a.scores["token_probs"], rel=1e-6)


def test_one_unscorable_item_does_not_sink_its_batch(tiny_dir: Path, tmp_path: Path) -> None:
    lab = tmp_path / "lab.jsonl"
    lab.write_text("".join(json.dumps({"id": f"l{i}", "prompt": "long " * 300 if i == 1 else f"Say {i}",
                                       "response": "ok", "label": 1}) + "\n" for i in range(3)))
    recs = score_dataset(Guard(str(tiny_dir)), load_dataset("jsonl", lab).items, batch_size=3, progress=False)
    assert [r.error is None for r in recs] == [True, False, True] and "context" in recs[1].error


# --------------------------------------------------------------------------- device and dtype


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16),
                                         ("float16", torch.float16), ("fp16", torch.float16),
                                         ("torch.float32", torch.float32), (None, torch.float32),
                                         (torch.bfloat16, torch.bfloat16)])
def test_dtype_names(name, dtype) -> None:
    assert resolve_dtype(name) == dtype


@pytest.mark.parametrize("bad", ["float8", "int8", torch.int64, 3])
def test_unknown_dtype_is_an_input_error(bad) -> None:
    with pytest.raises(InputError, match="dtype"):
        resolve_dtype(bad)


@pytest.mark.parametrize("bad", ["tpu", "gpu0", "mps"])
def test_unknown_device_is_an_input_error(bad) -> None:
    with pytest.raises(InputError, match="device"):
        resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_an_input_error(tokenizer) -> None:
    with pytest.raises(InputError, match="no CUDA GPU"):
        Guard((tiny_llama(), tokenizer), device="cuda")


def test_bf16_keeps_the_fingerprint_and_stays_close_to_fp32(tokenizer) -> None:
    fp32, bf16_model = tiny_llama(), tiny_llama()
    g32 = Guard((fp32, tokenizer))
    g16 = Guard((bf16_model, tokenizer), dtype="bf16")
    assert next(bf16_model.parameters()).dtype == torch.bfloat16
    assert g16.info.fingerprint == g32.info.fingerprint == fingerprint(tiny_llama())
    for prompt, response in [("Hello there", "General Kenobi"), ("What is 2+2?", "It is four, I think.")]:
        a, b = g32.score(prompt, response), g16.score(prompt, response)
        assert b.valid and isinstance(b.epistemic, float)
        # Measured on this tiny model: p̄ within ~1e-4 relative, epistemic within ~2e-3.
        assert b.mean_token_prob == pytest.approx(a.mean_token_prob, rel=1e-3)
        assert b.epistemic == pytest.approx(a.epistemic, rel=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_matches_cpu(tokenizer) -> None:
    cpu = Guard((tiny_llama(tie=False), tokenizer), max_new_tokens=8)
    gpu = Guard((tiny_llama(tie=False), tokenizer), max_new_tokens=8, device="cuda")
    kw = no_blank(tokenizer)
    assert _replies(gpu.generate_batch(PROMPTS, batch_size=5, **kw)) == _replies(
        [cpu.generate(p, **kw) for p in PROMPTS])
    a, b = cpu.score("Hello", "there"), gpu.score("Hello", "there")
    assert b.epistemic == pytest.approx(a.epistemic, rel=1e-4)
    assert gpu.option_probs("Pick", ["a", "bb"]) == pytest.approx(cpu.option_probs("Pick", ["a", "bb"]), rel=1e-4)
