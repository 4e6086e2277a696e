"""LangChain integration (``langchain-core`` only): a guarded chat model, a callback handler,
and a guard around any chain.

* :class:`GuardedChatModel` is a chat model around a local model loaded by guarduq. Every reply
  is scored in guarduq's one token layout, and its ``AIMessage.response_metadata["guarduq"]``
  carries the scores, the calibrated risk and the policy's decision (``usage_metadata`` has the
  token counts). ``invoke``/``batch``/``stream`` and their async forms all work.
* :class:`GuardUQCallbackHandler` watches any chain (``config={"callbacks": [handler]}``) and
  scores each LLM or chat-model generation against its prompt. Generations of a
  ``GuardedChatModel`` already carry their scores and are reused. Any other model (a remote API,
  say) is scored by a local **scorer model** by teacher forcing: this measures *the local
  model's* uncertainty about that text, not the remote model's, whose weights it never sees.
  The handler observes and annotates; it never changes the chain's output and never breaks it.
* :func:`guard_runnable` wraps a chain in a ``Runnable`` that scores the chain's output and
  applies the Guard's policy: allow passes the output, abstain replaces it with the policy's
  message (or raises ``GuardUQAbstention``), escalate hands the case to the policy's sink,
  second opinion runs the ensemble the Guard was given.

Policies live on the :class:`~guarduq.Guard` (``Guard(model, policy=..., calibrator=...,
second_opinion=..., sinks=...)``); the ``policy=`` argument accepted here is a shortcut that
builds such a Guard around the same loaded model. Without any policy everything still works,
with scores only (``risk`` and ``decision`` are then ``None``).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from langchain_core.callbacks import (
    BaseCallbackHandler,
    CallbackManagerForChainRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    LLMResult,
)
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import patch_config, run_in_executor
from pydantic import ConfigDict, Field, model_validator

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.errors import GuardUQAbstention, GuardUQError, InputError, PolicyError
from guarduq.guard import Guard, GuardedResponse
from guarduq.layout import PromptLike
from guarduq.models import DEFAULT_MODEL, LoadedModel
from guarduq.policy import Decision, Policy
from guarduq.scoring.uncertainty import Scores

log = get_logger("langchain")

METADATA_KEY = "guarduq"  # the key under response_metadata / generation_info
PolicyLike = Policy | str | os.PathLike[str] | None

# --------------------------------------------------------------------------- shared pieces

_ROLES = {
    "human": "user", "user": "user",
    "ai": "assistant", "assistant": "assistant",
    "system": "system", "developer": "system",
    "tool": "tool", "function": "tool",
}


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as guarduq ``{"role", "content"}`` messages (text content only)."""
    out = []
    for i, m in enumerate(messages):
        kind = m.role if isinstance(m, ChatMessage) else m.type
        role = _ROLES.get(kind)
        if role is None:
            raise InputError(f"message {i}: cannot map a {kind!r} message to a chat role")
        out.append({"role": role, "content": str(m.text)})
    return out


def with_policy(guard: Guard, policy: PolicyLike) -> Guard:
    """``guard`` itself, or a Guard with ``policy`` on the same loaded model (shared weights).

    The new Guard keeps the scorer's parameter selection, calibrator, audit log and settings;
    for sinks or a second opinion, build the Guard with them and pass no ``policy`` here.
    """
    if policy is None:
        return guard
    if not isinstance(guard, Guard):
        raise InputError(f"guard must be a guarduq.Guard, got {type(guard).__name__}")
    if guard.policy is not None:
        raise PolicyError(
            f"the Guard already has policy {guard.policy.name!r}; pass a policy to the Guard or "
            "here, not both"
        )
    return Guard(
        LoadedModel(guard.model, guard.tokenizer, guard.info),
        parameters=guard.scorer.parameters,
        last_n_blocks=guard.scorer.last_n_blocks,
        max_new_tokens=guard.max_new_tokens,
        policy=policy,
        calibrator=guard.calibrator,
        audit=guard.audit,
        raise_on_abstain=guard.raise_on_abstain,
    )


def metadata(r: GuardedResponse, scored_by: str) -> dict[str, Any]:
    """The JSON-ready record attached to a LangChain message or generation.

    ``scored_by`` is ``"model"`` when the scores are the generating model's own, ``"scorer"``
    when a local model read someone else's text by teacher forcing.
    """
    return {
        "request_id": r.request_id,
        "scored_by": scored_by,
        "model": r.model.name,
        "model_fingerprint": r.model.fingerprint,
        "ended": r.ended,
        "scores": r.scores.to_dict(with_token_probs=False),
        "risk": r.risk,
        "decision": r.decision.to_dict() if r.decision is not None else None,
        "timings": dict(r.timings),
    }


