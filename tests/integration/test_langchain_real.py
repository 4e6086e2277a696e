"""examples/langchain_chatbot.py's chain on the real SmolLM2: two short turns (invoke, stream)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from guarduq.integrations.langchain import GuardedChatModel, GuardUQCallbackHandler

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langchain_chatbot.py"
QUESTION = "What is the capital of France?"


def load_example():
    spec = importlib.util.spec_from_file_location("langchain_chatbot", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chatbot_chain_on_real_model_scores_what_it_says(real_guard):
    example = load_example()
    chain = example.build_chain(GuardedChatModel(guard=real_guard, max_tokens=24))
    handler = GuardUQCallbackHandler(real_guard)

    *answer, record = example.ask(chain, QUESTION, [], handler)
    (text,) = answer
    assert text.strip() and "Paris" in text
    messages = [{"role": "system", "content": example.SYSTEM}, {"role": "user", "content": QUESTION}]
    direct = real_guard.score(messages, text, ended=record.payload["ended"])
    assert record.payload["scored_by"] == "model"  # the handler reused the model's own scores
    assert (record.scores.epistemic, record.scores.n_tokens) == (direct.epistemic, direct.n_tokens)

    *pieces, streamed = example.ask(chain, QUESTION, [], handler, stream=True)
    assert len(pieces) > 1 and "".join(pieces) == text  # greedy: the same reply, token by token
    assert streamed.scores.epistemic == direct.epistemic
