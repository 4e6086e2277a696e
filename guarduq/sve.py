"""Singular Value Ensemble (SVE): M members that differ only in singular values and biases.

Each targeted weight ``W = U Σ Vᵀ`` of a frozen pretrained model keeps its ``U`` and ``V`` (buffers)
and gets, per member m, its own singular values ``Σᵐ = Σ ⊙ (1 + εᵐ)``, ``εᵐ ~ N(0, σ_init²)``,
and bias ``bᵐ`` (trainable). Member m's layer is ``y = ((x V) ⊙ Σᵐ) Uᵀ + bᵐ``: no member ever
materialises its own d×d matrix, so the extra parameters are ≈ 5(M−1)/(4d) of the model.

All members run in ONE forward: the batch is folded to ``[M·B, ...]`` (member-major, rows
``m·B .. m·B+B−1`` belong to member m) and every SVE layer views its input as ``[M, B·L, d]``.
Layers that are not targeted are shared and simply see a bigger batch.

The ensemble's spread (variance of member probabilities, token-level mutual information) is a
second, trained epistemic signal, used by the policy's "second opinion" action.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.errors import (
    ArtifactError,
    CacheCorruptError,
    FingerprintMismatchError,
    GuardUQError,
    SVEError,
)
from guarduq.layout import PromptLike
from guarduq.models import LoadedModel, cache_root, fingerprint
from guarduq.scoring.uncertainty import select_parameters

log = get_logger("sve")

FORMAT = "guarduq-sve"
FORMAT_VERSION = 1

# Short module names SVE can target: Llama-style projections and GPT-2's fused Conv1D layers.
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
KNOWN_TARGETS = LLAMA_TARGETS + GPT2_TARGETS


# --------------------------------------------------------------------------- the layer


class SVELinear(nn.Module):
    """A linear map shared by M members through frozen ``U``, ``V``; member m owns Σᵐ and bᵐ.

    ``U`` [out, r] and ``V`` [in, r] are buffers (never trained, saved with the model copy only);
    ``sigma`` [M, r] and ``bias`` [M, out] are the only parameters.
    """

    def __init__(
        self,
        U: torch.Tensor,
        S: torch.Tensor,
        V: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        members: int,
        sigma_init: float,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        self.members = members
        self.in_features = int(V.shape[0])
        self.out_features = int(U.shape[0])
        self.register_buffer("U", U.contiguous())
        self.register_buffer("V", V.contiguous())
        self.register_buffer("S", S.clone(), persistent=False)  # the base spectrum, for reference
        eps = torch.randn(members, S.numel(), generator=generator, dtype=torch.float64) * sigma_init
        self.sigma = nn.Parameter((S.double() * (1.0 + eps)).to(S.dtype))
        b = torch.zeros(self.out_features, dtype=U.dtype) if bias is None else bias.detach()
        self.bias = nn.Parameter(b.to(U.dtype).expand(members, -1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.shape[0] % self.members:
            raise SVEError(
                f"SVE layer got a batch of {x.shape[0]} rows, not a multiple of M={self.members}; "
                "call the ensemble's methods, which fold the member dimension into the batch"
            )
        h = x.reshape(self.members, -1, self.in_features) @ self.V  # [M, N, r]
        h = h * self.sigma.unsqueeze(1)
        y = h @ self.U.T + self.bias.unsqueeze(1)  # [M, N, out]
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.V.shape[1]}, members={self.members}"


def _weight_as_linear(module: nn.Module) -> torch.Tensor:
    """The [out, in] matrix of an ``nn.Linear`` or a transformers ``Conv1D`` (stored [in, out])."""
    w = module.weight.detach()
    return w.T if type(module).__name__ == "Conv1D" else w


def _is_matrix_layer(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


class _PrefixSharing:
    """Run the blocks before the first SVE block once per input row, then fan out to M members.

    Those blocks are frozen and identical for every member, so computing them M times is waste.
    Forward pre-hooks on the blocks from the first targeted one on repeat the hidden states
    (first block) and every batch-indexed tensor argument (mask, position ids, rotary tables)
    M times, member-major. Active only while ``rows`` is set, i.e. inside ``SVEnsemble`` calls
    whose members all see the same inputs; training (different rows per member) folds instead.
    """

    def __init__(self, blocks: Sequence[nn.Module], members: int) -> None:
        self.members = members
        self.rows: int | None = None
        self.handles = [
            block.register_forward_pre_hook(self._hook(first=i == 0), with_kwargs=True)
            for i, block in enumerate(blocks)
        ]

    def _expand(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == self.rows:
            return value.repeat(self.members, *([1] * (value.dim() - 1)))
        if isinstance(value, tuple):
            return tuple(self._expand(v) for v in value)
        return value

    def _hook(self, *, first: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.rows is None:
                return None
            if first:  # the hidden states enter the first SVE block once per member
                hidden, rest = args[0], tuple(self._expand(a) for a in args[1:])
                args = (hidden.repeat(self.members, *([1] * (hidden.dim() - 1))), *rest)
            else:
                args = (args[0], *(self._expand(a) for a in args[1:]))
            return args, {k: self._expand(v) for k, v in kwargs.items()}

        return hook


# --------------------------------------------------------------------------- SVD cache


def _svd_cache_path(fp: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else cache_root() / "sve"
    return base / f"{fp}.safetensors"


def _load_svd_cache(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        return {}
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on bad bytes
        raise CacheCorruptError(
            f"SVD cache {path} is unreadable ({exc}); delete it to recompute"
        ) from exc


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file so readers see the old file or the complete new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _svds(
    modules: dict[str, nn.Module], fp: str, cache_dir: str | os.PathLike[str] | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(U, S, V) per module name; computed in float64 once per model fingerprint, then cached."""
    path = _svd_cache_path(fp, cache_dir)
    cached = _load_svd_cache(path)
    missing = [n for n in modules if f"{n}.S" not in cached]
    if missing:
        t0 = time.perf_counter()
        for name in tqdm(missing, desc="SVD", unit="matrix", disable=len(missing) < 8):
            u, s, vh = torch.linalg.svd(_weight_as_linear(modules[name]).double(), full_matrices=False)
            cached[f"{name}.U"], cached[f"{name}.S"], cached[f"{name}.V"] = (
                u.float(), s.float(), vh.T.float()
            )
        try:
            _atomic_save(cached, path, {"format": "guarduq-sve-svd", "fingerprint": fp})
        except OSError as exc:  # a read-only cache only costs time next run
            log.warning("svd_cache_write_failed", path=str(path), error=str(exc))
        log.info("svd_computed", n=len(missing), seconds=round(time.perf_counter() - t0, 2), path=str(path))
    out = {}
    for name, module in modules.items():
        u, s, v = cached[f"{name}.U"], cached[f"{name}.S"], cached[f"{name}.V"]
        w = _weight_as_linear(module)
        if u.shape[0] != w.shape[0] or v.shape[0] != w.shape[1]:
            raise CacheCorruptError(f"SVD cache {path} does not match layer {name}; delete it to recompute")
        dtype = w.dtype
        out[name] = (u.to(dtype), s.to(dtype), v.to(dtype))
    return out


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class SVEOpinion:
    """The ensemble's view of one (prompt, response); same attribute names as ``policy.SecondOpinion``.

    ``variance`` is the population variance of the member mean probabilities;
    ``mutual_information`` is H(mean member predictive) − mean member entropy, per response
    token, averaged (nats). ``answer``/``agrees`` are filled only when a greedy answer was asked for.
    """

    member_mean_probs: list[float]
    mean_prob: float
    variance: float
    mutual_information: float
    agrees: bool | None = None
    answer: str | None = None
    n_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Overhead:
    """Parameter cost of the ensemble. ``ratio`` = extra_params / base_params, where
    extra_params = (M−1) × per_member_params (one member stands in for the base model), the
    quantity the paper's formula 5(M−1)/(4d) approximates for a full-width 4d-MLP transformer."""

    members: int
    per_member_params: int
    member_params: int
    extra_params: int
    base_params: int
    ratio: float
    formula: float
    hidden_size: int
    targeted_blocks: int
    total_blocks: int
    n_layers: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- objectives


