"""Singular Value Ensemble (SVE): M members that differ only in singular values and biases.

Each targeted weight ``W = U Σ Vᵀ`` of a frozen pretrained model keeps its ``U`` and ``V`` (buffers)
and gets, per member m, its own singular values ``Σᵐ = Σ ⊙ exp(δᵐ)``, ``δᵐ ~ N(0, σ_init²)``, and
bias ``bᵐ = b₀ + s·βᵐ`` (s: the layer's output scale), δ and β trained: every step is relative
to the layer's own scale (``SVELinear``; the first, raw parametrisation stays loadable). Member m's layer is ``y = ((x V) ⊙ Σᵐ) Uᵀ + bᵐ``: no member ever
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
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from guarduq import layout
from guarduq._logging import get_logger
from guarduq.answers import same_answer
from guarduq.batching import forward_with_cache, right_pad
from guarduq.errors import ArtifactError, FingerprintMismatchError, GuardUQError, SVEError
from guarduq.layout import PromptLike
from guarduq.models import LoadedModel, fingerprint
from guarduq.sve.frozen import FrozenStates
from guarduq.sve.io import (
    FORMAT,
    FORMAT_VERSION,
    _atomic_save,
    _read_artifact,
    _svds,
    check_compatible,
    load_member_tensors,
    member_tensors,
    parametrisation_of,
)
from guarduq.sve.layers import (
    SVELinear,
    _block_indices,
    _block_of,
    _hidden_size,
    _PrefixSharing,
    _same_logits,
    _select_modules,
    validate_settings,
)
from guarduq.sve.results import Overhead, SVEOpinion
from guarduq.sve.training import (
    Batch,
    ClassificationObjective,
    LMObjective,
    Objective,
    clip_per_member,
    data_digest,
    member_batch,
)

log = get_logger("sve")

# Raw: chosen on SmolLM2 ARC-Easy dev. Relative: that rate over SmolLM2's median singular value
# (3e-2 / 5.04 ≈ 6e-3, rounded down), a transfer into relative units, not yet a dev choice.
DEFAULT_LR = {"raw": 3e-2, "relative": 5e-3}

# --------------------------------------------------------------------------- the ensemble


class SVEnsemble:
    """M singular-value members over one frozen copy of a causal LM.

    Parameters (set in ``__init__``, never changed by ``fit``): ``members`` (M ≥ 2), ``targets``
    (short module names, default every known one present), ``sigma_init`` (relative noise on the
    initial singular values), ``last_n_blocks`` (target only the last N transformer blocks),
    ``parametrisation`` ("relative": Σ ⊙ exp(δ), or "raw": Σ trained as is), ``bias`` ("scaled",
    "none" or "raw"; see ``SVELinear``), ``seed``, ``share_prefix`` (run the blocks before the first SVE block once per input when all
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
        parametrisation: str = "relative",
        bias: str = "scaled",
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
        self.targets = validate_settings(members, targets, sigma_init, parametrisation, bias)
        self.members = members
        self.parametrisation, self.bias_mode = parametrisation, bias
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
                u, s, v, getattr(old, "bias", None), members=members, sigma_init=self.sigma_init, generator=gen,
                parametrisation=parametrisation, bias_mode=bias,
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
        if shared is None or shared.shape != folded.shape or not _same_logits(shared, folded):
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
        """The trainable parameters: every layer's Σ tensor then its bias tensor (sorted by layer name)."""
        return [p for layer in self.layers.values() for p in layer.trainable()]

    def overhead(self) -> Overhead:
        per_member = sum(p.shape[1] for p in self.parameters())
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

    # The surface training reads (``sve.training.Trainee``): hidden states, the head, label logits.

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Last hidden states of the (folded) batch; the LM head is applied only where needed."""
        return self.model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on ``hidden`` [..., d], with the model's final soft-capping where it has one."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def label_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: torch.Tensor, label_ids: list[int]
    ) -> torch.Tensor:
        """[rows, C] next-token logits of the label words after each row's last real token."""
        hidden = self.hidden_states(input_ids, attention_mask)
        last = hidden[torch.arange(hidden.shape[0]), lengths - 1]
        return self.head_logits(last)[:, label_ids].float()

    # ------------------------------------------------------------------ inference

    def label_token_ids(self, label_words: Sequence[str]) -> list[int]:
        """First token of each label word; they must differ, or the classes are indistinguishable."""
        tok = self.require_tokenizer()
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
        tok = self.require_tokenizer()
        encoded = [layout.prompt_ids(tok, p) for p in prompts]
        out = []
        with torch.no_grad():
            for i in range(0, len(encoded), batch_size):
                chunk = encoded[i : i + batch_size]
                batch = self._collate([(ids, len(ids), 0) for ids in chunk])
                with self._fan_out(len(chunk)) as fold:
                    logits = self.label_logits(
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
        tok = self.require_tokenizer()
        enc = layout.encode(tok, self.model, prompt, response, ended=ended)
        start = enc.response_start
        with torch.no_grad(), self._fan_out(1) as fold:
            hidden = self.hidden_states(fold(enc.input_ids), None)[:, start - 1 : -1]  # [M, T, d]
            logits = self.head_logits(hidden).double()  # the LM head only where response tokens are predicted
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
            agrees = same_answer(answer, response)
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
        tok = self.require_tokenizer()
        ids = layout.prompt_ids(tok, prompt)
        layout.check_fits(self.model, len(ids) + max_new_tokens)
        stops = set(layout.stop_token_ids(tok))
        x = torch.tensor([ids]).repeat(self.members, 1)
        past, new = None, []
        with torch.no_grad(), self._lock:  # plain folding: the KV cache holds M rows throughout
            for _ in range(max_new_tokens):
                out, past = forward_with_cache(self.model, past, input_ids=x)
                if past is None:  # each step would see only its last token
                    raise SVEError("the model returned no key/value cache; SVE generation needs one")
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
        lr: float | None = None,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 50,
        progress: bool = True,
        reuse_states: bool = True,
    ) -> SVEnsemble:
        """Train all members in one pass; member m sees mini-batches in its own shuffled order.

        Members never share a gradient: each minimises its own mean loss, clipped on its own, so
        an M-member fit equals its members fitted one by one.

        ``data``: (prompt, answer str) pairs -> LM loss on the answer tokens; with ``label_words``,
        (prompt, class index) pairs -> cross-entropy over the label words' next-token logits.
        AdamW touches the members' tensors only; ``weight_decay`` defaults to 0 (decay would pull
        raw Σ towards zero). ``lr`` (default ``DEFAULT_LR`` of the parametrisation): relative, a
        step moves each Σ by about ``lr`` of itself and each scaled bias by ``lr`` of its layer's
        output scale, so one rate can carry across models. Raw, a step moves Σ by about ``lr`` in
        its own units: 3e-2 won on SmolLM2 ARC-Easy dev but was worse than the untrained model on
        Gemma-3-270m (median Σ 0.93 against 5.04), where 1e-3 won (docs/ensembles/README.md).
        ``steps`` counts from the start
        (``steps_done_``): a second call trains on up to it. With ``checkpoint``, state is saved
        every ``checkpoint_every`` steps and a rerun with the same settings resumes from it.
        With ``reuse_states`` (and SVE in the last blocks only), the frozen blocks below run once
        per item, not once per step (``guarduq.sve.frozen``).
        """
        if steps < 1 or batch_size < 1:
            raise SVEError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
        if not data:
            raise SVEError("no training data")
        objective: Objective = (
            ClassificationObjective(self, label_words) if label_words is not None else LMObjective(self)
        )
        items = [objective.encode(item) for item in data]
        lr = DEFAULT_LR[self.parametrisation] if lr is None else lr
        optim = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)
        settings = {
            "objective": objective.kind,
            "batch_size": batch_size,
            "lr": lr,
            "weight_decay": weight_decay,
            "data_digest": data_digest(items),
            "members_apart": True,  # per-member loss and clipping (older checkpoints: joint)
        }
        frozen = (
            FrozenStates.compute(self.model, self._first_block(), [ids for ids, _, _ in items], self._pad_id(),
                                 progress=progress)
            if reuse_states else None
        )
        ckpt = Path(checkpoint) if checkpoint is not None else None
        if ckpt is not None and ckpt.is_file():
            self._resume(ckpt, optim, settings)
        # The frozen copy stays in eval mode: no dropout, members differ only by their parameters.
        bar = tqdm(total=steps, initial=self.steps_done_, desc="SVE fit", unit="step", disable=not progress)
        with self._lock, bar:
            while self.steps_done_ < steps:
                index = [
                    i for m in range(self.members)
                    for i in member_batch(len(items), m, self.steps_done_, batch_size, self.seed)
                ]
                batch = self._collate([items[i] for i in index])
                # The mean over M·B rows times M is the sum of the members' own mean losses:
                # each member's gradient is its own, and each is clipped on its own.
                with frozen.standing_in(index, batch.input_ids.shape[1]) if frozen else contextlib.nullcontext():
                    loss = objective.loss(batch) * self.members
                optim.zero_grad(set_to_none=True)
                loss.backward()
                clip_per_member(self.parameters(), max_grad_norm)
                optim.step()
                self.steps_done_ += 1
                self.history_.append(float(loss.detach()) / self.members)
                bar.update(1)
                bar.set_postfix(loss=f"{self.history_[-1]:.4f}")
                if ckpt is not None and (self.steps_done_ % checkpoint_every == 0 or self.steps_done_ == steps):
                    self._write_checkpoint(ckpt, optim, settings)
        return self

    def _write_checkpoint(self, path: Path, optim: torch.optim.Optimizer, settings: dict[str, Any]) -> None:
        tensors = member_tensors(self.layers)
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
        load_member_tensors(self.layers, tensors, path)
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
        _atomic_save(member_tensors(self.layers), path, self._metadata())
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
                parametrisation=parametrisation_of(meta)[0],
                bias=parametrisation_of(meta)[1],
                last_n_blocks=json.loads(meta["last_n_blocks"]),
                seed=int(meta["seed"]),
                cache_dir=cache_dir,
            )
        except (KeyError, ValueError) as exc:
            if isinstance(exc, GuardUQError):
                raise
            raise ArtifactError(f"SVE file {path} has incomplete metadata: {exc}") from exc
        ens._check_compatible(meta, path)
        load_member_tensors(ens.layers, tensors, path)
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
            "parametrisation": self.parametrisation,
            "bias": self.bias_mode,
            "last_n_blocks": json.dumps(self.last_n_blocks),
            "seed": str(self.seed),
            "layers": json.dumps(list(self.layers)),
            "steps_done": str(self.steps_done_),
        }

    def _check_compatible(self, meta: dict[str, str], path: Path) -> None:
        check_compatible(meta, path, fingerprint=self.base_fingerprint, layers=list(self.layers),
                         members=self.members, kind=(self.parametrisation, self.bias_mode))

    # ------------------------------------------------------------------ helpers

    def require_tokenizer(self) -> Any:
        """The tokenizer, or a clear error for an ensemble built without one."""
        if self.tokenizer is None:
            raise SVEError("this operation needs a tokenizer; pass one to SVEnsemble.from_model")
        return self.tokenizer

    def _first_block(self) -> int | None:
        """The lowest block holding an SVE layer, when every SVE layer is in a numbered block."""
        blocks = [_block_of(name) for name in self.layers]
        return None if None in blocks else min(b for b in blocks if b is not None)

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None) if self.tokenizer is not None else None
        return 0 if pad is None else int(pad)

    def _collate(self, rows: list[tuple[list[int], int, int]]) -> Batch:
        """Right-pad M·B encoded rows (right padding keeps positions and the causal mask exact)."""
        input_ids, mask = right_pad([ids for ids, _, _ in rows], self._pad_id())
        return Batch(
            input_ids=input_ids,
            attention_mask=mask,
            lengths=torch.tensor([len(ids) for ids, _, _ in rows]),
            starts=torch.tensor([s for _, s, _ in rows]),
            labels=torch.tensor([lab for _, _, lab in rows]),
        )
