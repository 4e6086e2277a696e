"""Exact per-sequence gradient norms for a whole batch: one forward and one backward.

For sequences i = 1..B with mean response-token probabilities p̄_i, one backward of Σ_i p̄_i
gives, at every activation, the sum over i of ∂p̄_i/∂activation; sequence i's activations only
feed p̄_i, so each activation gradient is exactly the per-sequence one. A parameter's gradient,
though, would sum over the batch. So every weight is frozen for the pass and its per-sequence
squared norm is rebuilt from activations and activation gradients (the "ghost norm" of DP
per-sample clipping: Goodfellow 2015; Li et al. 2022; Bu et al. 2023, book-keeping; Opacus):

* ``nn.Linear`` / GPT-2 ``Conv1D`` with input a_t and output gradient g_t over sequence i's real
  positions t: ∇W_i = Σ_t g_t a_tᵀ, so ‖∇W_i‖² = Σ_{t,s} (g_t·g_s)(a_t·a_s) = ⟨G_g, G_a⟩ with
  T×T Gram matrices (cost T²(d_in+d_out)), or the explicit [d_out, d_in] per-sequence gradient
  (cost T d_in d_out) when that is cheaper; ∇b_i = Σ_t g_t.
* input embedding and LM head (tied or not): ``VocabGradients``, per sequence.
* other embeddings (GPT-2 positions): the rows each sequence uses, as for the input embedding.
* norms and any other module called on one tensor: per-sequence vector-Jacobian products of the
  module alone (``torch.func.vmap`` over the batch), exact for any module that does not mix
  sequences.

Sequences are right-padded: positions stay 0..L_i-1 and, under the causal mask, no real
position ever attends to a padding position (they all come after it), so no padding mask is
passed (one would make padding rows fully masked under sliding windows: NaN that 0·NaN carries
back into real gradients) and padding positions are masked out of every sum. Anything else
(a selected parameter in a module type not listed, a module called twice, a model that takes
no ``inputs_embeds``/``position_ids``) is scored sequentially, with a logged reason.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from guarduq._logging import get_logger
from guarduq.errors import InputError
from guarduq.scoring.gradients import (
    VocabGradients,
    model_lock,
    output_needs_grad,
    row_gradient,
    scoring_state,
)
from guarduq.scoring.parameters import optional_call
from guarduq.scoring.reuse import pad_states
from guarduq.scoring.scores import Scores, pass_scores

log = get_logger("batched")



class _Unsupported(Exception):
    """This batch cannot be scored exactly in one pass; the reason is logged."""


class Scorer(Protocol):
    """What the batch path reads of ``uncertainty.GradientScorer``, which builds on this module."""

    model: nn.Module
    selected: list[tuple[str, nn.Parameter]]
    groups: list[str]
    n_params: int
    parameter_set: str

    def score(self, input_ids: torch.Tensor, response_start: int, states: torch.Tensor | None = None) -> Scores: ...

    def skipping(self, states: torch.Tensor | None, length: int) -> Any: ...


class BatchedScorer:
    """``GradientScorer.score_batch``: B sequences per forward and backward, same numbers."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.model = scorer.model
        self.selected = scorer.selected
        self.groups = scorer.groups
        self.reason = _static_reason(self.model, self.selected)

    def score(
        self,
        items: Sequence[tuple[torch.Tensor, int]],
        batch_size: int | None = None,
        states: Sequence[torch.Tensor | None] | None = None,
    ) -> list[Scores]:
        """Scores in the order of ``items``; batches group similar lengths (less padding).
        ``states``: recorded states per item (``GradientScorer.score``), all given or none."""
        items = list(items)
        states = list(states) if states is not None else [None] * len(items)
        if any(st is None for st in states) and any(st is not None for st in states):
            raise InputError("states must be given for every item of a batch or for none")
        if batch_size is not None and batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        for ids, start in items:
            if not (isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[0] == 1):
                raise InputError("each item needs input_ids of shape [1, L]")
            if not 0 < start < ids.shape[1]:
                raise InputError("the scored sequence needs at least one prompt and one response token")
        order = sorted(range(len(items)), key=lambda i: -items[i][0].shape[1])
        size = batch_size or max(len(items), 1)
        out: list[Scores | None] = [None] * len(items)
        for k in range(0, len(order), size):
            chunk = order[k : k + size]
            got = self._score_chunk([items[i] for i in chunk], [states[i] for i in chunk])
            for i, s in zip(chunk, got, strict=True):
                out[i] = s
        return out  # type: ignore[return-value]

    def _score_chunk(
        self, items: list[tuple[torch.Tensor, int]], states: list[torch.Tensor | None]
    ) -> list[Scores]:
        reason = self.reason
        if reason is None:
            try:
                with model_lock(self.model), scoring_state(self.model, ()):
                    return self._batched(items, states)
            except _Unsupported as exc:
                reason = str(exc)
        log.warning("batched_scoring_fallback", reason=reason, batch=len(items), path="sequential")
        return [self.scorer.score(ids, start, st) for (ids, start), st in zip(items, states, strict=True)]

    def _batched(self, items: list[tuple[torch.Tensor, int]], states: list[torch.Tensor | None]) -> list[Scores]:
        model, n_batch = self.model, len(items)
        lengths = [int(ids.shape[1]) for ids, _ in items]
        starts = [s for _, s in items]
        full = max(lengths)
        device = items[0][0].device
        ids = torch.zeros(n_batch, full, dtype=torch.long, device=device)  # right padding, id 0
        for i, (x, _) in enumerate(items):
            ids[i, : lengths[i]] = x[0]
        batch_states = None
        if states and states[0] is not None:  # right-padded like ids (``reuse.pad_states``)
            batch_states = torch.cat([pad_states(st, full) for st in states if st is not None])
        real = torch.arange(full, device=device) < torch.tensor(lengths, device=device)[:, None]
        totals = torch.zeros(n_batch, len(self.selected), dtype=torch.float64)
        tape = _Tape(model, self.selected, real, totals)
        vocab = VocabGradients.attach(model, ids, self.selected, lengths)
        try:
            t0 = time.perf_counter()
            with torch.enable_grad(), self.scorer.skipping(batch_states, full):
                tok_logp, entropy, rows = self._forward(ids, vocab, starts, lengths)
                probs = tok_logp.exp()
                p_bars = torch.stack([probs[r].mean() for r in rows])
                tape.stop()
                t1 = time.perf_counter()
                p_bars.sum().backward()
            tape.finish()
            for i, contrib in enumerate(vocab.contributions([(0, r) for r in rows])):
                for j, value in contrib.items():
                    totals[i, j] += value
            t2 = time.perf_counter()
        finally:
            vocab.detach()
            tape.remove()
        per_item = {"forward_s": (t1 - t0) / n_batch, "backward_s": (t2 - t1) / n_batch}
        out = []
        for i, r in enumerate(rows):
            values = totals[i].tolist()
            finite = all(math.isfinite(v) for v in values)
            out.append(pass_scores(
                tok_logp[r].detach(), float(entropy[r].mean()), values, finite, per_item,
                n_params=self.scorer.n_params, groups=self.groups, parameter_set=self.scorer.parameter_set,
            ))
        return out

    def _forward(
        self, ids: torch.Tensor, vocab: VocabGradients, starts: list[int], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
        """log p and entropy of every response token, packed [N], and each sequence's slice.

        The LM head sees only the N positions that predict a response token, packed into one
        row [1, N, d] by a pre-hook (each logit row is a function of its own hidden state, and
        what follows the head, e.g. Gemma's soft-capping, is elementwise): no logits for the
        padding and prompt positions of a batch whose sequences start at different places.
        """
        n_batch, full = ids.shape
        keep = full - min(starts) + 1  # positions min(start)-1 .. L-1
        inputs: dict[str, Any] = {"input_ids": ids} if vocab.embeds is None else {"inputs_embeds": vocab.embeds}
        positions = torch.arange(full, device=ids.device).expand(n_batch, -1)
        pairs = list(zip(starts, lengths, strict=True))
        b_idx = torch.cat([torch.full((n - s,), i) for i, (s, n) in enumerate(pairs)]).to(ids.device)
        pos = torch.cat([torch.arange(s - 1, n - 1) for s, n in pairs]).to(ids.device)
        head = optional_call(self.model, "get_output_embeddings")
        if not isinstance(head, nn.Module):
            raise _Unsupported("the model exposes no output embedding module to pack")

        def pack(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            return (x[b_idx, pos - (full - x.shape[1])].unsqueeze(0), *args[1:])

        handle = head.register_forward_pre_hook(pack)
        try:
            try:
                logits = self.model(**inputs, position_ids=positions, logits_to_keep=keep, use_cache=False).logits
            except TypeError:  # models whose forward has no logits_to_keep
                logits = self.model(**inputs, position_ids=positions).logits
        except TypeError as exc:
            raise _Unsupported(f"the model's forward rejects batched inputs: {exc}") from exc
        finally:
            handle.remove()
        if logits.shape[:2] != (1, len(pos)):
            raise _Unsupported(f"packed logits came back as {tuple(logits.shape)}")
        picked = logits[0]
        log_probs = torch.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)), dim=-1)
        targets = ids[b_idx, pos + 1].unsqueeze(-1)
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        bounds = [0, *torch.tensor([n - s for s, n in pairs]).cumsum(0).tolist()]
        rows = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return log_probs.gather(-1, targets).squeeze(-1), entropy, rows


