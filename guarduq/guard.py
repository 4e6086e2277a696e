"""The Guard: generate or take a response, score it, and hand the result on.

One request reads top to bottom in ``Guard.generate``: validate -> generate -> score, then, when
the Guard has a policy (``_respond``): calibrate -> decide (-> escalate, inside the policy) -> audit.
Everything model-specific lives in ``models``/``layout``/``uncertainty``; this file only orchestrates.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.calibration import Calibrator, feature_matrix
from guarduq.errors import GuardUQAbstention, InputError, ScoringError
from guarduq.layout import PromptLike
from guarduq.models import DEFAULT_MODEL, LoadedModel, ModelInfo, fingerprint, load_model
from guarduq.policy import Decision, Policy, SecondOpinionProvider, make_signals
from guarduq.policy.audit import AuditLog, make_record
from guarduq.scoring.uncertainty import GradientScorer, Scores, mean_token_prob, model_lock

log = get_logger("guard")

DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class GuardedResponse:
    """A response with its scores; ``ended`` says whether the model closed its turn."""

    text: str
    scores: Scores
    ended: bool
    prompt: PromptLike
    model: ModelInfo
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    timings: dict[str, float] = field(default_factory=dict)
    risk: float | None = None  # calibrated P(wrong), when the Guard has a calibrator
    decision: Decision | None = None  # what the policy decided, when the Guard has one

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "ended": self.ended,
            "model": self.model.name,
            "model_fingerprint": self.model.fingerprint,
            **self.scores.to_dict(with_token_probs=False),
            "timings": {**self.scores.timings, **self.timings},
            **({"risk": self.risk} if self.risk is not None else {}),
            **({"decision": self.decision.to_dict()} if self.decision is not None else {}),
        }


def invalid_scores(reason: str, n_params: int = 0) -> Scores:
    """Scores for a response that could not be scored: explicit ``valid=False``, never silent."""
    nan = math.nan
    return Scores(nan, nan, nan, nan, nan, nan, 0, (), n_params, valid=False, reason=reason)


class Guard:
    """Wraps a local causal LM and scores every response it produces or is shown.

    ``model`` is a spec for :func:`guarduq.load_model` (alias, folder, hub id, ``.gguf``), a
    ``LoadedModel``, or a ``(model, tokenizer)`` pair. ``parameters``/``last_n_blocks`` select
    which parameters enter the epistemic gradient norm (default: all).

    Decisions (all optional): ``policy`` (a ``Policy`` or a YAML path) decides what the user sees;
    ``calibrator`` (a ``Calibrator`` or a JSON path; default: the one the policy names) turns
    scores into ``risk``; ``audit`` (an ``AuditLog`` or a path) records every call;
    ``second_opinion`` (e.g. an ``SVEnsemble``) serves ``second_opinion`` rules; ``sinks``
    replaces declared escalation sinks by name; ``allow_callables`` lists the exact import paths
    a policy may name as callable sinks; ``raise_on_abstain`` raises ``GuardUQAbstention``
    instead of returning a withheld answer.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel | tuple[nn.Module, Any] = DEFAULT_MODEL,
        *,
        parameters: str | Sequence[str] | None = None,
        last_n_blocks: int | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        policy: Policy | str | os.PathLike[str] | None = None,
        calibrator: Calibrator | str | os.PathLike[str] | None = None,
        audit: AuditLog | str | os.PathLike[str] | None = None,
        second_opinion: SecondOpinionProvider | None = None,
        sinks: dict[str, Any] | None = None,
        allow_callables: Collection[str] = (),
        raise_on_abstain: bool = False,
    ) -> None:
        loaded = _as_loaded(model)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.max_new_tokens = max_new_tokens
        self.scorer = GradientScorer(self.model, parameters=parameters, last_n_blocks=last_n_blocks)
        self.policy = Policy.from_yaml(policy) if isinstance(policy, str | os.PathLike) else policy
        if calibrator is None and self.policy is not None:
            calibrator = self.policy.calibrator_path
        if isinstance(calibrator, str | os.PathLike):
            calibrator = Calibrator.load(calibrator, expected_fingerprint=self.info.fingerprint)
        self.calibrator = calibrator
        if self.policy is not None:
            known_as = {self.info.name}
            if calibrator is not None and calibrator.model_fingerprint == self.info.fingerprint:
                known_as.add(calibrator.model_name)
            self.policy.check_model(known_as, self.info.fingerprint)
            self.policy = self.policy.bind(
                second_opinion=second_opinion, allow_callables=allow_callables, sinks=sinks,
                calibrator=calibrator,
            )
        self.audit = AuditLog(audit) if isinstance(audit, str | os.PathLike) else audit
        self.raise_on_abstain = raise_on_abstain

    # ----------------------------------------------------------------- the request flow

    def generate(self, prompt: PromptLike, **generation_kwargs: Any) -> GuardedResponse:
        """Generate a reply (greedy unless told otherwise) and score it in the one layout."""
        t0 = time.perf_counter()
        text, ended = self._generate_text(prompt, generation_kwargs)
        return self._respond(prompt, text, ended, generate_s=time.perf_counter() - t0)

    def stream(
        self, prompt: PromptLike, *, stop: Sequence[str] = (), **generation_kwargs: Any
    ) -> Iterator[str | GuardedResponse]:
        """Yield the reply's text in pieces as it is generated, then its ``GuardedResponse``.

        The pieces join to exactly ``response.text``, the text that is scored (once, at the end).
        Generation stops at the first ``stop`` string and the text ends before it; the model did
        not close its turn there, so the reply is scored with ``ended=False``. Closing the
        generator early stops the generation.
        """
        t0 = time.perf_counter()
        ids = layout.prompt_ids(self.tokenizer, prompt)
        layout.check_fits(self.model, len(ids) + 1)
        gen = self._generation_settings(generation_kwargs)
        pieces = _TextPieces(self.tokenizer, _check_stops(stop))
        gen["streamer"] = pieces
        gen["stopping_criteria"] = [*gen.get("stopping_criteria", []), pieces]
        worker = threading.Thread(target=pieces.run, args=(self._run_generate, ids, gen), daemon=True)
        worker.start()
        try:
            yield from pieces
        finally:
            pieces.halt()
            worker.join()
        if pieces.stopped:
            text, ended = pieces.sent, False
        else:
            text, ended = self._decode_reply(pieces.ids, gen["eos_token_id"])
            if not text.startswith(pieces.sent):  # a tokenizer whose decoding is not prefix-stable
                log.warning("stream_text_diverged", note="scoring the text that was streamed")
                text = pieces.sent
            if len(text) > len(pieces.sent):
                yield text[len(pieces.sent) :]
        yield self._respond(prompt, text, ended, generate_s=time.perf_counter() - t0)

    def guarded(self, prompt: PromptLike, response: str, *, ended: bool = True) -> GuardedResponse:
        """A response produced elsewhere, through the same score -> decide -> audit flow."""
        return self._respond(layout.validate_prompt(prompt), layout.validate_response(response), ended)

    def score(self, prompt: PromptLike, response: str, *, ended: bool = True) -> Scores:
        """Score a response produced elsewhere, by teacher forcing."""
        enc = layout.encode(self.tokenizer, self.model, prompt, response, ended=ended)
        try:
            scores = self.scorer.score(enc.input_ids.to(self._device), enc.response_start)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            raise ScoringError(f"scoring failed inside the model: {str(exc).splitlines()[0]}") from exc
        log.info(
            "scored",
            model_fingerprint=self.info.fingerprint,
            **scores.to_dict(with_token_probs=False),
        )
        return scores

    def score_batch(
        self,
        pairs: Iterable[tuple[PromptLike, str]],
        *,
        ended: bool = True,
        progress: bool = False,
    ) -> list[Scores]:
        """Score many pairs; each needs its own backward pass (per-example gradients)."""
        pairs = _as_pairs(pairs)
        it = tqdm(pairs, desc="scoring", unit="resp", disable=not progress)
        return [self.score(p, r, ended=ended) for p, r in it]

    def option_probs(
        self, prompt: PromptLike, options: Sequence[str], *, ended: bool = True
    ) -> list[float]:
        """Mean token probability of each option as the response (forward only).

        Used for multiple choice: the option with the highest p̄ is the model's answer.
        ``ended`` as in :meth:`score`: whether each option closes the turn.
        """
        if isinstance(options, str | bytes) or not isinstance(options, Sequence):
            raise InputError(f"options must be a list of strings, got {type(options).__name__}")
        if not options:
            raise InputError("options list is empty")
        out = []
        with model_lock(self.model):
            was_training = self.model.training
            self.model.eval()
            try:
                for option in options:
                    enc = layout.encode(self.tokenizer, self.model, prompt, option, ended=ended)
                    ids = enc.input_ids.to(self._device)
                    out.append(mean_token_prob(self.model, ids, enc.response_start))
            finally:
                self.model.train(was_training)
        return out

    # ----------------------------------------------------------------- helpers

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _respond(
        self, prompt: PromptLike, text: str, ended: bool, *, generate_s: float | None = None
    ) -> GuardedResponse:
        """score -> calibrate -> decide (-> escalate) -> audit."""
        t1 = time.perf_counter()
        scores = self._score_or_invalid(prompt, text, ended)
        t2 = time.perf_counter()
        timings = {"score_s": t2 - t1} if generate_s is None else {"generate_s": generate_s, "score_s": t2 - t1}
        response = GuardedResponse(
            text=text,
            scores=scores,
            ended=ended,
            prompt=prompt,
            model=self.info,
            timings=timings,
        )
        if self.policy is None and self.calibrator is None and self.audit is None:
            return response
        return self._decide(response)

    def _score_or_invalid(self, prompt: PromptLike, text: str, ended: bool) -> Scores:
        """With a policy, a scoring failure becomes invalid scores, which its on_error handles."""
        if not text.strip():
            return invalid_scores("the model produced an empty response", self.scorer.n_params)
        try:
            return self.score(prompt, text, ended=ended)
        except ScoringError as exc:
            if self.policy is None:
                raise
            return invalid_scores(str(exc), self.scorer.n_params)

    def _decide(self, r: GuardedResponse) -> GuardedResponse:
        """calibrate -> decide -> audit; the audit line is on disk before the answer returns."""
        t0 = time.perf_counter()
        calibrated = calibrate(self.calibrator, r.scores)
        decision = None
        if self.policy is not None and not r.scores.valid:
            decision = self.policy.on_error_decision("scoring", r.scores.reason or "invalid", response=r.text)
        elif self.policy is not None:
            decision = self.policy.decide(
                make_signals(r.scores, **calibrated), prompt=r.prompt, response=r.text,
                request_id=r.request_id, model_fingerprint=self.info.fingerprint, ended=r.ended,
            )
        timings = {**r.timings, "decide_s": time.perf_counter() - t0}
        r = replace(r, risk=calibrated.get("risk"), decision=decision, timings=timings)
        if self.audit is not None:
            self.audit.append(make_record(
                request_id=r.request_id, model_fingerprint=self.info.fingerprint,
                policy=self.policy.identity() if self.policy else None,
                calibrator_sha256=self.calibrator.sha256 if self.calibrator else None,
                scores=r.scores.to_dict(with_token_probs=False), risk=r.risk,
                decision=decision.to_dict() if decision else None,
                latency_s=sum(timings.values()), prompt=r.prompt, response=r.text,
                log_text=bool(self.policy and self.policy.log_text),
            ))
        if decision is not None and self.raise_on_abstain and not decision.shown:
            raise GuardUQAbstention(decision.text, decision)
        return r

    def _generation_settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        stops = layout.stop_token_ids(self.tokenizer)
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": False,
            "eos_token_id": stops,
            "pad_token_id": self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else stops[0],
            **kwargs,  # the caller's settings win; the model's own config is never mutated
        }

    def _generate_text(self, prompt: PromptLike, kwargs: dict[str, Any]) -> tuple[str, bool]:
        ids = layout.prompt_ids(self.tokenizer, prompt)
        layout.check_fits(self.model, len(ids) + 1)
        gen = self._generation_settings(kwargs)
        return self._decode_reply(self._run_generate(ids, gen), gen["eos_token_id"])

    def _run_generate(self, ids: list[int], gen: dict[str, Any]) -> list[int]:
        """The new token ids ``model.generate`` appends to the prompt ``ids``."""
        gen = _one_reply_within_context(gen, len(ids), layout.context_length(self.model))
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        with model_lock(self.model), torch.no_grad():
            was_training = self.model.training
            self.model.eval()
            try:
                out = self.model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **gen
                )
            except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
                # The caller's generation settings reach transformers unchecked; it rejects them.
                raise InputError(f"invalid generation settings: {_first_line(exc)}") from exc
            except RuntimeError as exc:
                raise ScoringError(f"generation failed inside the model: {_first_line(exc)}") from exc
            finally:
                self.model.train(was_training)
        return out[0, len(ids) :].tolist()

    def _decode_reply(self, new: list[int], eos_token_id: int | list[int]) -> tuple[str, bool]:
        eos = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
        ended = bool(new) and new[-1] in eos
        if ended:
            new = new[:-1]
        text = self.tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text, ended


