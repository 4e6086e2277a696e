"""Shared fixtures: tiny random models and a byte-level tokenizer built locally (no downloads)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Hypothesis profiles: "ci" (default, `make test`) and "fuzz" (`make fuzz`, HYPOTHESIS_PROFILE=fuzz).
# "ci" is derandomised: `make test` replays the same inputs on every run, so a commit's CI verdict is
# its own; fresh exploration is `make fuzz`'s job (random, 20x the examples), and what it finds is
# pinned with @example. No deadline: timing on shared CI cores is noise; hangs are caught by
# tests/unit/fuzz_support.alarm.
_COMMON = {
    "deadline": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                              HealthCheck.function_scoped_fixture],
}
settings.register_profile("ci", derandomize=True, **_COMMON)  # derandomize also turns the example database off
settings.register_profile("fuzz", **_COMMON)  # random, and failures are saved in .hypothesis/ and replayed
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist (`make test` runs two workers) the workers share the cores: torch's intra-op
# pool would otherwise give each worker one thread per core and oversubscribe them.
# The servers, calibrate runs and Ray workers the tests start inherit the same share.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux / elsewhere
    _THREADS = max(1, _CORES // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML that also renders tools (as Hermes/Qwen-style templates do): for tool-calling tests.
TOOL_CHATML = (
    "{% if tools %}<|im_start|>system\nTools (call one as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>):\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}" + CHATML
)


def load_benchmark(name: str, as_name: str | None = None) -> Any:
    """``benchmarks/<name>.py`` as a module (the scripts are not a package); registered under
    ``as_name`` when given (dataclasses in it need their module in ``sys.modules``)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(as_name or f"{name}_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    if as_name:
        sys.modules[as_name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: every byte is a token, plus ChatML specials (vocab 261)."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        fast.chat_template = CHATML
    return fast


VOCAB = len(SPECIALS) + 256


def tiny_llama(seed: int = 0, tie: bool = True, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
        bos_token_id=1, eos_token_id=2,
    )
    return GPT2LMHeadModel(cfg).eval()


def tiny_gemma(seed: int = 0) -> Gemma3ForCausalLM:
    """Gemma-3 style: scaled tied embeddings, (1+w) RMSNorms incl. q/k norms, a sliding window
    (8) shorter than the sequences, logit soft-capping."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma initialises its norm weights at 0 (scale 1 + w): make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2.5's architecture, tiny: biased q/k/v projections (trained ones are not zero)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # Qwen2 initialises its projection biases to zero
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer(chat_template=True)


@pytest.fixture
def plain_tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer(chat_template=False)


@pytest.fixture
def llama() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture
def gpt2() -> GPT2LMHeadModel:
    return tiny_gpt2()


@pytest.fixture(autouse=True)
def _isolated_cache(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unit tests never touch the user's ~/.cache; integration tests share the real one."""
    if request.node.get_closest_marker("integration"):
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a ``long`` test first, then those with a ``slow`` one (a stable sort, so each
    file's tests stay together and its module fixtures load once): under xdist the workers then
    start on the longest files and finish together, rather than one worker running the
    walkthrough alone at the end."""
    rank: dict[Path, int] = {}
    for item in items:
        mark = 0 if item.get_closest_marker("long") else 1 if item.get_closest_marker("slow") else 2
        rank[item.path] = min(rank.get(item.path, 2), mark)
    items.sort(key=lambda item: rank[item.path])


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, sum the workers' fuzz input counts for the summary."""
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_FuzzCountsAcrossWorkers(), "guarduq-fuzz-counts")


class _FuzzCountsAcrossWorkers:
    """Each xdist worker tallies its own fuzz inputs; they are sent to the controller, which
    prints the summary below."""

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from tests.unit.fuzz_support import COUNTS, OUTCOMES

        out = getattr(session.config, "workeroutput", None)
        if out is not None:  # in a worker
            out["fuzz_counts"], out["fuzz_outcomes"] = dict(COUNTS), dict(OUTCOMES)

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        from tests.unit.fuzz_support import COUNTS, OUTCOMES

        out = getattr(node, "workeroutput", {})
        COUNTS.update(out.get("fuzz_counts", {}))
        OUTCOMES.update(out.get("fuzz_outcomes", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The number of generated fuzz inputs per boundary (tests/unit/test_fuzz_*.py)."""
    from tests.unit.fuzz_support import COUNTS, OUTCOMES, PROFILE

    if not COUNTS:
        return
    terminalreporter.write_sep("-", f"fuzz inputs per boundary (profile {PROFILE})")
    for boundary, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{boundary:<32} {n:>8,}")
    terminalreporter.write_line(f"{'total':<32} {sum(COUNTS.values()):>8,}")
    if os.environ.get("FUZZ_OUTCOMES"):  # how each boundary's inputs ended (ok / which error)
        for outcome, n in sorted(OUTCOMES.items()):
            terminalreporter.write_line(f"  {outcome:<60} {n:>8,}")


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``uvicorn.run`` was called with (nothing is served: CLI tests of ``guarduq serve``)."""
    uvicorn = pytest.importorskip("uvicorn")
    got: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.update(app=app, **kw))
    return got


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama and its chat tokenizer saved as an HF folder (for CLI tests: --model DIR)."""
    d = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(seed=0).save_pretrained(d)
    make_tokenizer(chat_template=True).save_pretrained(d)
    return d


# --------------------------------------------------------------------------- PostgreSQL
# One throwaway server per test session (tests/store, tests/review, serve), started by
# tests/pg_server.py (shared with benchmarks/store_load.py). Skipped only where it cannot start.


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """``postgresql+psycopg://postgres@127.0.0.1:PORT/guarduq_test`` on a fresh server."""
    from tests.pg_server import temporary_postgres, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with temporary_postgres("guarduq_test") as url:
        yield url


@pytest.fixture
def pg_database_url(postgres_url: str) -> Iterator[str]:
    """A fresh, empty database on the session's server for one test (dropped after it)."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = postgres_url.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    yield postgres_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