@dataclass
class _Batch:
    """M·B right-padded sequences, member-major, with what each objective needs."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor  # real length of each row
    starts: torch.Tensor  # first answer token (LM) of each row
    labels: torch.Tensor  # class index (classification) of each row


class _Objective:
    """Turns (prompt, target) items into token ids and a batch into a loss. One subclass per kind."""

    kind = ""

    def __init__(self, ensemble: SVEnsemble) -> None:
        self.ensemble = ensemble

    def encode(self, item: Any) -> tuple[list[int], int, int]:
        raise NotImplementedError

    def loss(self, batch: _Batch) -> torch.Tensor:
        raise NotImplementedError


class _LMObjective(_Objective):
    """Mean negative log-likelihood of the answer tokens (+ end of turn), in guarduq's layout."""

    kind = "lm"

    def encode(self, item: Any) -> tuple[list[int], int, int]:
        if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[1], str)):
            raise SVEError("LM training data must be (prompt, answer) pairs with a string answer")
        tok = self.ensemble._require_tokenizer()
        p = layout.prompt_ids(tok, item[0])
        r = layout.response_ids(tok, item[1], ended=True)
        layout.check_fits(self.ensemble.model, len(p) + len(r))
        return p + r, len(p), -1

    def loss(self, batch: _Batch) -> torch.Tensor:
        hidden = self.ensemble._hidden(batch.input_ids, batch.attention_mask)
        rows, pos = [], []
        for i, (start, length) in enumerate(zip(batch.starts.tolist(), batch.lengths.tolist(), strict=True)):
            rows += [i] * (length - start)
            pos += list(range(start - 1, length - 1))
        rows_t, pos_t = torch.tensor(rows), torch.tensor(pos)
        logp = torch.log_softmax(self.ensemble._lm_head(hidden[rows_t, pos_t]).float(), dim=-1)
        nll = -logp.gather(-1, batch.input_ids[rows_t, pos_t + 1].unsqueeze(-1)).squeeze(-1)
        per_row = torch.zeros(len(batch.lengths)).index_add(0, rows_t, nll)
        return (per_row / (batch.lengths - batch.starts)).mean()


