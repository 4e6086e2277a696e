"""Tool calling for ``GuardedChatModel.bind_tools``, where the model's chat template knows tools.

A local model can call tools only if its chat template renders them (``apply_chat_template(...,
tools=...)``) and it was trained to answer with a call. SmolLM2-135M-Instruct's template has no
tools, so ``bind_tools`` on it raises an :class:`~guarduq.errors.InputError` saying so.

With a template that renders tools, the Guard's tokenizer is wrapped so that every prompt it
templates (for generation and for scoring alike) carries the tool definitions. Tool calls are
read from the reply in the two common forms: ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` blocks (Hermes/Qwen style) or a bare JSON object or list of such objects.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages.tool import InvalidToolCall, ToolCall
from langchain_core.utils.function_calling import convert_to_openai_tool

from guarduq.errors import InputError
from guarduq.guard import Guard

_PROBE = "guarduq_probe_tool"
_SUPPORT: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a tool definition it is given (probed once)."""
    try:
        return _SUPPORT[tokenizer]
    except (KeyError, TypeError):
        pass
    probe = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    supported = False
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[probe], add_generation_prompt=True, tokenize=False
            )
            supported = _PROBE in str(text)
        except Exception:  # a user template that fails with tools does not support them
            supported = False
    with contextlib.suppress(TypeError):
        _SUPPORT[tokenizer] = supported
    return supported


def as_openai_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """LangChain tools, functions, pydantic models or dicts as OpenAI tool schemas."""
    out = []
    for i, t in enumerate(tools):
        try:
            out.append(convert_to_openai_tool(t))
        except Exception as exc:
            raise InputError(f"tool {i}: cannot convert to a tool schema: {exc}") from exc
    return out


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(t["function"]["name"]) for t in tools]


class _ToolTokenizer:
    """A tokenizer that templates every prompt with ``tools`` and is otherwise the original."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self._tokenizer = tokenizer
        self._tools = tools

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("tools", self._tools)
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def guard_with_tools(guard: Guard, tools: list[dict[str, Any]]) -> Guard:
    """The same Guard (model, scorer, policy, audit shared) whose prompts carry ``tools``."""
    if not tools:
        return guard
    if not template_supports_tools(guard.tokenizer):
        raise InputError(
            f"the chat template of model {guard.info.name!r} does not support tools: bind_tools needs a "
            "model whose template renders them (apply_chat_template(..., tools=...)), e.g. a Qwen2.5 or "
            "Llama-3.1 instruct model"
        )
    view = copy.copy(guard)
    view.tokenizer = _ToolTokenizer(guard.tokenizer, tools)
    return view


def parse_tool_calls(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """(the text outside the calls, the tool calls, the calls that did not parse) of a reply."""
    blocks = _BLOCK.findall(text)
    if blocks:
        content = _BLOCK.sub("", text).strip()
        raw = blocks
    else:
        stripped = text.strip()
        if not stripped.startswith(("{", "[")):
            return text, [], []
        content, raw = "", [stripped]
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for chunk in raw:
        try:
            obj = json.loads(chunk)
        except ValueError as exc:
            invalid.append(InvalidToolCall(name=None, args=chunk, id=_id(), error=f"not JSON: {exc}",
                                           type="invalid_tool_call"))
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item, names)
            if isinstance(call, str):
                if not blocks and not calls and not invalid and len(raw) == 1:
                    return text, [], []  # plain JSON that is not a tool call: an ordinary reply
                invalid.append(InvalidToolCall(name=None, args=json.dumps(item), id=_id(), error=call,
                                               type="invalid_tool_call"))
            else:
                calls.append(call)
    return content, calls, invalid


def tool_call_text(name: str, args: Mapping[str, Any]) -> str:
    """How a tool call is written back into a chat history (Hermes style)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": dict(args)}, ensure_ascii=False) + "\n</tool_call>"


def _as_call(item: Any, names: Sequence[str]) -> ToolCall | str:
    if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
        return "a tool call must be an object with a 'name'"
    if item["name"] not in names:
        return f"unknown tool {item['name']!r} (bound: {', '.join(names)})"
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return "tool call arguments are not JSON"
    if not isinstance(args, Mapping):
        return "tool call arguments must be an object"
    return ToolCall(name=item["name"], args=dict(args), id=_id(), type="tool_call")


def _id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
