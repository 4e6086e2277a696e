"""The Guard: generate or take a response, score it, and hand the result on.

One request reads top to bottom in ``Guard.generate``: validate -> generate -> score.
Everything model-specific lives in ``models``/``layout``/``uncertainty``; this file only orchestrates.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.errors import InputError, ScoringError
from guarduq.layout import PromptLike
from guarduq.models import DEFAULT_MODEL, LoadedModel, ModelInfo, fingerprint, load_model
from guarduq.uncertainty import GradientScorer, Scores, mean_token_prob, model_lock

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "ended": self.ended,
            "model": self.model.name,
            "model_fingerprint": self.model.fingerprint,
            **self.scores.to_dict(with_token_probs=False),
            "timings": {**self.scores.timings, **self.timings},
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
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel | tuple[nn.Module, Any] = DEFAULT_MODEL,
        *,
        parameters: str | Sequence[str] | None = None,
        last_n_blocks: int | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    ) -> None:
        loaded = _as_loaded(model)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        self.max_new_tokens = max_new_tokens
        self.scorer = GradientScorer(self.model, parameters=parameters, last_n_blocks=last_n_blocks)

    # ----------------------------------------------------------------- the request flow

    def generate(self, prompt: PromptLike, **generation_kwargs: Any) -> GuardedResponse:
        """Generate a reply (greedy unless told otherwise) and score it in the one layout."""
        t0 = time.perf_counter()
        text, ended = self._generate_text(prompt, generation_kwargs)
        t1 = time.perf_counter()
        scores = self.score(prompt, text, ended=ended) if text.strip() else invalid_scores(
            "the model produced an empty response", self.scorer.n_params
        )
        t2 = time.perf_counter()
        return GuardedResponse(
            text=text,
            scores=scores,
            ended=ended,
            prompt=prompt,
            model=self.info,
            timings={"generate_s": t1 - t0, "score_s": t2 - t1},
        )

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
        pairs = list(pairs)
        it = tqdm(pairs, desc="scoring", unit="resp", disable=not progress)
        return [self.score(p, r, ended=ended) for p, r in it]

    def option_probs(self, prompt: PromptLike, options: Sequence[str]) -> list[float]:
        """Mean token probability of each option as the response (forward only).

        Used for multiple choice: the option with the highest p̄ is the model's answer.
        """
        if not options:
            raise InputError("options list is empty")
        out = []
        with model_lock(self.model):
            was_training = self.model.training
            self.model.eval()
            try:
                for option in options:
                    enc = layout.encode(self.tokenizer, self.model, prompt, option, ended=True)
                    ids = enc.input_ids.to(self._device)
                    out.append(mean_token_prob(self.model, ids, enc.response_start))
            finally:
                self.model.train(was_training)
        return out

    # ----------------------------------------------------------------- helpers

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _generate_text(self, prompt: PromptLike, kwargs: dict[str, Any]) -> tuple[str, bool]:
        ids = layout.prompt_ids(self.tokenizer, prompt)
        layout.check_fits(self.model, len(ids) + 1)
        stops = layout.stop_token_ids(self.tokenizer)
        gen = {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": False,
            "eos_token_id": stops,
            "pad_token_id": self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else stops[0],
            **kwargs,  # the caller's settings win; the model's own config is never mutated
        }
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        with model_lock(self.model), torch.no_grad():
            was_training = self.model.training
            self.model.eval()
            try:
                out = self.model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **gen
                )
            except (TypeError, ValueError) as exc:
                raise InputError(f"invalid generation settings: {str(exc).splitlines()[0]}") from exc
            finally:
                self.model.train(was_training)
        new = out[0, len(ids) :].tolist()
        eos = set(gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]])
        ended = bool(new) and new[-1] in eos
        if ended:
            new = new[:-1]
        text = self.tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text, ended


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