class _ClassificationObjective(_Objective):
    """Cross-entropy over the label words' next-token logits after the (chat-templated) prompt."""

    kind = "classification"

    def __init__(self, ensemble: SVEnsemble, label_words: Sequence[str]) -> None:
        super().__init__(ensemble)
        self.label_ids = ensemble.label_token_ids(label_words)

    def encode(self, item: Any) -> tuple[list[int], int, int]:
        if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[1], int | np.integer)):
            raise SVEError("classification data must be (prompt, label index) pairs")
        label = int(item[1])
        if not 0 <= label < len(self.label_ids):
            raise SVEError(f"label {label} out of range for {len(self.label_ids)} label words")
        ids = layout.prompt_ids(self.ensemble._require_tokenizer(), item[0])
        layout.check_fits(self.ensemble.model, len(ids) + 1)
        return ids, len(ids), label

    def loss(self, batch: _Batch) -> torch.Tensor:
        logits = self.ensemble._label_logits(batch.input_ids, batch.attention_mask, batch.lengths, self.label_ids)
        return nn.functional.cross_entropy(logits, batch.labels)


# --------------------------------------------------------------------------- the ensemble


class SVEnsemble:
    """M singular-value members over one frozen copy of a causal LM.

    Parameters (set in ``__init__``, never changed by ``fit``): ``members`` (M ≥ 2), ``targets``
    (short module names, default every known one present), ``sigma_init`` (relative noise on the
    initial singular values), ``last_n_blocks`` (target only the last N transformer blocks),
    ``seed``, ``share_prefix`` (run the blocks before the first SVE block once per input when all
    members see the same input; verified against plain folding at build time). Fitted state ends
    with ``_``: ``steps_done_``, ``history_``. Calls are serialised by an internal lock.
    """

    def __init__(
        self,
        model: nn.Module | LoadedModel,
        tokenizer: Any = None,
        *,
        members: int = 4,
        targets: str | Sequence[str] | None = None,
        sigma_init: float = 0.05,
        last_n_blocks: int | None = None,
        seed: int = 0,
        share_prefix: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(model, LoadedModel):
            tokenizer = tokenizer if tokenizer is not None else model.tokenizer
            base_fp, model = model.info.fingerprint, model.model
        elif isinstance(model, nn.Module):
            base_fp = fingerprint(model)
        else:
            raise SVEError(f"SVEnsemble needs a torch model or a LoadedModel, got {type(model).__name__}")
        self.targets = validate_settings(members, targets, sigma_init)
        self.members = members
        self.sigma_init = float(sigma_init)
        self.last_n_blocks = last_n_blocks
        self.seed = int(seed)
        self.tokenizer = tokenizer
        self.base_fingerprint = base_fp
        self.base_params = sum(p.numel() for p in model.parameters())
        self.steps_done_ = 0
        self.history_: list[float] = []
        self._lock = threading.RLock()  # forwards toggle shared hook state: one call at a time

        chosen = _select_modules(model, self.targets, last_n_blocks)
        self.model = copy.deepcopy(model)  # the caller's model is never modified
        self.model.eval()
        self.model.requires_grad_(False)
        copies = dict(self.model.named_modules())
        svd = _svds({n: copies[n] for n in chosen}, base_fp, cache_dir)
        gen = torch.Generator().manual_seed(self.seed)
        self.layers: dict[str, SVELinear] = {}
        for name in chosen:  # sorted: member noise and parameter order are reproducible
            old = copies[name]
            u, s, v = svd[name]
            layer = SVELinear(
                u, s, v, getattr(old, "bias", None), members=members, sigma_init=self.sigma_init, generator=gen
            )
            parent_name, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name) if parent_name else self.model, child, layer)
            self.layers[name] = layer
        self.total_blocks = len(_block_indices(model))
        self.targeted_blocks = len({_block_of(n) for n in chosen} - {None})
        self._sharing = self._setup_sharing(chosen) if share_prefix else None
        log.info(
            "sve_built", members=members, layers=len(chosen), fingerprint=base_fp,
            prefix_shared=self._sharing is not None,
        )

    def _setup_sharing(self, chosen: list[str]) -> _PrefixSharing | None:
        """Hooks for prefix sharing, kept only if a check forward matches plain folding."""
        blocks = [b for n in chosen if (b := _block_of(n)) is not None]
        if len(blocks) != len(chosen):
            return None  # a targeted layer outside the numbered blocks: nothing to share
        first = min(blocks)
        block_modules = {
            b: m for n, m in self.model.named_modules() if (b := _block_of(n, own=True)) is not None
        }
        if first not in block_modules:
            return None
        sharing = _PrefixSharing([block_modules[b] for b in sorted(block_modules) if b >= first], self.members)
        vocab = int(getattr(self.model.config, "vocab_size", 2))
        probe = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(0))
        reason = "shared and folded logits differ"
        with torch.no_grad():
            folded = self.model(input_ids=probe.repeat(self.members, 1), use_cache=False).logits
            sharing.rows = 2
            try:
                shared = self.model(input_ids=probe, use_cache=False).logits
            except Exception as exc:  # an architecture whose blocks take arguments we cannot fan out
                shared, reason = None, str(exc).splitlines()[0][:200]
            finally:
                sharing.rows = None
        if shared is None or shared.shape != folded.shape or not torch.allclose(shared, folded, rtol=1e-4, atol=1e-5):
            for h in sharing.handles:
                h.remove()
            log.warning("sve_prefix_sharing_off", reason=reason)
            return None
        return sharing

    @classmethod
    def from_model(
        cls, model: nn.Module | LoadedModel, tokenizer: Any = None, **kwargs: Any
    ) -> SVEnsemble:
        """Build an ensemble over a deep copy of ``model`` (the original stays untouched)."""
        return cls(model, tokenizer, **kwargs)

    # ------------------------------------------------------------------ parameters

    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters: every layer's ``sigma`` then ``bias`` (sorted by layer name)."""
        return [p for layer in self.layers.values() for p in (layer.sigma, layer.bias)]

    def overhead(self) -> Overhead:
        per_member = sum(layer.sigma.shape[1] + layer.bias.shape[1] for layer in self.layers.values())
        d = _hidden_size(self.model)
        extra = (self.members - 1) * per_member
        return Overhead(
            members=self.members,
            per_member_params=per_member,
            member_params=self.members * per_member,
            extra_params=extra,
            base_params=self.base_params,
            ratio=extra / self.base_params,
            formula=5 * (self.members - 1) / (4 * d),
            hidden_size=d,
            targeted_blocks=self.targeted_blocks,
            total_blocks=self.total_blocks,
            n_layers=len(self.layers),
        )

    # ------------------------------------------------------------------ forwards

    def member_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of every member, ``[M, B, L, V]``, from one forward over the folded batch."""
        if input_ids.dim() != 2:
            raise SVEError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        b, length = input_ids.shape
        with torch.no_grad(), self._fan_out(b) as fold:
            logits = self.model(
                input_ids=fold(input_ids), attention_mask=fold(attention_mask), use_cache=False
            ).logits
        return logits.reshape(self.members, b, length, -1)

    @contextlib.contextmanager
    def _fan_out(self, rows: int) -> Iterator[Callable[[torch.Tensor | None], torch.Tensor | None]]:
        """Every member sees the same ``rows`` inputs: share the prefix, or fold them M times.

        Yields the function to apply to the model inputs ([B, L] -> [B, L] or [M·B, L]).
        """
        with self._lock:
            if self._sharing is None:
                yield lambda t: None if t is None else t.repeat(self.members, 1)
                return
            self._sharing.rows = rows
            try:
                yield lambda t: t
            finally:
                self._sharing.rows = None

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Last hidden states (the LM head is applied only where needed)."""
        return self.model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _label_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: torch.Tensor, label_ids: list[int]
    ) -> torch.Tensor:
        """[rows, C] next-token logits of the label words after each row's last real token."""
        hidden = self._hidden(input_ids, attention_mask)
        last = hidden[torch.arange(hidden.shape[0]), lengths - 1]
        return self._lm_head(last)[:, label_ids].float()

    # ------------------------------------------------------------------ inference

    def label_token_ids(self, label_words: Sequence[str]) -> list[int]:
        """First token of each label word; they must differ, or the classes are indistinguishable."""
        tok = self._require_tokenizer()
        if isinstance(label_words, str) or len(label_words) < 2:
            raise SVEError("label_words must be a list of at least two words")
        ids = []
        for word in label_words:
            toks = tok(word, add_special_tokens=False)["input_ids"]
            if not toks:
                raise SVEError(f"label word {word!r} has no tokens")
            ids.append(int(toks[0]))
        if len(set(ids)) != len(ids):
            raise SVEError(f"label words {list(label_words)} share a first token; choose distinct words")
        return ids

    def member_proba(
        self, prompts: Sequence[PromptLike], label_words: Sequence[str], *, batch_size: int = 8
    ) -> np.ndarray:
        """Each member's class probabilities ``[M, N, C]`` (softmax over the label words)."""
        label_ids = self.label_token_ids(label_words)
        tok = self._require_tokenizer()
        encoded = [layout.prompt_ids(tok, p) for p in prompts]
        out = []
        with torch.no_grad():
            for i in range(0, len(encoded), batch_size):
                chunk = encoded[i : i + batch_size]
                batch = self._collate([(ids, len(ids), 0) for ids in chunk])
                with self._fan_out(len(chunk)) as fold:
                    logits = self._label_logits(
                        fold(batch.input_ids), fold(batch.attention_mask),
                        batch.lengths.repeat(self.members), label_ids,
                    )
                out.append(torch.softmax(logits, -1).reshape(self.members, len(chunk), -1))
        if not out:
            raise SVEError("no prompts to classify")
        return torch.cat(out, dim=1).numpy()

    def predict_proba(
        self, prompts: Sequence[PromptLike], label_words: Sequence[str], *, batch_size: int = 8
    ) -> np.ndarray:
        """The ensemble's class probabilities ``[N, C]``: the mean of the members'."""
        return self.member_proba(prompts, label_words, batch_size=batch_size).mean(axis=0)

    def second_opinion(
        self, prompt: PromptLike, response: str, *, ended: bool = True, max_new_tokens: int = 0
    ) -> SVEOpinion:
        """Score ``response`` with every member; with ``max_new_tokens > 0`` also answer greedily."""
        tok = self._require_tokenizer()
        enc = layout.encode(tok, self.model, prompt, response, ended=ended)
        start = enc.response_start
        with torch.no_grad(), self._fan_out(1) as fold:
            hidden = self._hidden(fold(enc.input_ids), None)[:, start - 1 : -1]  # [M, T, d]
            logits = self._lm_head(hidden).double()  # the LM head only where response tokens are predicted
        logp = torch.log_softmax(logits, dim=-1)
        targets = enc.input_ids[0, start:]
        tok_p = logp.gather(-1, targets.expand(self.members, -1).unsqueeze(-1)).squeeze(-1).exp()
        member_means = tok_p.mean(dim=1)
        probs = logp.exp()
        mean_p = probs.mean(dim=0)
        h_mean = -(mean_p * mean_p.clamp_min(1e-300).log()).sum(-1)
        mean_h = -(probs * logp).sum(-1).mean(dim=0)
        mi = float((h_mean - mean_h).clamp_min(0.0).mean())
        answer = agrees = None
        if max_new_tokens > 0:
            answer = self.generate(prompt, max_new_tokens=max_new_tokens)
            agrees = _same_answer(answer, response)
        return SVEOpinion(
            member_mean_probs=[float(x) for x in member_means],
            mean_prob=float(member_means.mean()),
            variance=float(member_means.var(unbiased=False)),
            mutual_information=mi,
            agrees=agrees,
            answer=answer,
            n_tokens=int(targets.numel()),
        )

    def generate(self, prompt: PromptLike, *, max_new_tokens: int = 64) -> str:
        """Greedy decoding from the members' mean predictive distribution (one folded pass per token)."""
        tok = self._require_tokenizer()
        ids = layout.prompt_ids(tok, prompt)
        layout.check_fits(self.model, len(ids) + max_new_tokens)
        stops = set(layout.stop_token_ids(tok))
        x = torch.tensor([ids]).repeat(self.members, 1)
        past, new = None, []
        with torch.no_grad(), self._lock:  # plain folding: the KV cache holds M rows throughout
            for _ in range(max_new_tokens):
                out = self.model(input_ids=x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = int(torch.softmax(out.logits[:, -1].float(), -1).mean(0).argmax())
                if nxt in stops:
                    break
                new.append(nxt)
                x = torch.full((self.members, 1), nxt, dtype=torch.long)
        return tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------------ training

    def fit(
        self,
        data: Sequence[tuple[PromptLike, Any]],
        *,
        label_words: Sequence[str] | None = None,
        steps: int = 200,
        batch_size: int = 4,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 50,
        progress: bool = True,
    ) -> SVEnsemble:
        """Train all members jointly; member m sees mini-batches in its own shuffled order.

        ``data``: (prompt, answer str) pairs -> LM loss on the answer tokens; with ``label_words``,
        (prompt, class index) pairs -> cross-entropy over the label words' next-token logits.
        AdamW touches singular values and biases only; ``weight_decay`` defaults to 0 because
        decay would pull the pretrained spectrum towards zero. ``steps`` counts from the start
        (``steps_done_``): a second call trains on up to it. With ``checkpoint``, state is saved
        every ``checkpoint_every`` steps and a rerun with the same settings resumes from it.
        """
        if steps < 1 or batch_size < 1:
            raise SVEError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
        if not data:
            raise SVEError("no training data")
        objective: _Objective = (
            _ClassificationObjective(self, label_words) if label_words is not None else _LMObjective(self)
        )
        items = [objective.encode(item) for item in data]
        optim = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)
        settings = {
            "objective": objective.kind,
            "batch_size": batch_size,
            "lr": lr,
            "weight_decay": weight_decay,
            "data_digest": _digest(items),
        }
        ckpt = Path(checkpoint) if checkpoint is not None else None
        if ckpt is not None and ckpt.is_file():
            self._resume(ckpt, optim, settings)
        # The frozen copy stays in eval mode: no dropout, members differ only by their parameters.
        bar = tqdm(total=steps, initial=self.steps_done_, desc="SVE fit", unit="step", disable=not progress)
        with self._lock, bar:
            while self.steps_done_ < steps:
                rows = [
                    items[i]
                    for m in range(self.members)
                    for i in _member_batch(len(items), m, self.steps_done_, batch_size, self.seed)
                ]
                loss = objective.loss(self._collate(rows))
                optim.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.parameters(), max_grad_norm)
                optim.step()
                self.steps_done_ += 1
                self.history_.append(float(loss.detach()))
                bar.update(1)
                bar.set_postfix(loss=f"{self.history_[-1]:.4f}")
                if ckpt is not None and (self.steps_done_ % checkpoint_every == 0 or self.steps_done_ == steps):
                    self._write_checkpoint(ckpt, optim, settings)
        return self

    def _write_checkpoint(self, path: Path, optim: torch.optim.Optimizer, settings: dict[str, Any]) -> None:
        tensors = self._member_tensors()
        for i, state in optim.state_dict()["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"optim.{i}.{key}"] = state[key]
            tensors[f"optim.{i}.step"] = torch.as_tensor(state["step"], dtype=torch.float64).reshape(1)
        meta = {
            **self._metadata(),
            "settings": json.dumps(settings, sort_keys=True),
            "history": json.dumps(self.history_),
        }
        _atomic_save(tensors, path, meta)

    def _resume(self, path: Path, optim: torch.optim.Optimizer, settings: dict[str, Any]) -> None:
        meta, tensors = _read_artifact(path)
        self._check_compatible(meta, path)
        if json.loads(meta.get("settings", "{}")) != json.loads(json.dumps(settings, sort_keys=True)):
            raise SVEError(
                f"checkpoint {path} was made with other training settings or data; "
                "delete it or pass another checkpoint path"
            )
        self._load_member_tensors(tensors, path)
        self.steps_done_ = int(meta.get("steps_done", "0"))
        state = {}
        for i in range(len(self.parameters())):
            try:
                state[i] = {
                    "step": tensors[f"optim.{i}.step"].reshape(()).float(),
                    "exp_avg": tensors[f"optim.{i}.exp_avg"],
                    "exp_avg_sq": tensors[f"optim.{i}.exp_avg_sq"],
                }
            except KeyError as exc:
                raise ArtifactError(f"checkpoint {path} lacks optimizer state {exc}") from exc
        optim.load_state_dict({"state": state, "param_groups": optim.state_dict()["param_groups"]})
        self.history_ = list(json.loads(meta.get("history", "[]")))
        log.info("sve_resumed", path=str(path), step=self.steps_done_)

    # ------------------------------------------------------------------ save / load

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Member parameters only (safetensors) plus metadata binding them to the base model."""
        path = Path(path)
        _atomic_save(self._member_tensors(), path, self._metadata())
        return path

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        model: nn.Module | LoadedModel,
        tokenizer: Any = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> SVEnsemble:
        """Rebuild a saved ensemble on ``model``; refuses a model with another fingerprint."""
        path = Path(path)
        meta, tensors = _read_artifact(path)
        fp = model.info.fingerprint if isinstance(model, LoadedModel) else fingerprint(model)
        if meta["fingerprint"] != fp:
            raise FingerprintMismatchError(
                f"SVE members in {path} were trained on model {meta['fingerprint']}, "
                f"not on this model ({fp}); train an ensemble for this model"
            )
        try:
            ens = cls(
                model,
                tokenizer,
                members=int(meta["members"]),
                targets=json.loads(meta["targets"]),
                sigma_init=float(meta["sigma_init"]),
                last_n_blocks=json.loads(meta["last_n_blocks"]),
                seed=int(meta["seed"]),
                cache_dir=cache_dir,
            )
        except (KeyError, ValueError) as exc:
            if isinstance(exc, GuardUQError):
                raise
            raise ArtifactError(f"SVE file {path} has incomplete metadata: {exc}") from exc
        ens._check_compatible(meta, path)
        ens._load_member_tensors(tensors, path)
        ens.steps_done_ = int(meta.get("steps_done", "0"))
        return ens

    def _metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "fingerprint": self.base_fingerprint,
            "members": str(self.members),
            "targets": json.dumps(list(self.targets)),
            "sigma_init": repr(self.sigma_init),
            "last_n_blocks": json.dumps(self.last_n_blocks),
            "seed": str(self.seed),
            "layers": json.dumps(list(self.layers)),
            "steps_done": str(self.steps_done_),
        }

    def _member_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, layer in self.layers.items():
            out[f"{name}.sigma"] = layer.sigma.detach()
            out[f"{name}.bias"] = layer.bias.detach()
        return out

    def _check_compatible(self, meta: dict[str, str], path: Path) -> None:
        if meta.get("fingerprint") != self.base_fingerprint:
            raise FingerprintMismatchError(
                f"{path} belongs to model {meta.get('fingerprint')}, not {self.base_fingerprint}"
            )
        if json.loads(meta.get("layers", "[]")) != list(self.layers) or meta.get("members") != str(self.members):
            raise ArtifactError(f"{path} was saved for other SVE layers or member count")

    def _load_member_tensors(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        with torch.no_grad():
            for name, layer in self.layers.items():
                for attr in ("sigma", "bias"):
                    t = tensors.get(f"{name}.{attr}")
                    p = getattr(layer, attr)
                    if t is None or t.shape != p.shape:
                        raise ArtifactError(f"{path}: {name}.{attr} is missing or has the wrong shape")
                    p.copy_(t)

    # ------------------------------------------------------------------ helpers

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise SVEError("this operation needs a tokenizer; pass one to SVEnsemble.from_model")
        return self.tokenizer

    def _collate(self, rows: list[tuple[list[int], int, int]]) -> _Batch:
        """Right-pad M·B encoded rows (right padding keeps positions and the causal mask exact)."""
        tok = self.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        pad = 0 if pad is None else int(pad)
        width = max(len(ids) for ids, _, _ in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, _, _) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        return _Batch(
            input_ids=input_ids,
            attention_mask=mask,
            lengths=torch.tensor([len(ids) for ids, _, _ in rows]),
            starts=torch.tensor([s for _, s, _ in rows]),
            labels=torch.tensor([lab for _, _, lab in rows]),
        )


# --------------------------------------------------------------------------- module helpers

_BLOCK = re.compile(r"\.(?:layers|h|blocks|block|layer)\.(\d+)\.")


def _block_of(name: str, *, own: bool = False) -> int | None:
    """Index of the transformer block containing module ``name`` (``own``: name IS the block)."""
    m = _BLOCK.search(f".{name}.")
    if m is None or (own and m.end() != len(name) + 2):
        return None
    return int(m.group(1))


def _block_indices(model: nn.Module) -> set[int]:
    return {b for n, _ in model.named_modules() if (b := _block_of(n)) is not None}


def validate_settings(members: Any, targets: str | Sequence[str] | None, sigma_init: Any) -> tuple[str, ...]:
    """Check the ensemble's settings before any model work; returns the target names."""
    if isinstance(members, bool) or not isinstance(members, int) or members < 2:
        raise SVEError(f"an ensemble needs members >= 2, got {members!r}")
    if isinstance(sigma_init, bool) or not isinstance(sigma_init, int | float) or not math.isfinite(sigma_init) or sigma_init < 0:
        raise SVEError(f"sigma_init must be a finite number >= 0, got {sigma_init!r}")
    return _validate_targets(targets)


def _validate_targets(targets: str | Sequence[str] | None) -> tuple[str, ...]:
    if targets is None:
        return KNOWN_TARGETS
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = tuple(dict.fromkeys(targets))
    if not targets:
        raise SVEError("targets is empty")
    unknown = [t for t in targets if t not in KNOWN_TARGETS]
    if unknown:
        raise SVEError(f"unknown SVE target(s) {unknown}; known: {', '.join(KNOWN_TARGETS)}")
    return targets


def _select_modules(model: nn.Module, targets: Sequence[str], last_n_blocks: int | None) -> list[str]:
    """Names of the matrix layers to replace, sorted; errors say why nothing matched."""
    names = sorted(
        n for n, m in model.named_modules() if n.rpartition(".")[2] in targets and _is_matrix_layer(m)
    )
    if not names:
        raise SVEError(
            f"the model has no linear/Conv1D layers named {list(targets)}; "
            f"SVE supports {', '.join(KNOWN_TARGETS)}"
        )
    if last_n_blocks is not None:
        if isinstance(last_n_blocks, bool) or not isinstance(last_n_blocks, int):
            raise SVEError(f"last_n_blocks must be an integer, got {last_n_blocks!r}")
        try:
            keep = {n for n, _ in select_parameters(model, last_n_blocks=last_n_blocks)}
        except GuardUQError as exc:
            raise SVEError(f"cannot restrict SVE to the last blocks: {exc}") from exc
        names = [n for n in names if f"{n}.weight" in keep]
        if not names:
            raise SVEError(f"no target layers in the last {last_n_blocks} blocks")
    return names


def _hidden_size(model: nn.Module) -> int:
    cfg = model.config
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(cfg, key, None)
        if isinstance(value, int):
            return value
    raise SVEError("cannot read the model's hidden size from its config")


def _member_batch(n: int, member: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Member m's indices for ``step``: its own stream of per-epoch permutations.

    Deterministic in (seed, member, epoch), so a resumed run continues the same orders.
    """
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, k = divmod(pos, n)
        out.append(_permutation(n, member, epoch, seed)[k])
    return out


_PERMS: dict[tuple[int, int, int, int], list[int]] = {}


def _permutation(n: int, member: int, epoch: int, seed: int) -> list[int]:
    key = (n, member, epoch, seed)
    if key not in _PERMS:
        if len(_PERMS) > 256:
            _PERMS.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + member * 10_007 + epoch)
        _PERMS[key] = torch.randperm(n, generator=g).tolist()
    return _PERMS[key]


def _digest(items: list[tuple[list[int], int, int]]) -> str:
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _read_artifact(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    if not path.is_file():
        raise ArtifactError(f"SVE file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types on bad bytes
        raise ArtifactError(f"{path} is not a readable safetensors file: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a guarduq SVE file (format {meta.get('format')!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise ArtifactError(
            f"{path} has SVE format version {meta.get('format_version')}; this guarduq reads {FORMAT_VERSION}"
        )
    if "fingerprint" not in meta:
        raise ArtifactError(f"{path} has no base-model fingerprint")
    return meta, tensors


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.casefold()).split()


def _same_answer(answer: str, response: str) -> bool:
    """Loose agreement: after lower-casing and dropping punctuation, the shorter word sequence
    occurs contiguously in the longer one ("Paris" agrees with "The capital is Paris.")."""
    a, r = _words(answer), _words(response)
    if not a or not r:
        return False
    short, long = sorted((a, r), key=len)
    return any(long[i : i + len(short)] == short for i in range(len(long) - len(short) + 1))


__all__ = [
    "KNOWN_TARGETS",
    "Overhead",
    "SVEOpinion",
    "SVELinear",
    "SVEnsemble",
]
