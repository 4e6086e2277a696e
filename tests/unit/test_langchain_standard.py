"""LangChain's own standard unit tests (``langchain-tests``) for GuardedChatModel on a tiny model.

The tiny tokenizer gets a ChatML template that renders tools, so the tool-calling surface is
exercised too (SmolLM2-135M's template has no tools: see the integration suite).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests

from guarduq import Guard
from guarduq.integrations.langchain import GuardedChatModel
from tests.conftest import TOOL_CHATML, make_tokenizer, tiny_llama


@cache
def tiny_tool_guard() -> Guard:
    """One tiny random Guard for the whole class (the suite builds many chat models)."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOL_CHATML
    return Guard((tiny_llama(seed=3), tokenizer), max_new_tokens=8)


class TestGuardedChatModelUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[GuardedChatModel]:
        return GuardedChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"guard": tiny_tool_guard()}

    @property
    def has_tool_calling(self) -> bool:
        return True  # this tokenizer's template renders tools

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False  # text-only causal LMs

    @property
    def supports_model_override(self) -> bool:
        return False  # one GuardedChatModel runs the one model its Guard loaded
