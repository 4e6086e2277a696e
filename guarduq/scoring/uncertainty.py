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
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from guarduq.errors import InputError
from guarduq.scoring.memory import checkpoint_blocks
from guarduq.scoring.parameters import (  # noqa: F401 - re-exported: the scorer's public names
    ALL_PARAMETERS,
    _call,
    grad_profile,
    parameter_groups,
    parameter_set_id,
    parse_parameter_set,
    select_parameters,
)
from guarduq.scoring.reuse import decoder_blocks, first_scored_block, pad_states, skip_blocks

# Every *uncertainty* score follows "higher = more uncertain". Confidence-like quantities
# (mean_token_prob, mean_logprob, min_token_prob) keep their own names.
UNCERTAINTY_FIELDS = ("epistemic", "aleatoric", "mean_entropy")

# Sequences longer than this are scored with activation checkpointing (``scoring.memory``). From
# benchmarks/long_context.py (SmolLM2, all parameters): at 967 tokens it saves 1.0 GB for 12% more
# time, at 3,952 tokens 5.0 GB for 36% more; past 2k the unchecked pass adds over 3 GB.
CHECKPOINT_TOKENS = 2048


@dataclass(frozen=True)
class Scores:
    """Everything one forward+backward pass yields for one (prompt, response) pair."""

    epistemic: float
    aleatoric: float
    mean_token_prob: float
    mean_logprob: float
    min_token_prob: float
    mean_entropy: float
    n_tokens: int
    token_probs: tuple[float, ...]
    n_params: int
    valid: bool = True
    reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # ‖∇p̄‖² split by parameter group (see ``parameter_groups``); sums to ``epistemic``.
    grad_profile: dict[str, float] = field(default_factory=dict)
    # which parameters the gradient covered (``parameter_set_id``); scores taken over different
    # sets are different quantities, and a calibrator reads only its own
    parameter_set: str = "all"

    def to_dict(self, with_token_probs: bool = True, with_grad_profile: bool = True) -> dict[str, Any]:
        """JSON-friendly fields; log lines drop the per-token and per-group lists to stay short."""
        d = asdict(self)
        d["token_probs"] = list(self.token_probs)
        if not with_token_probs:
            d.pop("token_probs")
        if not with_grad_profile:
            d.pop("grad_profile", None)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scores:
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["token_probs"] = tuple(kw.get("token_probs", ()))
        kw.setdefault("timings", {})
        kw["grad_profile"] = dict(kw.get("grad_profile") or {})  # absent in caches written before it
        kw["parameter_set"] = kw.get("parameter_set") or "all"  # every earlier cache scored all
        return cls(**kw)


# --------------------------------------------------------------------------- probabilities