def shown_text(r: GuardedResponse) -> str:
    """What the user should see: the policy's text when there is a decision, else the reply."""
    return r.decision.text if r.decision is not None else r.text


def _payload_of(generation: Generation) -> dict[str, Any] | None:
    """The metadata a ``GuardedChatModel`` attached to its own generation, if any."""
    info = dict(generation.generation_info or {})
    if isinstance(generation, ChatGeneration):
        info = {**generation.message.response_metadata, **info}
    payload = info.get(METADATA_KEY)
    return dict(payload) if isinstance(payload, Mapping) and "scores" in payload else None


def _ended(generation: Generation) -> bool:
    """Whether a generation closed its turn: not when its provider reports a length cut."""
    info = generation.generation_info or {}
    if isinstance(generation, ChatGeneration):
        info = {**generation.message.response_metadata, **info}
    reason = info.get("finish_reason") or info.get("stop_reason")
    return str(reason).lower() not in {"length", "max_tokens"}


# --------------------------------------------------------------------------- 1. the chat model


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


# --------------------------------------------------------------------------- 2. the callback handler


@dataclass(frozen=True)
class GuardRecord:
    """guarduq's verdict on one generation of one LLM run (``payload`` is the attached metadata)."""

    run_id: uuid.UUID
    prompt_index: int
    generation_index: int
    text: str
    payload: dict[str, Any]

    @property
    def scores(self) -> Scores | None:
        s = self.payload.get("scores")
        return Scores.from_dict(s) if s is not None else None

    @property
    def risk(self) -> float | None:
        return self.payload.get("risk")

    @property
    def decision(self) -> dict[str, Any] | None:
        return self.payload.get("decision")

    @property
    def error(self) -> str | None:
        return self.payload.get("error")


