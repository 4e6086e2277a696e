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

import math
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from guarduq.errors import InputError

# Every *uncertainty* score follows "higher = more uncertain". Confidence-like quantities
# (mean_token_prob, mean_logprob, min_token_prob) keep their own names.
UNCERTAINTY_FIELDS = ("epistemic", "aleatoric", "mean_entropy")


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

    def to_dict(self, with_token_probs: bool = True) -> dict[str, Any]:
        d = asdict(self)
        d["token_probs"] = list(self.token_probs)
        if not with_token_probs:
            d.pop("token_probs")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scores:
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["token_probs"] = tuple(kw.get("token_probs", ()))
        kw.setdefault("timings", {})
        return cls(**kw)


# --------------------------------------------------------------------------- parameter selection

_BLOCK_INDEX = re.compile(r"\.(?:layers|h|blocks|block|layer)\.(\d+)\.")


def select_parameters(
    model: nn.Module,
    patterns: str | Sequence[str] | None = None,
    last_n_blocks: int | None = None,
) -> list[tuple[str, nn.Parameter]]:
    """Parameters that enter the gradient norm (default: all; tied weights once).

    ``patterns`` are regular expressions searched in parameter names; ``last_n_blocks`` keeps the
    parameters of the last N transformer blocks. Both given: a parameter must satisfy both.
    """
    named = list(model.named_parameters())  # de-duplicates tied parameters
    if isinstance(patterns, str):
        patterns = [patterns]
    if patterns is not None:
        try:
            regexes = [re.compile(p) for p in patterns]
        except re.error as exc:
            raise InputError(f"invalid parameter pattern: {exc}") from exc
        named = [(n, p) for n, p in named if any(r.search(n) for r in regexes)]
    if last_n_blocks is not None:
        if last_n_blocks < 1:
            raise InputError(f"last_n_blocks must be >= 1, got {last_n_blocks}")
        indices = {int(m.group(1)) for n, _ in named if (m := _BLOCK_INDEX.search(n))}
        if not indices:
            raise InputError("last_n_blocks given but no numbered transformer blocks were found")
        first = max(indices) - last_n_blocks + 1
        named = [
            (n, p) for n, p in named if (m := _BLOCK_INDEX.search(n)) and int(m.group(1)) >= first
        ]
    if not named:
        raise InputError("no parameters selected for the gradient norm")
    return named


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
        logits = model(**inputs, logits_to_keep=keep).logits
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
    ) -> None:
        self.model = model
        self.parameters = parameters
        self.last_n_blocks = last_n_blocks
        self._selected = select_parameters(model, parameters, last_n_blocks)
        self.n_params = sum(p.numel() for _, p in self._selected)

    def score(self, input_ids: torch.Tensor, response_start: int) -> Scores:
        with model_lock(self.model), _scoring_state(self.model, [p for _, p in self._selected]):
            return self._score(input_ids, response_start)

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
            for i, value in vocab.contributions().items():
                totals[i] += value
                finite[0] = finite[0] and math.isfinite(value)
            t2 = time.perf_counter()
        finally:
            vocab.detach()
            for h in handles:
                h.remove()
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        pb = float(p_bar.detach())
        token_probs = tuple(float(x) for x in probs.detach())
        epistemic = math.fsum(totals)  # fixed order: bit-identical across runs and threads
        valid, reason = True, None
        if not all(math.isfinite(x) for x in token_probs):
            valid, reason = False, "non-finite token probability"
        elif not finite[0] or not math.isfinite(epistemic):
            valid, reason = False, "non-finite gradient"
        return Scores(
            epistemic=epistemic,
            aleatoric=pb * (1.0 - pb),
            mean_token_prob=pb,
            mean_logprob=float(tok_logp.detach().mean()),
            min_token_prob=min(token_probs),
            mean_entropy=float(entropy),
            n_tokens=len(token_probs),
            token_probs=token_probs,
            n_params=self.n_params,
            valid=valid,
            reason=reason,
            timings={"forward_s": t1 - t0, "backward_s": t2 - t1},
        )