# --------------------------------------------------------------------------- which module, which route


def _owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Every module that directly holds each parameter (a tied weight has two)."""
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    return owners


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's linear layer (weight stored [in, out]). transformers is asked only for a module so
    named: importing it takes ~1.5 s, and this module loads with the scorer (and the CLI)."""
    if type(module).__name__ != "Conv1D":
        return False
    from transformers.pytorch_utils import Conv1D

    return type(module) is Conv1D


def _route(module: nn.Module) -> str:
    """How a module's own parameters are normed: "linear", "embedding", "small" (vmap)."""
    if (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward) or _is_conv1d(module):
        return "linear"
    if type(module) is nn.Embedding and module.max_norm is None:
        return "embedding"
    if isinstance(module, nn.Embedding):
        return "unsupported"  # scaled or max-norm embeddings other than the input one
    return "small"


def _static_reason(model: nn.Module, selected: list[tuple[str, nn.Parameter]]) -> str | None:
    """Why this selection cannot be batched (None: it can)."""
    emb, head = VocabGradients.routes(model, selected)
    vocab = {id(m.weight) for m in (emb, head) if m is not None}
    owners = _owners(model)
    for name, p in selected:
        if id(p) in vocab:
            continue
        mods = owners.get(id(p), [])
        if len(mods) != 1:
            return f"parameter {name} is shared by {len(mods)} modules"
        if _route(mods[0]) == "unsupported":
            return f"parameter {name} is in a {type(mods[0]).__name__}, which has no batched route"
    return None