class GuardUQCallbackHandler(BaseCallbackHandler):
    """Scores every LLM/chat-model generation in a chain; never changes or breaks the chain.

    ``scorer`` is a Guard or a model spec (default: the default model, loaded on first use).
    A generation from a :class:`GuardedChatModel` already carries its own scores and is not
    scored again. Any other generation is scored by the scorer by teacher forcing, which
    measures the *scorer's* uncertainty about that text, not the generating model's.

    The verdict goes into the generation's ``generation_info["guarduq"]`` (and the chat
    message's ``response_metadata``, so ``invoke`` results show it), to structlog, and into
    :meth:`get` by run id: the LLM run's id or the id of any chain run above it. A failure
    (scorer that cannot load, text that cannot be scored) is logged, recorded with its
    ``error`` and, when there is a policy, the policy's ``on_error`` decision.
    """

    raise_error = False

    def __init__(
        self,
        scorer: Guard | str | os.PathLike[str] = DEFAULT_MODEL,
        *,
        policy: PolicyLike = None,
        max_runs: int = 1000,
    ) -> None:
        if max_runs < 1:
            raise InputError(f"max_runs must be >= 1, got {max_runs}")
        self._policy = Policy.from_yaml(policy) if isinstance(policy, str | os.PathLike) else policy
        self._scorer: Guard | None = with_policy(scorer, self._policy) if isinstance(scorer, Guard) else None
        self._spec = None if isinstance(scorer, Guard) else scorer
        self.max_runs = max_runs
        self._prompts: dict[uuid.UUID, list[PromptLike] | Exception] = {}
        self._parents: dict[uuid.UUID, uuid.UUID | None] = {}
        self._records: OrderedDict[uuid.UUID, list[GuardRecord]] = OrderedDict()
        self._lock = threading.Lock()

    # -- reading results

    def get(self, run_id: uuid.UUID | str) -> list[GuardRecord]:
        """Records of the LLM run ``run_id``, or of every LLM run inside the chain run ``run_id``."""
        key = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
        with self._lock:
            return list(self._records.get(key, ()))

    @property
    def scorer(self) -> Guard:
        """The local scoring Guard, loaded on first use."""
        with self._lock:
            if self._scorer is None:
                self._scorer = Guard(self._spec or DEFAULT_MODEL, policy=self._policy)
            return self._scorer

    # -- LangChain's events

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: uuid.UUID,
                       parent_run_id: uuid.UUID | None = None, **kwargs: Any) -> None:
        with self._lock:
            self._parents[run_id] = parent_run_id

    def on_chain_end(self, outputs: Any, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        with self._lock:
            self._parents.pop(run_id, None)

    on_chain_error = on_chain_end  # type: ignore[assignment]

    def on_chat_model_start(self, serialized: Any, messages: list[list[BaseMessage]], *,
                            run_id: uuid.UUID, parent_run_id: uuid.UUID | None = None, **kwargs: Any) -> None:
        try:
            prompts: list[PromptLike] | Exception = [to_chat_messages(m) for m in messages]
        except Exception as exc:  # kept for on_llm_end, which records it against each generation
            prompts = exc
        self._started(run_id, parent_run_id, prompts)

    def on_llm_start(self, serialized: Any, prompts: list[str], *, run_id: uuid.UUID,
                     parent_run_id: uuid.UUID | None = None, **kwargs: Any) -> None:
        self._started(run_id, parent_run_id, list(prompts))

    def on_llm_error(self, error: BaseException, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        with self._lock:
            self._prompts.pop(run_id, None)
            self._parents.pop(run_id, None)

    def on_llm_end(self, response: LLMResult, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        try:
            with self._lock:
                prompts = self._prompts.pop(run_id, None)
                lineage = self._lineage(run_id)
            records = [
                self._verdict(run_id, i, j, prompts, g)
                for i, gens in enumerate(response.generations)
                for j, g in enumerate(gens)
            ]
            with self._lock:
                for rid in lineage:
                    self._records.setdefault(rid, []).extend(records)
                    self._records.move_to_end(rid)
                while len(self._records) > self.max_runs:
                    self._records.popitem(last=False)
        except Exception as exc:  # the chain must go on whatever happens here
            log.error("langchain_callback_failed", run_id=str(run_id), error=f"{type(exc).__name__}: {exc}")

    # -- internals

    def _started(self, run_id: uuid.UUID, parent: uuid.UUID | None, prompts: list[PromptLike] | Exception) -> None:
        with self._lock:
            self._prompts[run_id] = prompts
            self._parents[run_id] = parent

    def _lineage(self, run_id: uuid.UUID) -> list[uuid.UUID]:
        """The LLM run and every run above it that this handler saw start."""
        out, parent = [run_id], self._parents.pop(run_id, None)
        while parent is not None and parent not in out:
            out.append(parent)
            parent = self._parents.get(parent)
        return out

    def _verdict(self, run_id: uuid.UUID, i: int, j: int, prompts: Any, g: Generation) -> GuardRecord:
        payload = _payload_of(g) or self._score(run_id, prompts, i, g)
        g.generation_info = {**(g.generation_info or {}), METADATA_KEY: payload}
        if isinstance(g, ChatGeneration):
            g.message.response_metadata[METADATA_KEY] = payload
        record = GuardRecord(run_id, i, j, g.text, payload)
        scores, decision = payload.get("scores") or {}, payload.get("decision") or {}
        log.info(
            "langchain_scored", run_id=str(run_id), prompt_index=i, generation_index=j,
            scored_by=payload.get("scored_by"), epistemic=scores.get("epistemic"),
            aleatoric=scores.get("aleatoric"), mean_token_prob=scores.get("mean_token_prob"),
            risk=payload.get("risk"), action=decision.get("action"), error=payload.get("error"),
        )
        return record

    def _score(self, run_id: uuid.UUID, prompts: Any, i: int, g: Generation) -> dict[str, Any]:
        try:
            if isinstance(prompts, Exception):
                raise prompts
            if prompts is None or i >= len(prompts):
                raise InputError("the prompt of this generation was not seen (no start event)")
            return metadata(self.scorer.guarded(prompts[i], g.text, ended=_ended(g)), "scorer")
        except GuardUQAbstention as exc:  # the scorer's Guard raises on abstain; here we only record
            decision = exc.decision if isinstance(exc.decision, Decision) else None
            return {"scored_by": "scorer", "decision": decision.to_dict() if decision else None}
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("langchain_scoring_failed", run_id=str(run_id), error=error)
            policy = self._scorer.policy if self._scorer is not None else self._policy
            decision = policy.on_error_decision("scoring", exc, response=g.text) if policy else None
            return {"scored_by": "scorer", "error": error, "scores": None, "risk": None,
                    "decision": decision.to_dict() if decision else None}


# --------------------------------------------------------------------------- 3. a guard around a chain


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
        return self._apply(output, r.decision, metadata(r, self._scored_by(seen.generation)))

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


__all__ = [
    "METADATA_KEY",
    "GuardRecord",
    "GuardUQCallbackHandler",
    "GuardedChatModel",
    "GuardedOutput",
    "GuardedRunnable",
    "guard_runnable",
    "metadata",
    "shown_text",
    "to_chat_messages",
    "with_policy",
]
