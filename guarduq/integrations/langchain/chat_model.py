"""GuardedChatModel: a LangChain chat model whose every reply carries guarduq's scores."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import InvalidToolCall, ToolCall, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, model_validator

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.errors import GuardUQAbstention, InputError
from guarduq.guard import Guard, GuardedResponse
from guarduq.integrations.langchain.common import (
    METADATA_KEY,
    to_chat_messages,
    with_policy,
)
from guarduq.integrations.langchain.structured import JsonWriter, with_instruction, write_tool_call
from guarduq.integrations.langchain.tools import (
    as_openai_tools,
    guard_with_tools,
    parse_tool_calls,
    tool_names,
)
from guarduq.models import DEFAULT_MODEL

STRUCTURED_KEY = "guarduq_structured"  # the bound kwarg that carries a structured-output request
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

    ``with_structured_output`` writes JSON of a schema by schema-guided decoding and
    ``bind_tools`` works where the model's chat template renders tools (see their docstrings);
    a per-call ``model=`` other than the Guard's own is an ``InputError``.
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

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """No: the model holds a loaded Guard (torch weights, policy, audit log), not a config."""
        return False

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangSmith tracing metadata: provider, model name (a per-call ``model`` wins), settings."""
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "guarduq"
        model = kwargs.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.guard.info.name
        params.setdefault("ls_max_tokens", self.guard.max_new_tokens)
        stops = [*(self.stop or []), *(stop or [])]
        if stops:
            params["ls_stop"] = stops
        return params

    # -- structured output and tools

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A runnable that answers with data of ``schema`` (pydantic class, TypedDict or JSON schema).

        ``json_schema`` (default) and ``function_calling`` tell the model the schema and write the
        JSON by schema-guided decoding (see :mod:`.structured`): it always parses to the schema.
        ``json_mode`` does not add the schema to the prompt (your prompt asks for the JSON); with a
        schema the decoding is still guided, without one the reply is parsed as it comes.

        The JSON is scored like any reply: ``include_raw=True`` returns ``{"raw": AIMessage,
        "parsed": ..., "parsing_error": ...}`` whose ``raw.response_metadata["guarduq"]`` holds the
        scores and decision. When the Guard's policy withholds the answer, a
        ``GuardUQAbstention`` is raised (a message cannot stand in for data).
        """
        if kwargs:
            raise InputError(f"with_structured_output: unsupported arguments {sorted(kwargs)}")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise InputError(f"with_structured_output: unknown method {method!r}")
        if schema is None and method != "json_mode":
            raise InputError(f"with_structured_output: method {method!r} needs a schema")
        json_schema = None if schema is None else _json_schema(schema)
        bound: dict[str, Any] = {STRUCTURED_KEY: {"schema": json_schema, "method": method}}
        if schema is not None:
            bound["ls_structured_output_format"] = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        llm = self.bind(**bound)
        parser: Runnable[Any, Any]
        if isinstance(schema, type) and is_basemodel_subclass(schema):
            parser = PydanticOutputParser(pydantic_object=schema)
        else:
            parser = JsonOutputParser()
        if not include_raw:
            return llm | parser
        assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = assign.with_fallbacks([RunnablePassthrough.assign(parsed=lambda _: None)],
                                         exception_key="parsing_error")
        return RunnableMap(raw=llm) | fallback

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools, if the model's chat template renders them; else an ``InputError`` says so.

        ``tool_choice`` ``None``/``"auto"``: the model answers or calls a tool, as it likes;
        ``"any"``/``"required"``/``True``/a tool name: a call is written by schema-guided
        decoding (the model picks the tool among those allowed and fills its arguments).
        """
        specs = as_openai_tools(tools)
        guard_with_tools(self.guard, specs)  # fails early, with the reason, on a template without tools
        if tool_choice == "none":  # no call may be made: the model is not shown the tools
            return self.bind(**kwargs)
        return self.bind(tools=specs, tool_choice=_forced_names(tool_choice, tool_names(specs)), **kwargs)

    # -- LangChain's hooks

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs)
        if request.special:
            return ChatResult(generations=[ChatGeneration(message=self._special_reply(request))])
        r = _last(request.guard.stream(request.prompt, **request.settings))
        message = AIMessage(content=r.shown_text, **self._annotations(request, r))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        if request.special:  # data and tool calls come whole, in one chunk
            message = self._special_reply(request)
            chunks = [tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                      for i, c in enumerate(message.tool_calls)]
            yield ChatGenerationChunk(message=AIMessageChunk(
                content=message.content, tool_call_chunks=chunks, chunk_position="last",
                response_metadata=message.response_metadata, usage_metadata=message.usage_metadata,
            ))
            return
        policy = request.guard.policy
        live = self.stream_unchecked or policy is None or policy.shadow
        for item in request.guard.stream(request.prompt, **request.settings):
            if isinstance(item, str):
                if live:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=item))
                continue
            content = "" if live else item.shown_text
            last = AIMessageChunk(content=content, chunk_position="last", **self._annotations(request, item))
            yield ChatGenerationChunk(message=last)

    # -- helpers

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Request:
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None)
        if model is not None and model not in (self.guard.info.name, self.guard.info.fingerprint):
            raise InputError(
                f"GuardedChatModel runs its Guard's model {self.guard.info.name!r}; a per-call model "
                f"({model!r}) is not supported: build a GuardedChatModel on a Guard of that model"
            )
        structured = kwargs.pop(STRUCTURED_KEY, None) or {}
        specs = kwargs.pop("tools", None) or []
        forced = kwargs.pop("tool_choice", None)
        guard = guard_with_tools(self.guard, specs) if specs else self.guard
        prompt: list[dict[str, str]] = to_chat_messages(messages)
        schema = structured.get("schema")
        if schema is not None and structured.get("method") != "json_mode":
            prompt = with_instruction(prompt, schema)
        return _Request(guard, prompt, self._settings(stop, kwargs), schema, specs, forced)

    def _special_reply(self, request: _Request) -> AIMessage:
        """A structured answer or a forced tool call (schema-guided), or a reply read for tool calls."""
        guard, prompt = request.guard, request.prompt
        budget = int(request.settings.get("max_new_tokens", guard.max_new_tokens))
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        extra: dict[str, Any] = {}
        t0 = time.perf_counter()
        if request.schema is not None:
            reply = JsonWriter(guard, prompt, budget).write(request.schema)
            text, content, extra = reply.text, reply.text, {"truncated": reply.truncated}
            r = _with_generate_time(guard.guarded(prompt, text, ended=True), time.perf_counter() - t0)
        elif request.forced:
            call = write_tool_call(guard, prompt, request.tools, request.forced, budget)
            text, content = call.text, ""
            calls = [ToolCall(name=call.name, args=call.args, id=f"call_{uuid.uuid4().hex[:24]}", type="tool_call")]
            r = _with_generate_time(guard.guarded(prompt, text, ended=True), time.perf_counter() - t0)
        else:
            r = _last(guard.stream(prompt, **request.settings))
            text = r.text
            content, calls, invalid = parse_tool_calls(text, tool_names(request.tools))
        if r.decision is not None and not r.decision.shown:
            if request.schema is not None or calls or invalid:
                raise GuardUQAbstention(r.decision.text, r.decision)
            content = r.decision.text
        annotations = self._annotations(request, r)
        if extra:
            annotations["response_metadata"][METADATA_KEY]["structured"] = extra
        return AIMessage(content=content, tool_calls=calls, invalid_tool_calls=invalid, **annotations)

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

    @staticmethod
    def _annotations(request: _Request, r: GuardedResponse) -> dict[str, Any]:
        """Metadata and exact token counts: the templated prompt in, the scored reply out."""
        tok = request.guard.tokenizer
        n_in = len(layout.prompt_ids(tok, request.prompt))
        n_out = len(tok(r.text, add_special_tokens=False)["input_ids"]) + int(r.ended)
        return {
            "response_metadata": {"model_name": request.guard.info.name, METADATA_KEY: r.metadata("model")},
            "usage_metadata": UsageMetadata(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out),
        }


