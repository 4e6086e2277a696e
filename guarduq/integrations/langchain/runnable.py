"""guard_runnable: a Runnable that scores a chain's output and applies the Guard's policy."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from langchain_core.callbacks import (
    BaseCallbackHandler,
    CallbackManagerForChainRun,
)
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import (
    Generation,
    LLMResult,
)
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import patch_config, run_in_executor

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.errors import GuardUQAbstention, GuardUQError, InputError
from guarduq.guard import Guard
from guarduq.integrations.langchain.common import (
    METADATA_KEY,
    PolicyLike,
    _ended,
    _payload_of,
    to_chat_messages,
    with_policy,
)
from guarduq.layout import PromptLike
from guarduq.policy import Decision

log = get_logger("langchain")


@dataclass(frozen=True)
class GuardedOutput:
    """With ``details=True``: the (possibly replaced) output and guarduq's record of it."""

    output: Any
    metadata: dict[str, Any]


class _LastLLMCall(BaseCallbackHandler):
    """Remembers the prompt and generation of the last LLM call inside one guarded run."""

    raise_error = False
    run_inline = True  # cheap; keeps the record ready before the chain returns

    def __init__(self) -> None:
        self._pending: dict[uuid.UUID, PromptLike | Exception] = {}
        self.prompt: PromptLike | Exception | None = None
        self.generation: Generation | None = None

    def on_chat_model_start(self, serialized: Any, messages: list[list[BaseMessage]], *,
                            run_id: uuid.UUID, **kwargs: Any) -> None:
        try:
            self._pending[run_id] = to_chat_messages(messages[0])
        except Exception as exc:
            self._pending[run_id] = exc

    def on_llm_start(self, serialized: Any, prompts: list[str], *, run_id: uuid.UUID, **kwargs: Any) -> None:
        self._pending[run_id] = prompts[0]

    def on_llm_end(self, response: LLMResult, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        self.prompt = self._pending.pop(run_id, None)
        self.generation = response.generations[0][0] if response.generations and response.generations[0] else None


class GuardedRunnable(Runnable[Any, Any]):
    """See :func:`guard_runnable`."""

    def __init__(self, chain: Runnable[Any, Any], guard: Guard, *, raise_on_abstain: bool = False,
                 details: bool = False) -> None:
        self.chain = chain
        self.guard = guard
        self.raise_on_abstain = raise_on_abstain
        self.details = details
        self.name = f"Guarded({chain.get_name()})"

    @property
    def InputType(self) -> Any:  # noqa: N802 (LangChain's name)
        return self.chain.InputType

    @property
    def OutputType(self) -> Any:  # noqa: N802
        return Any

    def get_input_schema(self, config: RunnableConfig | None = None) -> Any:
        return self.chain.get_input_schema(config)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    def _invoke(self, input: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig,
                **kwargs: Any) -> Any:
        seen = _LastLLMCall()
        output = self.chain.invoke(input, self._child_config(config, run_manager, seen), **kwargs)
        return self._judge(input, output, seen)

    async def _ainvoke(self, input: Any, run_manager: Any, config: RunnableConfig, **kwargs: Any) -> Any:
        seen = _LastLLMCall()
        output = await self.chain.ainvoke(input, self._child_config(config, run_manager, seen), **kwargs)
        return await run_in_executor(config, self._judge, input, output, seen)

    @staticmethod
    def _child_config(config: RunnableConfig, run_manager: Any, seen: _LastLLMCall) -> RunnableConfig:
        callbacks = run_manager.get_child()
        callbacks.add_handler(seen, inherit=True)
        return patch_config(config, callbacks=callbacks)

    def _judge(self, input: Any, output: Any, seen: _LastLLMCall) -> Any:
        """score -> decide (inside the Guard) -> pass, replace or raise."""
        text = _output_text(output, seen.generation)
        ended = _ended(seen.generation) if seen.generation is not None else True
        try:
            prompt = _prompt_of(input, seen.prompt)
            r = self.guard.guarded(prompt, text, ended=ended)
        except GuardUQAbstention:
            raise
        except GuardUQError as exc:
            if self.guard.policy is None:
                raise
            log.warning("guard_runnable_scoring_failed", error=f"{type(exc).__name__}: {exc}")
            decision = self.guard.policy.on_error_decision("scoring", exc, response=text)
            return self._apply(output, decision, {"scored_by": "scorer", "error": str(exc), "scores": None,
                                                  "risk": None, "decision": decision.to_dict()})
        return self._apply(output, r.decision, r.metadata(self._scored_by(seen.generation)))

    def _scored_by(self, generation: Generation | None) -> str:
        """"model" when the chain's reply came from the Guard's own model, else "scorer"."""
        own = _payload_of(generation) if generation is not None else None
        return "model" if own and own.get("model_fingerprint") == self.guard.info.fingerprint else "scorer"

    def _apply(self, output: Any, decision: Decision | None, meta: dict[str, Any]) -> Any:
        if decision is not None and not decision.shown:
            if self.raise_on_abstain or not isinstance(output, str | BaseMessage):
                raise GuardUQAbstention(decision.text, decision)
            output = decision.text if isinstance(output, str) else AIMessage(content=decision.text)
        if isinstance(output, BaseMessage):
            output = output.model_copy(update={"response_metadata": {**output.response_metadata, METADATA_KEY: meta}})
        return GuardedOutput(output, meta) if self.details else output


def guard_runnable(
    chain: Runnable[Any, Any],
    guard: Guard,
    *,
    policy: PolicyLike = None,
    raise_on_abstain: bool = False,
    details: bool = False,
) -> GuardedRunnable:
    """A ``Runnable`` that runs ``chain``, scores its output and applies the Guard's policy.

    The output is scored against the prompt the chain's last LLM call actually saw (captured
    with a callback), or, when the chain calls no LLM, against the input itself. The text scored
    is the output when it is a string or a message, else the last LLM call's text.

    * allow: the output passes unchanged (a message gets ``response_metadata["guarduq"]``);
    * abstain, or escalate with the answer held: the output is replaced by the policy's message
      (a string for a string, an ``AIMessage`` for a message); with ``raise_on_abstain`` (or
      when the output is structured data that a message cannot stand in for) a
      ``GuardUQAbstention`` carrying the decision is raised instead;
    * escalate: the policy hands the case to its sink; second opinion: the policy runs the
      ensemble the Guard was given.

    A scoring failure gives the policy's ``on_error`` decision (without a policy it raises).
    ``details=True`` returns :class:`GuardedOutput` (output + metadata) instead of the output.
    Composes like any Runnable (``|``, ``with_config``, ``batch``, ``ainvoke``); ``stream``
    yields the one guarded output at the end, since the verdict needs the whole text.
    """
    return GuardedRunnable(chain, with_policy(guard, policy), raise_on_abstain=raise_on_abstain, details=details)


def _output_text(output: Any, generation: Generation | None) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, BaseMessage):
        return str(output.text)
    if generation is not None:
        return generation.text
    raise InputError(f"cannot find the text to score in a {type(output).__name__} output without an LLM call")


def _prompt_of(input: Any, seen: PromptLike | Exception | None) -> PromptLike:
    if isinstance(seen, Exception):
        raise seen
    if seen is not None:
        return seen
    if isinstance(input, PromptValue):
        return to_chat_messages(input.to_messages())
    if isinstance(input, Sequence) and input and all(isinstance(m, BaseMessage) for m in input):
        return to_chat_messages(cast(Sequence[BaseMessage], input))
    return layout.validate_prompt(input)

