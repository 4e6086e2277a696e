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
    # ‖∇p̄‖² split by parameter group (see ``parameter_groups``); sums to ``epistemic``.
    grad_profile: dict[str, float] = field(default_factory=dict)

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


def parameter_groups(model: nn.Module, selected: list[tuple[str, nn.Parameter]]) -> list[str]:
    """The ``grad_profile`` group of each selected parameter.

    ``embed``: token and position embeddings, and an LM head tied to them (one shared matrix,
    one parameter, counted once, cross term included); ``head``: an untied LM head;
    ``block.{i}.norm`` / ``.attn`` / ``.mlp`` / ``.other`` inside numbered block i (a norm
    inside attention, e.g. Gemma's q_norm, is a norm); ``final_norm``; ``other``.
    """
    emb = _call(model, "get_input_embeddings")
    head = _call(model, "get_output_embeddings")
    head_params = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    modules = dict(model.named_modules())
    groups = []
    for name, p in selected:
        path = name.rsplit(".", 1)[0] if "." in name else ""
        leaf = path.rsplit(".", 1)[-1]
        is_norm = "norm" in leaf.lower() or leaf.startswith("ln")
        if (isinstance(emb, nn.Module) and p is getattr(emb, "weight", None)) or isinstance(
            modules.get(path), nn.Embedding
        ):
            groups.append("embed")
        elif id(p) in head_params:
            groups.append("head")
        elif m := _BLOCK_INDEX.search(name):
            rest = name[m.end() :].lower()
            kind = (
                "norm" if is_norm
                else "attn" if "attn" in rest or "attention" in rest
                else "mlp" if "mlp" in rest or "ffn" in rest or "feed_forward" in rest
                else "other"
            )
            groups.append(f"block.{m.group(1)}.{kind}")
        else:
            groups.append("final_norm" if is_norm else "other")
    return groups


def grad_profile(groups: Sequence[str], totals: Sequence[float]) -> dict[str, float]:
    """Per-group sums (math.fsum) of the per-parameter squared norms, in first-seen order."""
    parts: dict[str, list[float]] = {}
    for g, v in zip(groups, totals, strict=True):
        parts.setdefault(g, []).append(v)
    return {g: math.fsum(v) for g, v in parts.items()}


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
        self._groups = parameter_groups(model, self._selected)
        self.n_params = sum(p.numel() for _, p in self._selected)
        self._batched: Any = None

    def score_batch(
        self, items: Sequence[tuple[torch.Tensor, int]], batch_size: int | None = None
    ) -> list[Scores]:
        """``score`` of each (input_ids [1, L], response_start), ``batch_size`` sequences per
        forward+backward (default: all at once); see ``guarduq.scoring.batched``. Equal to ``score`` up
        to float rounding; ``timings`` are amortised: the batch's forward and backward seconds
        divided by its size, so they sum to the batch's wall time."""
        if self._batched is None:
            from guarduq.scoring.batched import BatchedScorer  # it builds on this module

            self._batched = BatchedScorer(self)
        return self._batched.score(items, batch_size)

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