def _as_pairs(pairs: Any) -> list[tuple[Any, Any]]:
    """``(prompt, response)`` pairs from any iterable; anything else is an ``InputError``."""
    if isinstance(pairs, str | bytes | dict) or not isinstance(pairs, Iterable):
        raise InputError(f"pairs must be an iterable of (prompt, response), got {type(pairs).__name__}")
    out = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise InputError(f"pair {i} must be a (prompt, response) pair, got {type(pair).__name__}")
        out.append((pair[0], pair[1]))
    return out


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _one_reply_within_context(gen: dict[str, Any], n_prompt: int, context: int | None) -> dict[str, Any]:
    """Generation settings that give one sequence and stop at the model's context window.

    A huge ``max_new_tokens`` would otherwise run past the position embeddings (an index error
    deep in torch, or hours of generation); the reply is cut at the context instead.
    """
    n = gen.get("max_new_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {n!r}")
    if gen.get("return_dict_in_generate") or gen.get("num_return_sequences", 1) != 1:
        raise InputError("a Guard scores one reply per call: return_dict_in_generate and "
                         "num_return_sequences are not supported")
    if context is not None and n_prompt + n > context:
        gen = {**gen, "max_new_tokens": max(1, context - n_prompt)}
    return gen


def _check_stops(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = [stop]
    stops = tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise InputError(f"stop sequences must be non-empty strings, got {stop!r}")
    return stops


_DONE = object()


class _TextPieces:
    """Streamer and stopping criterion for ``Guard.stream`` (``generate`` duck-types both).

    It decodes the generated ids on the generation thread as they arrive and queues only text
    that can no longer change: a trailing partial UTF-8 character (``\ufffd``) or a possible
    beginning of a stop string waits for the next token. When a stop string appears, the text
    is cut before it and generation halts at this step.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False  # a stop string was generated
        self._halted = False  # the consumer went away
        self._prompt_seen = False
        self._queue: queue.Queue[Any] = queue.Queue()

    # -- generation thread

    def run(self, generate: Any, ids: list[int], gen: dict[str, Any]) -> None:
        try:
            generate(ids, gen)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._queue.put(exc)
        self._queue.put(_DONE)

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        if self.stopped:
            return
        self.ids.extend(int(i) for i in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            ready = text[: min(cuts)]
        else:
            ready = _stable_prefix(text, self.stops)
        if len(ready) > len(self.sent) and ready.startswith(self.sent):
            self._queue.put(ready[len(self.sent) :])
            self.sent = ready

    def end(self) -> None:
        pass  # the worker signals the end once generate() has returned or raised

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        halt = self.stopped or self._halted
        return torch.full((input_ids.shape[0],), halt, dtype=torch.bool, device=input_ids.device)

    # -- consumer thread

    def halt(self) -> None:
        self._halted = True

    def __iter__(self) -> Iterator[str]:
        while (item := self._queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item


def _stable_prefix(text: str, stops: tuple[str, ...]) -> str:
    """``text`` less a trailing partial character and any tail that may begin a stop string."""
    text = text.rstrip("\ufffd")
    hold = max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )
    return text[: len(text) - hold]


def calibrate(calibrator: Calibrator | None, scores: Scores) -> dict[str, float]:
    """``risk`` and the z-scores (``epistemic_z``, ``aleatoric_z``) the calibrator can give.

    The z-scores use the calibrator's own standardisation (its scaler was fitted on this model's
    calibration data), so 1.0 means one standard deviation above this model's usual value.
    """
    if calibrator is None:
        return {}
    out = {"risk": calibrator.risk(scores)}
    x, ok = feature_matrix([scores], calibrator.features)
    scaler = calibrator.pipeline_.named_steps["scale"]
    z = (x[0] - scaler.mean_) / scaler.scale_
    for feature, signal in (("log_epistemic", "epistemic_z"), ("aleatoric", "aleatoric_z")):
        if feature in calibrator.features:
            out[signal] = float(z[calibrator.features.index(feature)]) if ok[0] else math.nan
    return out


def _as_loaded(model: Any) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Module):
        m, tok = model
        name = str(getattr(getattr(m, "config", None), "name_or_path", "") or type(m).__name__)
        info = ModelInfo(
            name=name,
            fingerprint=fingerprint(m),
            source="object",
            n_params=sum(p.numel() for p in m.parameters()),
        )
        return LoadedModel(model=m, tokenizer=tok, info=info)
    if isinstance(model, str | os.PathLike):
        return load_model(model)
    raise InputError(
        "Guard needs a model spec (str/path), a LoadedModel or a (model, tokenizer) pair, "
        f"got {type(model).__name__}"
    )
