"""GuardUQCallbackHandler: scores every LLM/chat-model generation of any chain."""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import (
    BaseCallbackHandler,
)
from langchain_core.messages import BaseMessage
from langchain_core.outputs import (
    ChatGeneration,
    Generation,
    LLMResult,
)

from guarduq._logging import get_logger
from guarduq.errors import GuardUQAbstention, InputError
from guarduq.guard import Guard
from guarduq.integrations.langchain.common import (
    METADATA_KEY,
    PolicyLike,
    _ended,
    _payload_of,
    as_policy,
    to_chat_messages,
    with_policy,
)
from guarduq.layout import PromptLike
from guarduq.models import DEFAULT_MODEL
from guarduq.policy import Decision
from guarduq.scoring.uncertainty import Scores

log = get_logger("langchain")


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
        self._policy = as_policy(policy)
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
            return self.scorer.guarded(prompts[i], g.text, ended=_ended(g)).metadata("scorer")
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

