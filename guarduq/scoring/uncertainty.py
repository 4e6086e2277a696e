"""Epistemic and aleatoric scores from one forward and one backward pass.

For a prompt x and response tokens y_1..y_T, with p_t = p(y_t | x, y<t) at temperature 1 and
p̄ = mean_t p_t:

* epistemic = ‖∇_θ p̄‖²: the delta method with an isotropic parameter covariance,
  Var[p̄] ≈ gᵀ Σ_θ g ≈ ‖g‖².
* aleatoric = p̄ (1 − p̄): the variance of a Bernoulli with success probability p̄.

The gradient is never held whole: a post-accumulate hook on each selected parameter adds the
squared norm of its gradient to a per-parameter float64 total and frees ``.grad`` at once, so
peak memory is the activations plus the largest single parameter gradient.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from guarduq.errors import InputError
from guarduq.scoring.batched import BatchedScorer
from guarduq.scoring.gradients import (  # noqa: F401 - model_lock, row_gradient, output_needs_grad re-exported
    VocabGradients,
    model_lock,
    output_needs_grad,
    row_gradient,
    scoring_state,
    squared_norm,
)
from guarduq.scoring.memory import checkpoint_blocks
from guarduq.scoring.parameters import (  # noqa: F401 - re-exported: the scorer's public names
    ALL_PARAMETERS,
    grad_profile,
    parameter_groups,
    parameter_set_id,
    parse_parameter_set,
    select_parameters,
)
from guarduq.scoring.reuse import decoder_blocks, first_scored_block, pad_states, skip_blocks
from guarduq.scoring.scores import UNCERTAINTY_FIELDS, Scores, pass_scores  # noqa: F401 - re-exported

# Sequences longer than this are scored with activation checkpointing (``scoring.memory``). From
# benchmarks/long_context.py (SmolLM2, all parameters): at 967 tokens it saves 1.0 GB for 12% more
# time, at 3,952 tokens 5.0 GB for 36% more; past 2k the unchecked pass adds over 3 GB.
CHECKPOINT_TOKENS = 2048


# --------------------------------------------------------------------------- probabilities

def response_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    response_start: int,
    inputs_embeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_t of each response token [T], full log-softmax rows [T, V]) at temperature 1.

    Only the logits that predict response tokens are materialised (``logits_to_keep``).
    ``inputs_embeds``, when given, must be the embedding of ``input_ids``.
    """
    length = int(input_ids.shape[1])
    if not 0 < response_start < length:
        raise InputError("the scored sequence needs at least one prompt and one response token")
    keep = length - response_start + 1  # positions response_start-1 .. L-1
    inputs = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    try:
        logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits  # a KV cache: memory for nothing
    except TypeError:  # models whose forward has no logits_to_keep
        logits = model(**inputs).logits
    logits = logits[0, -keep:-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = input_ids[0, response_start:].unsqueeze(-1)
    return log_probs.gather(-1, targets).squeeze(-1), log_probs


def mean_token_prob(model: nn.Module, input_ids: torch.Tensor, response_start: int) -> float:
    """p̄ for one sequence, forward only (used to rank multiple-choice options)."""
    with torch.no_grad():
        tok_logp, _ = response_log_probs(model, input_ids, response_start)
    return float(tok_logp.exp().mean())


# --------------------------------------------------------------------------- the scorer


class GradientScorer:
    """Scores (prompt, response) sequences with one forward and one backward pass.

    Parameters are set in ``__init__`` and nothing is fitted: the scorer reads the model and
    leaves it exactly as found (training flag, ``requires_grad``, ``.grad``, no hooks left).
    """

    def __init__(
        self,
        model: nn.Module,
        parameters: str | Sequence[str] | None = None,
        last_n_blocks: int | None = None,
        checkpoint_tokens: int | None = CHECKPOINT_TOKENS,
    ) -> None:
        self.model = model
        self.parameters = parameters
        self.last_n_blocks = last_n_blocks
        self.checkpoint_tokens = checkpoint_tokens
        self.selected = select_parameters(model, parameters, last_n_blocks)
        self.groups = parameter_groups(model, self.selected)
        self.n_params = sum(p.numel() for _, p in self.selected)
        self.parameter_set = parameter_set_id(parameters, last_n_blocks)
        self.blocks = decoder_blocks(model, self.selected)  # the transformer blocks scored
        # k: scoring may start at block k from states generation recorded (None: it may not)
        self.reuse_block = first_scored_block(model, self.selected, self.groups)
        self._batched: BatchedScorer | None = None

    def score_batch(
        self,
        items: Sequence[tuple[torch.Tensor, int]],
        batch_size: int | None = None,
        states: Sequence[torch.Tensor | None] | None = None,
    ) -> list[Scores]:
        """``score`` of each (input_ids [1, L], response_start), ``batch_size`` sequences per
        forward+backward (default: all at once); see ``guarduq.scoring.batched``. Equal to ``score`` up
        to float rounding; ``timings`` are amortised: the batch's forward and backward seconds
        divided by its size, so they sum to the batch's wall time. ``states``: as in ``score``,
        one per item (None where there are none). Sequences longer than ``checkpoint_tokens`` are
        scored one at a time, with activation checkpointing."""
        if self._batched is None:
            self._batched = BatchedScorer(self)
        items = list(items)
        states = list(states) if states is not None else [None] * len(items)
        if len(states) != len(items):
            raise InputError(f"{len(states)} states for {len(items)} items")
        out: list[Scores | None] = [None] * len(items)
        for with_states in (False, True):  # a batch runs all its sequences through the same blocks
            idx = [
                i for i, st in enumerate(states)
                if (st is not None) == with_states and not self._checkpointed(items[i][0])
            ]
            if idx:
                got = self._batched.score([items[i] for i in idx], batch_size, [states[i] for i in idx])
                for i, s in zip(idx, got, strict=True):
                    out[i] = s
        for i, s in enumerate(out):
            if s is None:
                out[i] = self.score(*items[i], states=states[i])
        return out  # type: ignore[return-value]

    def score(
        self, input_ids: torch.Tensor, response_start: int, states: torch.Tensor | None = None
    ) -> Scores:
        """Scores of one sequence. ``states`` [1, ≥ L-1, d]: the hidden states entering block
        ``reuse_block`` at its positions, recorded during generation (``guarduq.scoring.reuse``);
        the blocks below are then not run."""
        with (
            model_lock(self.model),
            scoring_state(self.model, [p for _, p in self.selected]),
            self.skipping(states, int(input_ids.shape[1]) if isinstance(input_ids, torch.Tensor) else 0),
            self._checkpointing(input_ids),
        ):
            return self._score(input_ids, response_start)

    def skipping(self, states: torch.Tensor | None, length: int) -> Any:
        """Context in which blocks below ``reuse_block`` return ``states`` (a no-op without)."""
        if states is None:
            return contextlib.nullcontext()
        if self.reuse_block is None:
            raise InputError("recorded states given, but the scored parameters do not allow skipping blocks")
        return skip_blocks(self.blocks, self.reuse_block, pad_states(states, length))

    def _checkpointed(self, input_ids: torch.Tensor) -> bool:
        long = isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 and input_ids.shape[1] > (self.checkpoint_tokens or 0)
        return self.checkpoint_tokens is not None and bool(long)

    def _checkpointing(self, input_ids: torch.Tensor) -> Any:
        if not self._checkpointed(input_ids):
            return contextlib.nullcontext()
        return checkpoint_blocks(self.blocks, self.reuse_block or 0)

    def _score(self, input_ids: torch.Tensor, response_start: int) -> Scores:
        totals = [0.0] * len(self.selected)
        finite = [True]
        vocab = VocabGradients.attach(self.model, input_ids, self.selected)

        def make_hook(i: int) -> Any:
            def hook(p: torch.Tensor) -> None:
                with torch.no_grad():
                    sq = squared_norm(p.grad) if p.grad is not None else 0.0
                    totals[i] += sq
                    if not math.isfinite(sq):
                        finite[0] = False
                    p.grad = None  # never hold the full gradient

            return hook

        handles = [
            p.register_post_accumulate_grad_hook(make_hook(i))
            for i, (_, p) in enumerate(self.selected)
            if p.requires_grad  # the LM head may be handled by VocabGradients instead
        ]
        try:
            t0 = time.perf_counter()
            with torch.enable_grad():
                tok_logp, log_probs = response_log_probs(
                    self.model,
                    input_ids,
                    response_start,
                    inputs_embeds=vocab.embeds,
                )
                probs = tok_logp.exp()
                p_bar = probs.mean()
                t1 = time.perf_counter()
                p_bar.backward()
            for i, value in vocab.contributions()[0].items():
                totals[i] += value
                finite[0] = finite[0] and math.isfinite(value)
            t2 = time.perf_counter()
        finally:
            vocab.detach()
            for h in handles:
                h.remove()
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        timings = {"forward_s": t1 - t0, "backward_s": t2 - t1}
        return pass_scores(
            tok_logp.detach(), float(entropy), totals, finite[0], timings,
            n_params=self.n_params, groups=self.groups, parameter_set=self.parameter_set,
        )