_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """One lock per model: scoring toggles ``requires_grad`` and hooks, shared model state."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


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
        self._selected = select_parameters(model, parameters, last_n_blocks)
        self._groups = parameter_groups(model, self._selected)
        self.n_params = sum(p.numel() for _, p in self._selected)
        self.parameter_set = parameter_set_id(parameters, last_n_blocks)
        self.blocks = decoder_blocks(model, self._selected)  # the transformer blocks scored
        # k: scoring may start at block k from states generation recorded (None: it may not)
        self.reuse_block = first_scored_block(model, self._selected, self._groups)
        self._batched: Any = None

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
            from guarduq.scoring.batched import BatchedScorer  # it builds on this module

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
            _scoring_state(self.model, [p for _, p in self._selected]),
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
        totals = [0.0] * len(self._selected)
        finite = [True]
        vocab = _VocabGradients.attach(self.model, input_ids, self._selected)

        def make_hook(i: int) -> Any:
            def hook(p: torch.Tensor) -> None:
                with torch.no_grad():
                    sq = _squared_norm(p.grad) if p.grad is not None else 0.0
                    totals[i] += sq
                    if not math.isfinite(sq):
                        finite[0] = False
                    p.grad = None  # never hold the full gradient

            return hook

        handles = [
            p.register_post_accumulate_grad_hook(make_hook(i))
            for i, (_, p) in enumerate(self._selected)
            if p.requires_grad  # the LM head may be handled by _VocabGradients instead
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
        return self._result(tok_logp.detach(), float(entropy), totals, finite[0], timings)

    def _result(
        self, tok_logp: torch.Tensor, entropy: float, totals: list[float], finite: bool, timings: dict[str, float]
    ) -> Scores:
        """Scores from the response tokens' log p [T], the mean entropy and the per-parameter
        squared norms (both paths)."""
        probs = tok_logp.exp()
        pb = float(probs.mean())
        token_probs = tuple(float(x) for x in probs)
        epistemic = math.fsum(totals)  # fixed order: bit-identical across runs and threads
        valid, reason = True, None
        if not all(math.isfinite(x) for x in token_probs):
            valid, reason = False, "non-finite token probability"
        elif not finite or not math.isfinite(epistemic):
            valid, reason = False, "non-finite gradient"
        return Scores(
            epistemic=epistemic,
            aleatoric=pb * (1.0 - pb),
            mean_token_prob=pb,
            mean_logprob=float(tok_logp.mean()),
            min_token_prob=min(token_probs),
            mean_entropy=entropy,
            n_tokens=len(token_probs),
            token_probs=token_probs,
            n_params=self.n_params,
            valid=valid,
            reason=reason,
            timings=dict(timings),
            grad_profile=grad_profile(self._groups, totals),
            parameter_set=self.parameter_set,
        )


class _VocabGradients:
    """Gradients of the two [vocab, d] matrices without ever building them, per sequence.

    An embedding lookup's backward builds a dense [vocab, d] gradient, and so does the LM head
    (a fifth of SmolLM2 each; both hit the same tensor when tied): most of a naive scorer's peak.
    Sequences of a batch never interact, so everything below is done for each sequence i of the
    batch on its own rows and positions (one sequence: the batch-1 path of ``score``).

    * Input embedding E: the model is fed ``inputs_embeds`` looked up outside autograd; the
      gradient w.r.t. them, summed per token id, is E's gradient on the few rows the sequence uses.
    * LM head G = Dᵀ H (D: gradient w.r.t. the logits [T, V], H: the head's input [T, d]); the
      head's weight is frozen for the pass and ‖G‖² = Σ (D Dᵀ) ⊙ (H Hᵀ) uses T×T Gram matrices.
    * Tied: ‖G + E‖² = ‖G‖² + 2⟨G_rows, E⟩ + ‖E‖², with G_rows = D[:, rows]ᵀ H.

    Each route is taken only for a plain ``nn.Embedding`` / bias-free ``nn.Linear`` whose weight
    is selected; anything else keeps the ordinary per-parameter hook. The result is exact.
    """

    def __init__(self) -> None:
        self.emb: nn.Embedding | None = None
        self.head: nn.Linear | None = None
        self.emb_index = self.head_index = -1
        self.embeds: torch.Tensor | None = None
        self._h: torch.Tensor | None = None
        self._d: torch.Tensor | None = None
        self._handles: list[Any] = []

    @staticmethod
    def routes(
        model: nn.Module, selected: list[tuple[str, nn.Parameter]]
    ) -> tuple[nn.Embedding | None, nn.Linear | None]:
        """The input embedding and LM head whose selected weights this class takes over."""
        index = {id(p) for _, p in selected}
        emb = _call(model, "get_input_embeddings")
        head = _call(model, "get_output_embeddings")
        ok_emb = isinstance(emb, nn.Embedding) and emb.max_norm is None and id(emb.weight) in index
        ok_head = isinstance(head, nn.Linear) and head.bias is None and id(head.weight) in index
        tied = emb is not None and head is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0)
        if tied and not (ok_emb and ok_head):  # one route alone would miss the cross term
            ok_emb = ok_head = False
        return (emb if ok_emb else None), (head if ok_head else None)

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        input_ids: torch.Tensor,
        selected: list[tuple[str, nn.Parameter]],
        lengths: Sequence[int] | None = None,
    ) -> _VocabGradients:
        """Set up for ``input_ids`` [B, L]; sequence i is real on its first ``lengths[i]``."""
        self = cls()
        self.lengths = list(lengths) if lengths is not None else [int(input_ids.shape[1])] * len(input_ids)
        self._ids = [input_ids[i, :n] for i, n in enumerate(self.lengths)]
        index = {id(p): i for i, (_, p) in enumerate(selected)}
        emb, head = self.routes(model, selected)
        if emb is not None:
            self.emb, self.emb_index = emb, index[id(emb.weight)]
            scale = getattr(emb, "embed_scale", 1.0)  # Gemma-style scaled embeddings
            self.scale = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
            with torch.no_grad():
                self.embeds = emb(input_ids).detach()
            self.embeds.requires_grad_(True)
        if head is not None:
            self.head, self.head_index = head, index[id(head.weight)]
            head.weight.requires_grad_(False)  # restored by _scoring_state
            self._handles = [head.register_forward_hook(self._capture)]
        return self

    def _capture(self, module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        self._h = inputs[0].detach()
        output = output_needs_grad(output)
        if output.requires_grad:
            output.register_hook(self._keep_d)
        return output

    def _keep_d(self, grad: torch.Tensor) -> None:
        self._d = grad.detach()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()

    def contributions(self, head_rows: Sequence[tuple[int, slice]] | None = None) -> list[dict[int, float]]:
        """Squared-norm contribution of each handled parameter, by its index in ``selected``,
        for each sequence. ``head_rows[i]`` = (row, positions) of the head's input and output
        that belong to sequence i (default: row i, every position the head saw)."""
        outs: list[dict[int, float]] = [{} for _ in self.lengths]
        with torch.no_grad():
            for i, out in enumerate(outs):
                g_rows = None
                if self.head is not None:
                    if self._d is None or self._h is None:
                        out[self.head_index] = 0.0
                    else:
                        row, rows = head_rows[i] if head_rows is not None else (i, slice(None))
                        d, h = self._d[row, rows], self._h[row, rows].double()
                        out[self.head_index] = float((_gram(d) * (h @ h.T)).sum())
                        if self.emb is not None and self.head.weight is self.emb.weight:
                            ids = self._ids[i]
                            g_rows = d[:, torch.unique(ids)].double().T @ h
                if self.emb is not None:
                    grad = self.embeds.grad
                    if grad is None:
                        out[self.emb_index] = out.get(self.emb_index, 0.0)
                        continue
                    e = row_gradient(self._ids[i], grad[i, : self.lengths[i]], self.emb.padding_idx, self.scale)
                    cross = 2.0 * float((g_rows * e).sum()) if g_rows is not None else 0.0
                    out[self.emb_index] = out.get(self.emb_index, 0.0) + cross + float((e * e).sum())
        return outs


def row_gradient(
    ids: torch.Tensor, grad: torch.Tensor, padding_idx: int | None, scale: float = 1.0
) -> torch.Tensor:
    """An embedding's weight gradient on the rows ``ids`` uses, in float64 (one per unique id,
    in ``torch.unique`` order): Σ of the output gradients [T, d] of each id, times ``scale``;
    ``nn.Embedding`` gives its padding row no gradient."""
    rows, inverse = torch.unique(ids, return_inverse=True)
    e = torch.zeros(len(rows), grad.shape[-1], dtype=torch.float64, device=grad.device)
    e.index_add_(0, inverse, grad.double() * scale)
    if padding_idx is not None:
        e[rows == padding_idx] = 0.0
    return e


def output_needs_grad(output: torch.Tensor) -> torch.Tensor:
    """A frozen module's output as a tensor autograd differentiates (same values).

    With every weight frozen, a module whose inputs need no gradient (position embeddings, the
    head when only it is selected) produces an output autograd never reaches; a forward hook
    returning a fresh grad-requiring leaf in its place gives it one, at no extra cost.
    """
    if output.requires_grad or not output.is_floating_point() or not torch.is_grad_enabled():
        return output
    return output.detach().requires_grad_(True)


def _gram(d: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """D Dᵀ in float64 over the last dim in chunks (no float64 copy of the whole [.., T, V])."""
    out = torch.zeros(*d.shape[:-1], d.shape[-2], dtype=torch.float64, device=d.device)
    for part in d.split(chunk, dim=-1):
        p = part.double()
        out += p @ p.mT
    return out


def _squared_norm(g: torch.Tensor, chunk: int = 1 << 20) -> float:
    """‖g‖² accumulated in float64, one chunk at a time (no full float64 copy of ``g``)."""
    flat = g.reshape(-1)
    total = 0.0
    for part in flat.split(chunk):
        d = part.double()
        total += float(torch.dot(d, d))
    return total


class _scoring_state:
    """Context manager: eval mode, grads only on ``selected``, user state restored on exit."""

    def __init__(self, model: nn.Module, selected: Iterable[nn.Parameter]) -> None:
        self.model = model
        self.selected = {id(p) for p in selected}

    def __enter__(self) -> None:
        self.training = self.model.training
        self.params = list(self.model.parameters())
        self.flags = [p.requires_grad for p in self.params]
        self.grads = [p.grad for p in self.params]
        self.model.eval()
        for p in self.params:
            p.grad = None
            p.requires_grad_(id(p) in self.selected)

    def __exit__(self, *exc: object) -> None:
        for p, flag, grad in zip(self.params, self.flags, self.grads, strict=True):
            p.requires_grad_(flag)
            p.grad = grad
        self.model.train(self.training)
