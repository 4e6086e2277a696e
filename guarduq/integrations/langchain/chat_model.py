"""GuardedChatModel: a LangChain chat model whose every reply carries guarduq's scores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import (
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
)
from pydantic import ConfigDict, Field, model_validator

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.errors import InputError
from guarduq.guard import Guard, GuardedResponse
from guarduq.integrations.langchain.common import (
    METADATA_KEY,
    metadata,
    shown_text,
    to_chat_messages,
    with_policy,
)
from guarduq.layout import PromptLike
from guarduq.models import DEFAULT_MODEL

log = get_logger("langchain")


class GuardedChatModel(BaseChatModel):
    """A LangChain chat model whose every reply carries guarduq's scores and decision.

    Chat messages (system ones included) go through the tokenizer's chat template. ``stop``
    strings end the reply before the stop string; the model did not close its turn there, so
    such a reply is scored with ``ended=False`` (as is one cut by ``max_tokens``).
    ``temperature`` 0 (default) decodes greedily; the scores are always at temperature 1.

    Streaming yields tokens as they are generated and attaches the metadata to the last chunk.
    When the Guard's policy enforces decisions, the text is first checked and then streamed, so
    a withheld answer never reaches the user; ``stream_unchecked=True`` streams it live instead,
    and the caller must act on the decision in the last chunk.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    guard: Guard = Field(default_factory=lambda: Guard(DEFAULT_MODEL))
    policy: Any = Field(None, description="a Policy or YAML path; shortcut for Guard(..., policy=...)")
    max_tokens: int | None = Field(None, ge=1, description="default: the Guard's max_new_tokens")
    temperature: float = Field(0.0, ge=0.0)
    stop: list[str] | None = None
    stream_unchecked: bool = False

    @model_validator(mode="after")
    def _attach_policy(self) -> GuardedChatModel:
        if self.policy is not None:
            self.guard = with_policy(self.guard, self.policy)
            self.policy = None  # it lives on the Guard now
        return self

    @property
    def _llm_type(self) -> str:
        return "guarduq"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        policy = self.guard.policy
        return {
            "model_name": self.guard.info.name,
            "model_fingerprint": self.guard.info.fingerprint,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "policy": f"{policy.name}@{policy.version}" if policy is not None else None,
        }

    # -- LangChain's hooks

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt = to_chat_messages(messages)
        r = _last(self.guard.stream(prompt, **self._settings(stop, kwargs)))
        message = AIMessage(content=shown_text(r), **self._annotations(prompt, r))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt = to_chat_messages(messages)
        policy = self.guard.policy
        live = self.stream_unchecked or policy is None or policy.shadow
        for item in self.guard.stream(prompt, **self._settings(stop, kwargs)):
            if isinstance(item, str):
                if live:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=item))
                continue
            content = "" if live else shown_text(item)
            last = AIMessageChunk(content=content, chunk_position="last", **self._annotations(prompt, item))
            yield ChatGenerationChunk(message=last)

    # -- helpers

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Guard.stream arguments from LangChain's: stop, max_tokens, temperature, the rest as is."""
        kwargs = dict(kwargs)
        max_tokens = kwargs.pop("max_tokens", self.max_tokens)
        temperature = kwargs.pop("temperature", self.temperature)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise InputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if temperature is not None and (not isinstance(temperature, int | float) or temperature < 0):
            raise InputError(f"temperature must be >= 0, got {temperature!r}")
        settings: dict[str, Any] = {"stop": [*(self.stop or []), *(stop or [])], **kwargs}
        if max_tokens is not None:
            settings["max_new_tokens"] = max_tokens
        if temperature:
            settings.update(do_sample=True, temperature=float(temperature))
        return settings

    def _annotations(self, prompt: PromptLike, r: GuardedResponse) -> dict[str, Any]:
        tok = self.guard.tokenizer
        n_in = len(layout.prompt_ids(tok, prompt))
        n_out = len(tok(r.text, add_special_tokens=False)["input_ids"]) + int(r.ended)
        return {
            "response_metadata": {"model_name": self.guard.info.name, METADATA_KEY: metadata(r, "model")},
            "usage_metadata": UsageMetadata(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out),
        }


def _last(items: Iterator[str | GuardedResponse]) -> GuardedResponse:
    for item in items:
        if isinstance(item, GuardedResponse):
            return item
    raise RuntimeError("Guard.stream ended without a response")  # a broken invariant, not user error

