"""Pieces shared by the chat model, the callback handler and the guarded runnable."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage
from langchain_core.outputs import (
    ChatGeneration,
    Generation,
)

from guarduq.errors import InputError, PolicyError
from guarduq.guard import Guard
from guarduq.integrations.langchain.tools import tool_call_text
from guarduq.models import LoadedModel
from guarduq.policy import Policy

METADATA_KEY = "guarduq"  # the key under response_metadata / generation_info
PolicyLike = Policy | str | os.PathLike[str] | Mapping[str, Any] | None

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
        content = str(m.text)
        if isinstance(m, AIMessage) and m.tool_calls:  # written back as the model would write them
            content = "\n".join([content, *(tool_call_text(c["name"], c["args"]) for c in m.tool_calls)]).strip()
        out.append({"role": role, "content": content})
    return out


def as_policy(policy: PolicyLike) -> Policy | None:
    """A Policy from a Policy, a YAML path or a mapping (``None`` stays ``None``)."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str | os.PathLike):
        return Policy.from_yaml(policy)
    if isinstance(policy, Mapping):
        return Policy.from_dict(policy)
    raise InputError(f"policy must be a Policy, a YAML path or a mapping, got {type(policy).__name__}")


def with_policy(guard: Guard, policy: PolicyLike) -> Guard:
    """``guard`` itself, or a Guard with ``policy`` on the same loaded model (shared weights).

    The new Guard keeps the scorer's parameter selection, calibrator, audit log and settings;
    for sinks or a second opinion, build the Guard with them and pass no ``policy`` here.
    """
    if policy is None:
        return guard
    if not isinstance(guard, Guard):
        raise InputError(f"guard must be a guarduq.Guard, got {type(guard).__name__}")
    policy = as_policy(policy)
    if guard.policy is not None:
        raise PolicyError(
            f"the Guard already has policy {guard.policy.name!r}; pass a policy to the Guard or "
            "here, not both"
        )
    return Guard(
        LoadedModel(guard.model, guard.tokenizer, guard.info),
        parameters=guard.scorer.parameters if guard.scorer.parameter_set != "all" else "all",
        last_n_blocks=guard.scorer.last_n_blocks,
        checkpoint_tokens=guard.scorer.checkpoint_tokens,
        max_new_tokens=guard.max_new_tokens,
        policy=policy,
        calibrator=guard.calibrator,
        audit=guard.audit,
        raise_on_abstain=guard.raise_on_abstain,
    )


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

