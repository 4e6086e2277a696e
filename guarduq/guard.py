"""The Guard: generate or take a response, score it, and hand the result on.

One request reads top to bottom in ``Guard.generate``: validate -> generate -> score, then, when
the Guard has a policy (``_respond``): calibrate -> decide (-> escalate, inside the policy) -> audit.
Everything model-specific lives in ``models``/``layout``/``uncertainty``; this file only orchestrates.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from guarduq import batching, layout, streaming
from guarduq._logging import get_logger
from guarduq.calibration import Calibrator
from guarduq.decider import (
    Decider,
    Identity,
    binding_of,
    calibrated_signals,
    check_certified,
    pair_attribute,
)
from guarduq.errors import GuardUQAbstention, InputError, ScoringError
from guarduq.layout import PromptLike
from guarduq.models import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelInfo,
    fingerprint,
    load_model,
    place_model,
)
from guarduq.policy import Policy, SecondOpinionProvider, make_signals
from guarduq.policy.audit import AuditLog, make_record
from guarduq.policy.context import current_group, group_of, in_force, risk_group
from guarduq.response import GuardedResponse, invalid_scores  # noqa: F401 - re-exported: guard's names
from guarduq.scoring import reuse
from guarduq.scoring.parameters import resolve_selection
from guarduq.scoring.uncertainty import CHECKPOINT_TOKENS, GradientScorer, Scores, model_lock
from guarduq.traffic import Traffic

log = get_logger("guard")

DEFAULT_MAX_NEW_TOKENS = 64
# The gradient's parameters when neither the caller nor a calibrator names them (None: all).
DEFAULT_LAST_N_BLOCKS: int | None = None
DEFAULT_SCORE_BATCH_SIZE = 16  # benchmarks/throughput.py


class Guard:
    """Wraps a local causal LM and scores every response it produces or is shown.

    ``model`` is a spec for :func:`guarduq.load_model` (alias, folder, hub id, ``.gguf``), a
    ``LoadedModel``, or a ``(model, tokenizer)`` pair. ``parameters``/``last_n_blocks`` select
    which parameters enter the epistemic gradient norm (default: the calibrator's set, else all;
    ``parameters="all"`` names every parameter; docs/results/frontier.md says why all).

    Decisions (all optional): ``policy`` (a ``Policy`` or a YAML path) decides what the user sees;
    ``calibrator`` (a ``Calibrator`` or a JSON path; default: the one the policy names) turns
    scores into ``risk``; ``audit`` (an ``AuditLog`` or a path) records every call; ``store`` (a
    ``guarduq.store.Store`` or a database URL) keeps every decided reply and the policy's review
    sample (``guarduq.traffic``);
    ``second_opinion`` (e.g. an ``SVEnsemble``) serves ``second_opinion`` rules; ``sinks``
    replaces declared escalation sinks by name; ``allow_callables`` lists the exact import paths
    a policy may name as callable sinks; ``raise_on_abstain`` raises ``GuardUQAbstention``
    instead of returning a withheld answer.

    A policy/calibrator pair under which a threshold rule of the policy can never match (``guarduq
    policy check --strict`` warns of it; every reply it would let through is withheld) raises
    ``UncertifiedPairError``, here and in ``reload``, unless ``allow_uncertified=True``.

    ``checkpoint_tokens``: sequences longer than this are scored with activation checkpointing
    (less memory, about a third more time on long prompts; None: never).

    ``device`` ("cpu", "cuda", "cuda:N") and ``dtype`` (float32, "bf16", "fp16") place the
    model (a model object is moved/cast in place); probabilities and gradient norms are still
    accumulated in float32/float64, and the fingerprint is that of the float32 weights.
    """

    policy = pair_attribute("policy")  # the bound policy in force: decider.policy
    calibrator = pair_attribute("calibrator")  # the calibrator in force: decider.calibrator

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
        store: Any | None = None,
        second_opinion: SecondOpinionProvider | None = None,
        sinks: dict[str, Any] | None = None,
        allow_callables: Collection[str] = (),
        raise_on_abstain: bool = False,
        allow_uncertified: bool = False,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        checkpoint_tokens: int | None = CHECKPOINT_TOKENS,
    ) -> None:
        if isinstance(model, str | os.PathLike):
            loaded = load_model(model, device=device, dtype=dtype)
        else:
            loaded = _as_loaded(model)
            if device is not None or dtype is not None:  # moved/cast in place, fingerprinted first
                place_model(loaded.model, device, dtype)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.max_new_tokens = max_new_tokens
        self.decider = Decider.load(  # read, checked against the model, bound
            policy, calibrator, self.info, binding_of(second_opinion, allow_callables, sinks))
        check_certified(self.decider, force=allow_uncertified, event="guard_uncertified_pair",
                        how_to_force="Guard(..., allow_uncertified=True) takes it anyway")
        self.scorer = GradientScorer(self.model, checkpoint_tokens=checkpoint_tokens, **resolve_selection(
            parameters, last_n_blocks, self.calibrator.parameter_set_ if self.calibrator is not None else None,
            default_last_n_blocks=DEFAULT_LAST_N_BLOCKS,
        ))
        self.audit = AuditLog(audit) if isinstance(audit, str | os.PathLike) else audit
        self.traffic = Traffic.open(store) if store is not None else None
        self.drift: Any = None  # a DriftMonitor whose case the policy's on_drift acts on (serve sets it)
        self.raise_on_abstain = raise_on_abstain

    def reload(self, policy: Policy | str | os.PathLike[str] | None = None,
               calibrator: Calibrator | str | os.PathLike[str] | None = None, *, force: bool = False) -> Identity:
        """Swap in a new policy/calibrator pair (None: re-read this pair's files), checked as at
        construction and against the scorer's parameter set; if anything fails, nothing changes.
        An uncertified pair raises ``UncertifiedPairError`` unless ``force``."""
        new = self.decider.reloaded(self.info, policy=policy, calibrator=calibrator,
                                    parameter_set=self.scorer.parameter_set)
        check_certified(new, force=force, event="reload_forced_uncertified", trigger="Guard.reload",
                        how_to_force="Guard.reload(..., force=True) takes it anyway")
        self.decider = new
        return new.identity

    # ----------------------------------------------------------------- the request flow

    def generate(self, prompt: PromptLike, **generation_kwargs: Any) -> GuardedResponse:
        """Generate a reply (greedy unless told otherwise) and score it in the one layout."""
        return self.generate_batch([prompt], batch_size=1, **generation_kwargs)[0]

    def generate_batch(
        self,
        prompts: Sequence[PromptLike],
        *,
        batch_size: int | None = None,
        progress: bool = False,
        **generation_kwargs: Any,
    ) -> list[GuardedResponse]:
        """``generate`` for many prompts: one left-padded ``model.generate`` per ``batch_size``
        prompts, then one batched scoring, then decide + audit per response.

        Each reply is cut where its own row stopped, so greedy texts equal one-at-a-time
        ``generate``. Timings are per response (the batch's time shared equally). With
        ``raise_on_abstain`` every response is decided and audited before the first abstention
        is raised.
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise InputError("generate_batch takes a list of prompts")
        prompts = [layout.validate_prompt(p) for p in prompts]
        size = batching.check_batch_size(batch_size)
        gen = self._generation_settings(generation_kwargs)
        out: list[GuardedResponse] = []
        bar = tqdm(total=len(prompts), desc="generating", unit="resp", disable=not progress)
        for chunk in batching.chunked(prompts, size):
            t0 = time.perf_counter()
            rows, recorded = self._generate_rows(chunk, gen)
            replies = [self._decode_reply(new, gen["eos_token_id"]) for new in rows]
            generate_s = (time.perf_counter() - t0) / len(chunk)
            out += self._respond_many(chunk, replies, generate_s=generate_s, recorded=recorded)
            bar.update(len(chunk))
        bar.close()
        return out

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
        pieces = streaming.TextPieces(self.tokenizer, streaming.check_stops(stop))
        gen["streamer"] = pieces
        gen["stopping_criteria"] = [*gen.get("stopping_criteria", []), pieces]
        recorded: list[reuse.Recorded] = []
        worker = threading.Thread(
            target=pieces.run, args=(lambda i, g: self._run_generate(i, g, recorded), ids, gen), daemon=True
        )
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
        yield self._respond_many(
            [prompt], [(text, ended)], generate_s=time.perf_counter() - t0, recorded=recorded or None
        )[0]

    def guarded(self, prompt: PromptLike, response: str, *, ended: bool = True) -> GuardedResponse:
        """A response produced elsewhere, through the same score -> decide -> audit flow."""
        return self._respond_many([layout.validate_prompt(prompt)], [(layout.validate_response(response), ended)])[0]

    def score(self, prompt: PromptLike, response: str, *, ended: bool = True) -> Scores:
        """Score a response produced elsewhere, by teacher forcing."""
        return self._score_one(prompt, response, ended)

    def _score_one(
        self, prompt: PromptLike, response: str, ended: bool, recorded: reuse.Recorded = None
    ) -> Scores:
        enc = layout.encode(self.tokenizer, self.model, prompt, response, ended=ended)
        ids = enc.input_ids.to(self._device)
        try:
            scores = self.scorer.score(ids, enc.response_start, reuse.states_for(recorded, ids))
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            raise ScoringError(f"scoring failed inside the model: {str(exc).splitlines()[0]}") from exc
        log.info(
            "scored",
            model_fingerprint=self.info.fingerprint,
            **scores.to_dict(with_token_probs=False, with_grad_profile=False),
        )
        return scores

    def score_batch(
        self,
        pairs: Iterable[tuple[PromptLike, str]],
        *,
        ended: bool | Sequence[bool] = True,
        batch_size: int = DEFAULT_SCORE_BATCH_SIZE,
        progress: bool = False,
    ) -> list[Scores]:
        """``score`` of many pairs, ``batch_size`` per forward+backward (same numbers, to float
        rounding; see ``guarduq.scoring.batched``), fewer where long pairs would exceed the
        model's ``batching.token_budget`` of padded tokens or pad short ones too much.
        ``ended``: one flag for all, or one per pair."""
        pairs = layout.as_pairs(pairs)
        flags = [ended] * len(pairs) if isinstance(ended, bool) else list(ended)
        if len(flags) != len(pairs):
            raise InputError(f"ended has {len(flags)} flags for {len(pairs)} pairs")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        return self._score_pairs(pairs, flags, batch_size, progress)

    def _score_pairs(
        self,
        pairs: Sequence[tuple[PromptLike, str]],
        flags: Sequence[bool],
        batch_size: int = DEFAULT_SCORE_BATCH_SIZE,
        progress: bool = False,
        recorded: Sequence[reuse.Recorded] | None = None,
    ) -> list[Scores]:
        """``score_batch`` after its checks; ``recorded``: what generation recorded per pair."""
        encs = [layout.encode(self.tokenizer, self.model, p, r, ended=e) for (p, r), e in zip(pairs, flags, strict=True)]
        recorded = list(recorded) if recorded is not None else [None] * len(encs)
        order = sorted(range(len(encs)), key=lambda i: -encs[i].input_ids.shape[1])  # less padding
        lengths = [int(encs[i].input_ids.shape[1]) for i in order]
        out: list[Scores | None] = [None] * len(encs)
        with tqdm(total=len(encs), desc="scoring", unit="resp", disable=not progress) as bar:
            for run in batching.token_budget_chunks(lengths, batch_size, batching.token_budget(self.model)):
                chunk = [order[j] for j in run]
                items = [(encs[i].input_ids.to(self._device), encs[i].response_start) for i in chunk]
                states = [reuse.states_for(recorded[i], ids) for i, (ids, _) in zip(chunk, items, strict=True)]
                try:
                    scores = self.scorer.score_batch(items, batch_size=batch_size, states=states)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                    raise ScoringError(f"scoring failed inside the model: {str(exc).splitlines()[0]}") from exc
                for i, s in zip(chunk, scores, strict=True):
                    out[i] = s
                    log.info("scored", model_fingerprint=self.info.fingerprint, batch_size=len(chunk),
                             **s.to_dict(with_token_probs=False, with_grad_profile=False))
                bar.update(len(chunk))
        return out  # type: ignore[return-value]

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
        prompt_ids = layout.prompt_ids(self.tokenizer, prompt)
        rows = [layout.response_ids(self.tokenizer, o, ended=ended) for o in options]
        layout.check_fits(self.model, len(prompt_ids) + max(len(r) for r in rows))
        with model_lock(self.model):
            was_training = self.model.training
            self.model.eval()
            try:
                return batching.option_mean_probs(self.model, prompt_ids, rows, self._pad_id, self._device)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                raise ScoringError(f"option forward failed inside the model: {str(exc).splitlines()[0]}") from exc
            finally:
                self.model.train(was_training)

    # ----------------------------------------------------------------- helpers

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else layout.stop_token_ids(self.tokenizer)[0]

    def _respond_many(
        self,
        prompts: Sequence[PromptLike],
        replies: Sequence[tuple[str, bool]],
        *,
        generate_s: float | None = None,
        recorded: Sequence[reuse.Recorded] | None = None,
    ) -> list[GuardedResponse]:
        """score (batched) -> calibrate -> decide (-> escalate) -> audit, per response.
        ``recorded``: the hidden states generation recorded for each reply (``scoring.reuse``)."""
        t1 = time.perf_counter()
        scores = self._score_many(prompts, replies, recorded or [None] * len(replies))
        score_s = (time.perf_counter() - t1) / len(prompts)
        timings = {"score_s": score_s} if generate_s is None else {"generate_s": generate_s, "score_s": score_s}
        responses = [
            GuardedResponse(text=text, scores=s, ended=ended, prompt=p, model=self.info, timings=dict(timings))
            for p, (text, ended), s in zip(prompts, replies, scores, strict=True)
        ]
        if self.policy is None and self.calibrator is None and self.audit is None and self.traffic is None:
            return responses
        decided, abstention = [], None
        for r in responses:
            try:
                decided.append(self._decide(r))
            except GuardUQAbstention as exc:  # every response is decided and audited first
                abstention = abstention or exc
        if abstention is not None:
            raise abstention
        return decided

    def _score_many(
        self,
        prompts: Sequence[PromptLike],
        replies: Sequence[tuple[str, bool]],
        recorded: Sequence[reuse.Recorded],
    ) -> list[Scores]:
        """One ``score_batch`` over the non-empty replies; if it fails, each alone, so that one
        bad reply does not invalidate the others."""
        out: list[Scores] = [
            invalid_scores("the model produced an empty response", self.scorer.n_params, self.scorer.parameter_set)
            for _ in replies
        ]
        todo = [i for i, (text, _) in enumerate(replies) if text.strip()]
        if len(todo) > 1:
            try:
                pairs = [(prompts[i], replies[i][0]) for i in todo]
                got = self._score_pairs(pairs, [replies[i][1] for i in todo], recorded=[recorded[i] for i in todo])
                for i, s in zip(todo, got, strict=True):
                    out[i] = s
                return out
            except ScoringError as exc:
                log.warning("batch_scoring_failed", error=str(exc), note="scoring each reply alone")
        for i in todo:
            out[i] = self._score_or_invalid(prompts[i], *replies[i], recorded[i])
        return out

    def _score_or_invalid(self, prompt: PromptLike, text: str, ended: bool, recorded: reuse.Recorded) -> Scores:
        """With a policy, a scoring failure becomes invalid scores, which its on_error handles."""
        try:
            return self._score_one(prompt, text, ended, recorded)
        except ScoringError as exc:
            if self.policy is None:
                raise
            return invalid_scores(str(exc), self.scorer.n_params, self.scorer.parameter_set)

    def _decide(self, r: GuardedResponse) -> GuardedResponse:
        """calibrate -> decide -> audit; the audit line is on disk before the answer returns."""
        t0 = time.perf_counter()
        pair = self.decider  # read once: a reload never pairs an old policy with a new calibrator
        policy, calibrator = pair.policy, pair.calibrator
        group = current_group() or group_of(policy)  # traffic_group(...), else the policy's default
        calibrated = calibrated_signals(calibrator, r.scores, self._costly_features(r, calibrator),
                                        risk_group(policy, calibrator, group))
        case = self.drift.case() if self.drift is not None else None
        ctx = in_force(policy, calibrator, group, case.label if case is not None else None)
        decision = None
        if policy is not None and not r.scores.valid:
            decision = policy.on_error_decision("scoring", r.scores.reason or "invalid", response=r.text)
        elif policy is not None:
            decision = policy.decide(
                make_signals(r.scores, **calibrated, **ctx.signals()), prompt=r.prompt, response=r.text,
                request_id=r.request_id, model_fingerprint=self.info.fingerprint, ended=r.ended,
                override=ctx.rule, override_reason=ctx.reason,
            )
        timings = {**r.timings, "decide_s": time.perf_counter() - t0}
        r = replace(r, risk=calibrated.get("risk"), decision=decision, timings=timings, decided_by=pair.identity,
                    in_force=ctx)
        if self.audit is not None:
            self.audit.append(make_record(
                request_id=r.request_id, model_fingerprint=self.info.fingerprint,
                policy=policy.identity() if policy else None,
                calibrator_sha256=calibrator.sha256 if calibrator else None,
                scores=r.scores.to_dict(with_token_probs=False), risk=r.risk,
                decision=decision.to_dict() if decision else None,
                latency_s=sum(timings.values()), prompt=r.prompt, response=r.text,
                log_text=bool(policy and policy.log_text), in_force=ctx.to_dict(),
            ))
        if self.traffic is not None:
            self.traffic.record(r, pair, tokens=lambda: self._token_pieces(r))
        if decision is not None and self.raise_on_abstain and not decision.shown:
            raise GuardUQAbstention(decision.text, decision)
        return r

    def _token_pieces(self, r: GuardedResponse) -> list[str]:
        """The reply's tokens as text pieces, aligned with ``scores.token_probs``."""
        return layout.token_pieces(self.tokenizer, layout.response_ids(self.tokenizer, r.text, ended=r.ended))

    def _costly_features(self, r: GuardedResponse, calibrator: Calibrator | None) -> dict[str, float]:
        """P(True) (one extra forward) when the calibrator was fitted with it; a prompt that is
        not a plain question string leaves it out, and the risk then fails closed (1.0)."""
        if calibrator is None or "p_true" not in calibrator.features:
            return {}
        if not isinstance(r.prompt, str) or not r.scores.valid or not r.text.strip():
            log.warning("p_true_unavailable", reason="needs a string prompt and a valid answer")
            return {}
        from guarduq.scoring.baselines import PTrue

        return {"p_true": PTrue().true_prob(self, r.prompt, r.text)}

    def _generation_settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        stops = layout.stop_token_ids(self.tokenizer)
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": False,
            "eos_token_id": stops,
            "pad_token_id": self._pad_id,
            **kwargs,  # the caller's settings win; the model's own config is never mutated
        }

    def _generate_rows(
        self, prompts: Sequence[PromptLike], gen: dict[str, Any]
    ) -> tuple[list[list[int]], list[reuse.Recorded]]:
        """Each prompt's new token ids, up to and including the token where its row stopped, and
        what generation recorded for scoring each row (``scoring.reuse``; None where nothing)."""
        rows = [layout.prompt_ids(self.tokenizer, p) for p in prompts]
        for ids in rows:
            layout.check_fits(self.model, len(ids) + 1)
        input_ids, mask = batching.left_pad(rows, self._pad_id, self._device)
        gen = _one_reply_within_context(gen, int(input_ids.shape[1]), layout.context_length(self.model))
        gen, recorder = batching.recorder_settings(gen, int(input_ids.shape[1]))
        out, states = self._model_generate(input_ids, mask, gen)
        pads = [int(input_ids.shape[1]) - len(r) for r in rows]
        return recorder.rows(out[:, input_ids.shape[1] :]), reuse.recorded_rows(states, out, pads)

    def _run_generate(
        self, ids: list[int], gen: dict[str, Any], recorded: list[reuse.Recorded] | None = None
    ) -> list[int]:
        """The new token ids ``model.generate`` appends to the prompt ``ids`` (one row: ``stream``);
        what it recorded for scoring is appended to ``recorded``."""
        gen = _one_reply_within_context(gen, len(ids), layout.context_length(self.model))
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        out, states = self._model_generate(input_ids, torch.ones_like(input_ids), gen)
        if recorded is not None:
            recorded += reuse.recorded_rows(states, out, [0])
        return out[0, len(ids) :].tolist()

    def _model_generate(
        self, input_ids: torch.Tensor, mask: torch.Tensor, gen: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``model.generate``'s output, and the hidden states entering the first scored block at
        every position it fed the model, where scoring can start there (else None)."""
        k = self.scorer.reuse_block if reuse.plain_decoding(gen) else None
        capture = reuse.StateCapture(self.scorer.blocks, k) if k is not None else contextlib.nullcontext()
        with model_lock(self.model), torch.no_grad():
            was_training = self.model.training
            self.model.eval()
            try:
                with capture:
                    out = self.model.generate(input_ids=input_ids, attention_mask=mask, **gen)
                return out, capture.states() if k is not None else None
            except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
                # The caller's generation settings reach transformers unchecked; it rejects them.
                raise InputError(f"invalid generation settings: {_first_line(exc)}") from exc
            except RuntimeError as exc:
                raise ScoringError(f"generation failed inside the model: {_first_line(exc)}") from exc
            finally:
                self.model.train(was_training)

    def _decode_reply(self, new: list[int], eos_token_id: int | list[int]) -> tuple[str, bool]:
        eos = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
        ended = bool(new) and new[-1] in eos
        if ended:
            new = new[:-1]
        text = self.tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text, ended


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _one_reply_within_context(gen: dict[str, Any], n_prompt: int, context: int | None) -> dict[str, Any]:
    """Generation settings that give one sequence and stop at the model's context window, with
    the stop settings guarduq itself reads (``eos_token_id``, ``stopping_criteria``) checked.

    A huge ``max_new_tokens`` would otherwise run past the position embeddings (an index error
    deep in torch, or hours of generation); the reply is cut at the context instead.
    """
    n = gen.get("max_new_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {n!r}")
    eos = gen.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**63 for i in ids):
        raise InputError(f"eos_token_id must be a token id or a non-empty list of them, got {eos!r}")
    crit = gen.get("stopping_criteria")
    if crit is not None and (not isinstance(crit, list | tuple) or not all(callable(c) for c in crit)):
        raise InputError(f"stopping_criteria must be a list of transformers StoppingCriteria, got {crit!r}")
    if gen.get("return_dict_in_generate") or gen.get("num_return_sequences", 1) != 1:
        raise InputError("a Guard scores one reply per call: return_dict_in_generate and "
                         "num_return_sequences are not supported")
    if context is not None and n_prompt + n > context:
        gen = {**gen, "max_new_tokens": max(1, context - n_prompt)}
    return gen


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