@dataclass(frozen=True)
class _Request:
    """One call, resolved: the Guard (with tools, if bound), the prompt and what to produce."""

    guard: Guard
    prompt: list[dict[str, str]]
    settings: dict[str, Any]
    schema: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    forced: list[str] | None = None

    @property
    def special(self) -> bool:
        return self.schema is not None or bool(self.tools)


def _with_generate_time(r: GuardedResponse, total_s: float) -> GuardedResponse:
    """The schema-guided writing time, as ``generate_s`` (guarded() timed only the scoring)."""
    spent = sum(r.timings.values())
    return replace(r, timings={"generate_s": max(total_s - spent, 0.0), **r.timings})


def _json_schema(schema: dict[str, Any] | type) -> dict[str, Any]:
    try:
        out = convert_to_json_schema(schema)
    except Exception as exc:
        raise InputError(f"with_structured_output: cannot read the schema: {exc}") from exc
    if _object_schema(out):
        return out
    raise InputError("with_structured_output: the schema must describe a JSON object")


def _object_schema(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "object" or "properties" in schema


def _forced_names(choice: Any, names: list[str]) -> list[str] | None:
    """The tools a call must be made to, or None when the model may answer in text."""
    if choice in (None, False, "auto", "none"):
        return None
    if choice in (True, "any", "required"):
        return names
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return [choice]
    raise InputError(f"tool_choice {choice!r} names no bound tool (bound: {', '.join(names)})")


def _last(items: Iterator[str | GuardedResponse]) -> GuardedResponse:
    for item in items:
        if isinstance(item, GuardedResponse):
            return item
    raise RuntimeError("Guard.stream ended without a response")  # a broken invariant, not user error

