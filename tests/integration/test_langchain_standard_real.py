"""LangChain's own standard integration tests (``langchain-tests``) on the real SmolLM2-135M.

Capabilities are declared as they are on this model: no tools (its chat template renders none,
so ``bind_tools`` raises), structured output and JSON mode through schema-guided decoding,
exact usage metadata, text only, one model per GuardedChatModel (no per-call override).
The suite makes ~80 model calls, so it is kept lean: replies of at most 10 tokens, and a Guard
that shares the session's loaded SmolLM2 but takes its epistemic gradient over the last block
only (the backward pass stops there); what is tested here is LangChain conformance, the full
scorer is tested elsewhere.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from guarduq import Guard
from guarduq.errors import InputError
from guarduq.integrations.langchain import GuardedChatModel
from guarduq.models import LoadedModel
from tests.integration.conftest import load_real_guard

pytestmark = pytest.mark.integration


@cache
def lean_guard() -> Guard:
    """The session's SmolLM2 (shared weights), scored over its last transformer block only."""
    real = load_real_guard()
    return Guard(LoadedModel(real.model, real.tokenizer, real.info), last_n_blocks=1)


class TestGuardedChatModelIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[GuardedChatModel]:
        return GuardedChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"guard": lean_guard()}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {**super().standard_chat_model_params, "max_tokens": 10}

    @property
    def has_tool_calling(self) -> bool:
        return False  # SmolLM2-135M-Instruct's chat template has no tools

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
    def supports_model_override(self) -> bool:
        return False


def test_bind_tools_on_smollm2_says_its_template_has_no_tools():
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with pytest.raises(InputError, match="does not support tools"):
        GuardedChatModel(guard=load_real_guard()).bind_tools([add])