class _VocabGradients:
    """Gradients of the two [vocab, d] matrices without ever building them.

    An embedding lookup's backward builds a dense [vocab, d] gradient, and so does the LM head
    (a fifth of SmolLM2 each; both hit the same tensor when tied): most of a naive scorer's peak.

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
        self._handle: Any = None

    @classmethod
    def attach(
        cls, model: nn.Module, input_ids: torch.Tensor, selected: list[tuple[str, nn.Parameter]]
    ) -> _VocabGradients:
        self = cls()
        index = {id(p): i for i, (_, p) in enumerate(selected)}
        emb = _call(model, "get_input_embeddings")
        if isinstance(emb, nn.Embedding) and emb.max_norm is None and id(emb.weight) in index:
            self.emb, self.emb_index = emb, index[id(emb.weight)]
            scale = getattr(emb, "embed_scale", 1.0)  # Gemma-style scaled embeddings
            self.scale = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
            self.rows, self.inverse = torch.unique(input_ids[0], return_inverse=True)
            live = torch.ones_like(self.rows, dtype=torch.bool)
            if emb.padding_idx is not None:  # nn.Embedding gives its padding row no gradient
                live = self.rows != emb.padding_idx
            self.live = live
            with torch.no_grad():
                self.embeds = emb(input_ids).detach()
            self.embeds.requires_grad_(True)
        head = _call(model, "get_output_embeddings")
        tied_ok = self.emb is not None or (emb is None or head is None or head.weight is not emb.weight)
        if isinstance(head, nn.Linear) and head.bias is None and id(head.weight) in index and tied_ok:
            self.head, self.head_index = head, index[id(head.weight)]
            head.weight.requires_grad_(False)  # restored by _scoring_state
            self._handle = head.register_forward_hook(self._capture)
        return self

    def _capture(self, module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        self._h = inputs[0].detach()
        if output.requires_grad:
            output.register_hook(self._keep_d)

    def _keep_d(self, grad: torch.Tensor) -> None:
        self._d = grad.detach()

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()

    def contributions(self) -> dict[int, float]:
        """Squared-norm contribution of each handled parameter, by its index in ``selected``."""
        out: dict[int, float] = {}
        with torch.no_grad():
            g_rows = None
            if self.head is not None:
                d = self._d.reshape(-1, self._d.shape[-1]) if self._d is not None else None
                h = self._h.reshape(-1, self._h.shape[-1]).double() if self._h is not None else None
                if d is None or h is None:
                    out[self.head_index] = 0.0
                else:
                    out[self.head_index] = float((_gram(d) * (h @ h.T)).sum())
                    if self.emb is not None and self.head.weight is self.emb.weight:
                        g_rows = d[:, self.rows].double().T @ h
            if self.emb is not None:
                d_out = self.embeds.grad[0].double() * self.scale
                e = torch.zeros(len(self.rows), d_out.shape[-1], dtype=torch.float64)
                e.index_add_(0, self.inverse, d_out)
                e = e * self.live.unsqueeze(-1)
                cross = 2.0 * float((g_rows * e).sum()) if g_rows is not None else 0.0
                out[self.emb_index] = out.get(self.emb_index, 0.0) + cross + float((e * e).sum())
        return out


def _gram(d: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """D Dᵀ in float64, over vocabulary chunks (no float64 copy of the whole [T, V] matrix)."""
    out = torch.zeros(d.shape[0], d.shape[0], dtype=torch.float64)
    for part in d.split(chunk, dim=1):
        p = part.double()
        out += p @ p.T
    return out


def _call(model: nn.Module, name: str) -> Any:
    fn = getattr(model, name, None)
    try:
        return fn() if callable(fn) else None
    except NotImplementedError:
        return None


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
