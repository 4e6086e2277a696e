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

from guarduq.integrations.langchain.callback import GuardRecord, GuardUQCallbackHandler
from guarduq.integrations.langchain.chat_model import GuardedChatModel
from guarduq.integrations.langchain.common import (
    METADATA_KEY,
    to_chat_messages,
    with_policy,
)
from guarduq.integrations.langchain.runnable import GuardedOutput, GuardedRunnable, guard_runnable

__all__ = [
    "METADATA_KEY",
    "GuardRecord",
    "GuardUQCallbackHandler",
    "GuardedChatModel",
    "GuardedOutput",
    "GuardedRunnable",
    "guard_runnable",
    "to_chat_messages",
    "with_policy",
]