class _Tape:
    """Hooks that turn each module's activations and output gradients into per-sequence
    squared norms, added to ``totals`` [B, n_selected] as soon as the gradient arrives."""

    def __init__(self, model: nn.Module, selected: list[tuple[str, nn.Parameter]],
                 real: torch.Tensor, totals: torch.Tensor) -> None:
        self.real, self.totals = real, totals
        self.recording = True
        self.errors: list[str] = []
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, its Gram)
        emb, head = VocabGradients.routes(model, selected)
        vocab = {id(m.weight) for m in (emb, head) if m is not None}
        owners = _owners(model)
        by_module: dict[nn.Module, dict[str, int]] = {}
        for j, (_, p) in enumerate(selected):
            if id(p) not in vocab:
                m = owners[id(p)][0]
                local = next(k for k, v in m._parameters.items() if v is p)
                by_module.setdefault(m, {})[local] = j
        self.handles: list[Any] = []
        self._calls: dict[nn.Module, list[int]] = {}
        for m, params in by_module.items():
            self.handles.append(m.register_forward_hook(self._hook(m, params), with_kwargs=True))

    def stop(self) -> None:
        """End of the forward: later calls (``_small``'s vmap) are not recorded."""
        self.recording, self._last = False, None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def finish(self) -> None:
        """After the backward: any recorded problem, or a module never called (its parameters
        may be used by another module's forward), sends the batch to the sequential path."""
        if self.errors:
            raise _Unsupported(self.errors[0])
        for m, calls in self._calls.items():
            if calls[0] == 0:
                raise _Unsupported(f"{type(m).__name__} holds selected parameters but was not called")

    def _hook(self, module: nn.Module, params: dict[str, int]) -> Any:
        route, calls = _route(module), [0]
        self._calls[module] = calls

        def forward_hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            if not self.recording:  # e.g. inside _small's vmap
                return None
            calls[0] += 1
            if calls[0] > 1:
                raise _Unsupported(f"{type(m).__name__} is called more than once per forward")
            x = args[0] if args else None
            if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)) or (
                route == "small" and (len(args) != 1 or kwargs)
            ):
                raise _Unsupported(f"{type(m).__name__} is not called on one tensor")
            lead = 1 if route == "small" else 2  # a norm may see [B, heads, T, d] (Gemma's q_norm)
            if x.shape[:lead] != self.real.shape[:lead] or out.shape[:lead] != self.real.shape[:lead]:
                raise _Unsupported(f"{type(m).__name__} sees a batch of shape {tuple(x.shape)}")
            # the Gram route keeps only A Aᵀ [B, T, T], not the activation itself
            saved = self._input_gram(x) if route == "linear" and self._use_gram(module) else x.detach()
            out = output_needs_grad(out)
            if out.requires_grad:
                out.register_hook(lambda g: self._on_grad(module, route, params, saved, g.detach()))
            return out

        return forward_hook

    def _on_grad(self, m: nn.Module, route: str, params: dict[str, int], x: torch.Tensor, g: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                gram_route = route == "linear" and self._use_gram(m) and "bias" not in params
                if not gram_route and g.ndim >= 2 and g.shape[1] == self.real.shape[1]:  # [B, T, ...]
                    g = torch.where(self.real.view(*self.real.shape, *[1] * (g.ndim - 2)), g, 0.0)
                # (elsewhere g is exactly 0 at padding already: no scored position depends on it;
                # the Gram route masks its T×T Grams instead, a far smaller copy)
                if route == "linear":
                    self._linear(m, params, x, g)
                elif route == "embedding":
                    for i, n in enumerate(self.real.sum(1).tolist()):
                        e = row_gradient(x[i, :n], g[i, :n], m.padding_idx)
                        self.totals[i, params["weight"]] += float((e * e).sum())
                else:
                    self._small(m, params, x, g)
        except Exception as exc:  # noqa: BLE001 - recorded, the batch is then scored sequentially
            self.errors.append(f"{type(m).__name__}: {type(exc).__name__}: {exc}")

    def _linear(self, m: nn.Module, params: dict[str, int], a: torch.Tensor, g: torch.Tensor) -> None:
        if "weight" in params:
            if self._use_gram(m):
                sq = (self._masked(_work_gram(g)) * a).sum((1, 2))  # a: the input's Gram
            else:
                a = torch.where(self.real[..., None], a, 0.0)
                sq = (g.mT @ a.to(g.dtype)).double().square().sum((1, 2))  # [B, d_out, d_in]
            self.totals[:, params["weight"]] += sq.cpu()
        if "bias" in params:
            self.totals[:, params["bias"]] += g.double().sum(1).square().sum(1).cpu()

    def _small(self, m: nn.Module, params: dict[str, int], x: torch.Tensor, g: torch.Tensor) -> None:
        """Per-sequence gradients of a module's own parameters: vmap of its vector-Jacobian
        product over the batch (the module's forward on sequence i alone, pulled back by g_i)."""
        own = {k: v.detach() for k, v in m.named_parameters(recurse=False)}

        def one(xi: torch.Tensor, gi: torch.Tensor) -> dict[str, torch.Tensor]:
            _, pull = torch.func.vjp(lambda p: torch.func.functional_call(m, p, (xi[None],))[0], own)
            return pull(gi)[0]

        grads = torch.func.vmap(one)(x, g.to(x.dtype))
        for k, j in params.items():
            self.totals[:, j] += grads[k].double().flatten(1).square().sum(1).cpu()

    def _masked(self, gram: torch.Tensor) -> torch.Tensor:
        """A [B, T, T] Gram in float64 with every entry that touches a padding position zeroed
        (entry (t, s) only ever reads positions t and s, so this equals masking the inputs)."""
        pair = self.real[:, :, None] & self.real[:, None, :]
        return torch.where(pair, gram, 0.0).double()

    def _use_gram(self, m: nn.Module) -> bool:
        """Gram matrices cost T²(d_in+d_out), the explicit gradient T·d_in·d_out: the cheaper."""
        d_in, d_out = (m.in_features, m.out_features) if isinstance(m, nn.Linear) else m.weight.shape
        return self.real.shape[1] * (d_in + d_out) <= d_in * d_out

    def _input_gram(self, x: torch.Tensor) -> torch.Tensor:
        """Masked A Aᵀ per sequence, once for the q/k/v (gate/up) called on the same tensor."""
        if self._last is None or self._last[0] is not x:
            self._last = (x, self._masked(_work_gram(x.detach())))
        return self._last[1]


def _work_gram(x: torch.Tensor) -> torch.Tensor:
    """X Xᵀ [B, T, T] in the activations' precision (at least float32), summed over T×T in
    float64 by the caller. Each entry is a d-term dot product, the same rounding class as the
    fp32 weight gradient Σ_t g_t a_tᵀ the sequential path squares; an fp64 Gram costs twice
    the time (a fifth of a batch on CPU) for digits below the model's fp32 floor."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x @ x.mT
