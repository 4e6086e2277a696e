"""The pieces both gradient scorers build on (one sequence in ``uncertainty``, a batch in
``batched``): the model's lock and scoring state, and the exact squared norms of gradients that
are never built whole (the vocabulary matrices, embedding rows, float64 accumulation).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from guarduq.scoring.parameters import optional_call

_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """One lock per model: scoring toggles ``requires_grad`` and hooks, shared model state."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


class VocabGradients:
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
        emb = optional_call(model, "get_input_embeddings")
        head = optional_call(model, "get_output_embeddings")
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
    ) -> VocabGradients:
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
            head.weight.requires_grad_(False)  # restored by scoring_state
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


def squared_norm(g: torch.Tensor, chunk: int = 1 << 20) -> float:
    """‖g‖² accumulated in float64, one chunk at a time (no full float64 copy of ``g``)."""
    flat = g.reshape(-1)
    total = 0.0
    for part in flat.split(chunk):
        d = part.double()
        total += float(torch.dot(d, d))
    return total


class scoring_state:  # lower case: used as a context manager, like contextlib's
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
