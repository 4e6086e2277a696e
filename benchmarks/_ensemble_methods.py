"""The ensemble harness's model side: tasks, cached frozen-block states, and the methods compared.

Every method trains only the last N transformer blocks (blocks k = L-N .. L-1) of one frozen
model. Blocks 0..k-1 then compute the same hidden states for every epoch, every member and every
method, so they run once per sequence (``encode_split``: one full forward, which also gives the
base model's own answer) and their output h_k is kept; every later pass starts at block k from
h_k (``Top``), through ``guarduq.sve.frozen.FrozenStates`` (what ``SVEnsemble.fit`` uses), and costs
about N/L of a full one. ``tests/unit/test_ensembles_bench.py`` checks the cached path against the
full model with each method's member blocks swapped in.

Classification is cloze style, as guarduq scores multiple choice (``Guard.option_probs``): each
option is the response to the item's prompt, scored by its mean token log-probability (end of
turn included); the class probabilities are the softmax of those scores over the item's options.
(A letter-answer format leaves SmolLM2-135M at chance on ARC-Easy: 24.7% on its test split.)
Each item runs as one packed sequence: the prompt once, then every option, each option attending
to the prompt and to itself only at the positions it would have alone (``Packed``), so that an
item costs one prompt plus its options rather than one prompt per option.

Methods (one small subclass each; all share the data order of ``guarduq.sve.training``):
* ``SVEMethod``: the targeted projections become ``SVELinear`` (frozen U, V; per-member Σ, bias);
  M = 1 with σ_init = 0 is plain singular-value fine-tuning ("one fine-tuned model").
* ``LoRAMethod``: M independent LoRA adapters (``peft``), each its own initialisation and order.
* ``DeepMethod``: M independently fine-tuned copies of the same blocks (all their weights).
  Where a pretrained start is shared there is no random initialisation to vary, so members that
  differ only by data order are near copies (5-7% pairwise disagreement on the first page). With
  ``perturb`` = λ > 0 each member first gets its own seeded NoisyTune perturbation (Wu et al.,
  ACL 2022: every parameter tensor W plus uniform noise on [-λ/2, λ/2] · std(W)), so members start
  apart as randomly initialised deep-ensemble members do, in each tensor's own units. The harness
  uses λ = 0.15 (``--deep-perturb``; 0 gives the data-order-only ensemble of the first page).
  Dropout was the other choice; the blocks here are run in eval mode by every method, and a
  perturbation changes nothing at prediction time, so it leaves every method's forward alike.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from guarduq import layout
from guarduq.calibration.datasets import Item, load_dataset
from guarduq.layout import PromptLike
from guarduq.scoring.reuse import StateCapture, decoder_blocks
from guarduq.sve import LLAMA_TARGETS, SVELinear
from guarduq.sve.frozen import FrozenStates
from guarduq.sve.training import clip_per_member, member_batch

# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Example:
    prompt: PromptLike
    options: tuple[str, ...]  # as scored responses
    label: int

    @property
    def n_options(self) -> int:
        return len(self.options)


@dataclass
class Task:
    """One cell's data: train / dev (selection) / test splits, optional OOD items."""

    name: str
    splits: dict[str, list[Example]]
    ood_name: str | None = None
    describe: dict[str, Any] = field(default_factory=dict)


def from_items(items: Sequence[Item], *, four_options: bool = False) -> list[Example]:
    """guarduq's own multiple-choice items (prompt and options exactly as the risk pipeline has them).

    ``four_options`` keeps the answer and the first three other options, in order (CommonsenseQA
    has five; as ARC's out-of-distribution foil it offers as many as ARC's usual four).
    """
    out = []
    for item in items:
        options, answer = list(item.options), int(item.answer_index or 0)
        if four_options and len(options) > 4:
            keep = sorted([answer, *[i for i in range(len(options)) if i != answer][:3]])
            answer, options = keep.index(answer), [options[i] for i in keep]
        out.append(Example(item.prompt, tuple(options), answer))
    return out


def read_items(name: str, path: Path, *, base: bool, four_options: bool = False) -> list[Example]:
    data = load_dataset(name, path, prompt_style="fewshot" if base else "instruct")
    return from_items(list(data), four_options=four_options)


def _hash_unit(key: str) -> float:
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / 16**12


def hash_split(examples: list[Example], fractions: dict[str, float]) -> dict[str, list[Example]]:
    """A deterministic split by a hash of each prompt (for a set that ships one file only)."""
    out: dict[str, list[Example]] = {name: [] for name in fractions}
    for ex in examples:
        u, acc = _hash_unit(json.dumps(ex.prompt)), 0.0
        for name, frac in fractions.items():
            acc += frac
            if u < acc:
                out[name].append(ex)
                break
    return out


def sample(examples: list[Example], n: int | None, seed: int) -> list[Example]:
    if n is None or n >= len(examples):
        return examples
    return random.Random(seed).sample(examples, n)


# --------------------------------------------------------------------------- cached states


@dataclass(frozen=True)
class Packed:
    """One item as one sequence: the prompt, then every option after it.

    Option j's tokens attend to the prompt and to their own earlier tokens only, and take the
    positions they would have right after the prompt, so each option is scored exactly as if it
    were the response on its own (``Guard.option_probs``) while the prompt runs once, not once
    per option. ``segments``: 0 for the prompt, j + 1 for option j's tokens.
    """

    ids: tuple[int, ...]
    prompt_len: int
    spans: tuple[tuple[int, int], ...]  # [start, end) of each option in ``ids``

    @property
    def segments(self) -> list[int]:
        seg = [0] * self.prompt_len
        for j, (a, b) in enumerate(self.spans):
            seg += [j + 1] * (b - a)
        return seg

    @property
    def positions(self) -> list[int]:
        pos = list(range(self.prompt_len))
        for a, b in self.spans:
            pos += list(range(self.prompt_len, self.prompt_len + b - a))
        return pos

    @property
    def predictors(self) -> list[list[int]]:
        """Per option, the position whose output predicts each of its tokens: the prompt's last
        position for the first, the option's own previous token for the rest."""
        return [[self.prompt_len - 1, *range(a, b - 1)] for a, b in self.spans]


def pack(tok: Any, ex: Example) -> Packed:
    prompt = layout.prompt_ids(tok, ex.prompt)
    ids, spans = list(prompt), []
    for option in ex.options:
        piece = layout.response_ids(tok, option, ended=True)
        spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
    return Packed(tuple(ids), len(prompt), tuple(spans))


def packed_batch(rows: Sequence[Packed], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, position ids and the 4D boolean mask (True = may attend) of ``rows``.

    A padding query attends to itself only (a row with no key would give NaN in softmax)."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    seg = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.ids)
        ids[i, :n] = torch.tensor(r.ids)
        positions[i, :n] = torch.tensor(r.positions)
        seg[i, :n] = torch.tensor(r.segments)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = (seg.unsqueeze(2) == seg.unsqueeze(1)) | (seg.unsqueeze(1) == 0)  # own option, or the prompt
    real = (seg >= 0).unsqueeze(1) & (seg >= 0).unsqueeze(2)
    mask = causal & same & real
    mask |= torch.eye(width, dtype=torch.bool) & (seg < 0).unsqueeze(2)
    return {"input_ids": ids, "position_ids": positions, "attention_mask": mask.unsqueeze(1)}


@dataclass
class Encoded:
    """A split as packed items and the states entering block k, with the base model's scores."""

    rows: list[Packed]
    labels: np.ndarray
    n_options: np.ndarray
    width: int  # the task's largest option count: the score matrix's columns
    states: list[torch.Tensor]  # per item [len, d]: the input of block k
    base_logits: torch.Tensor  # [n, width] option scores from the full forward that recorded the states
    seconds: float = 0.0  # time to compute (0 when read from the cache)

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, idx: Sequence[int]) -> Encoded:
        """The items ``idx`` only (their cached states kept, nothing recomputed)."""
        return Encoded([self.rows[i] for i in idx], self.labels[list(idx)], self.n_options[list(idx)], self.width,
                       [self.states[i] for i in idx], self.base_logits[list(idx)])


class Top:
    """The frozen model from block k up, run from cached states; member blocks swap in.

    ``logits`` pads a batch of packed items on the right, lets blocks 0..k-1 stand aside
    returning the cached states, and scores each option by the mean log-probability of its
    tokens; options an item does not have get -inf.
    """

    def __init__(self, model: nn.Module, tok: Any, k: int) -> None:
        self.model, self.tok, self.k = model, tok, k
        blocks = decoder_blocks(model)
        if blocks is None or not 0 < k < len(blocks):
            raise ValueError(f"cannot start at block {k} of this model")
        self.blocks = blocks
        self.cap = getattr(model.config, "final_logit_softcapping", None)
        self.pad = int(tok.pad_token_id) if tok.pad_token_id is not None else 0

    def frozen_blocks(self) -> list[nn.Module]:
        return list(self.blocks)[self.k :]

    def scores(self, hidden: torch.Tensor, rows: Sequence[Packed], ids: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] mean log-probability of each option's tokens (-inf: no such option)."""
        r_idx, p_idx, t_idx, opt = [], [], [], []
        for i, row in enumerate(rows):
            for j, ((a, b), pred) in enumerate(zip(row.spans, row.predictors, strict=True)):
                r_idx += [i] * (b - a)
                p_idx += pred
                t_idx += list(range(a, b))
                opt += [i * width + j] * (b - a)
        r_t, p_t, t_t, o_t = (torch.tensor(x) for x in (r_idx, p_idx, t_idx, opt))
        logits = self.model.get_output_embeddings()(hidden[r_t, p_t]).float()
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        logp = torch.log_softmax(logits, -1).gather(-1, ids[r_t, t_t].unsqueeze(-1)).squeeze(-1)
        total = torch.zeros(len(rows) * width).index_add(0, o_t, logp)
        count = torch.zeros(len(rows) * width).index_add(0, o_t, torch.ones_like(logp))
        out = (total / count.clamp_min(1)).reshape(len(rows), width)
        return out.masked_fill(count.reshape(len(rows), width) == 0, float("-inf"))

    def logits(self, enc: Encoded, items: Sequence[int], member: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """[len(items), C] option scores of ``items`` of ``enc`` with blocks k.. replaced by ``member``."""
        rows = [enc.rows[i] for i in items]
        batch = packed_batch(rows, self.pad)
        width = batch["input_ids"].shape[1]
        frozen = FrozenStates(self.blocks, self.k, enc.states)  # the library's own cached-state path
        with frozen.standing_in(items, width), swap_blocks(self.blocks, self.k, member):
            out = self.model.base_model(**batch, use_cache=False)
        return self.scores(out.last_hidden_state, rows, batch["input_ids"], enc.width)

    def full_logits(self, enc: Encoded, items: Sequence[int], member: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """The same scores from a plain full forward (the reference the cached path must equal)."""
        rows = [enc.rows[i] for i in items]
        batch = packed_batch(rows, self.pad)
        with swap_blocks(self.blocks, self.k, member):
            out = self.model.base_model(**batch, use_cache=False)
        return self.scores(out.last_hidden_state, rows, batch["input_ids"], enc.width)


@contextmanager
def swap_blocks(blocks: nn.ModuleList, k: int, member: Sequence[nn.Module] | None) -> Iterator[None]:
    """Blocks k.. are ``member``'s inside the context (nothing changes for ``None``)."""
    if member is None:
        yield
        return
    saved = list(blocks)[k:]
    try:
        for i, block in enumerate(member):
            blocks[k + i] = block
        yield
    finally:
        for i, block in enumerate(saved):
            blocks[k + i] = block


def encode_split(top: Top, examples: list[Example], width: int, *, batch: int = 16, cache: Path | None = None,
                 desc: str = "encode") -> Encoded:
    """Every example packed, with its states at block k (one full forward each), cached on disk:
    the file is keyed by the model's state, k and the prompts, written atomically."""
    rows = [pack(top.tok, ex) for ex in examples]
    window = getattr(top.model.config, "sliding_window", None)
    if window and max(len(r.ids) for r in rows) > window:
        raise ValueError(f"a packed item is longer than the model's sliding window ({window}): the packed mask "
                         "would not apply it")
    labels = np.array([ex.label for ex in examples])
    n_options = np.array([ex.n_options for ex in examples])
    lengths = [len(r.ids) for r in rows]
    if cache is not None and cache.is_file():
        t = load_file(str(cache))
        if t["lengths"].tolist() == lengths:
            return Encoded(rows, labels, n_options, width, list(torch.split(t["states"], lengths)), t["base_logits"])
    states: list[torch.Tensor | None] = [None] * len(rows)
    base = torch.zeros(len(rows), width)
    order = sorted(range(len(rows)), key=lambda i: lengths[i])  # little padding per batch
    start = time.perf_counter()
    with torch.no_grad():
        for i in tqdm(range(0, len(order), batch), desc=desc, unit="batch", leave=False):
            idx = order[i : i + batch]
            chunk = [rows[r] for r in idx]
            b = packed_batch(chunk, top.pad)
            with StateCapture(top.blocks, top.k) as cap:
                out = top.model.base_model(**b, use_cache=False)
            got = cap.states()
            if got is None:
                raise RuntimeError("the block before k returned no plain tensor; cannot cache its states")
            base[idx] = top.scores(out.last_hidden_state, chunk, b["input_ids"], width)
            for j, r in enumerate(idx):
                states[r] = got[j, : lengths[r]].clone()
    enc = Encoded(rows, labels, n_options, width, [s for s in states if s is not None], base,
                  time.perf_counter() - start)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        save_file({"states": torch.cat(enc.states).contiguous(), "lengths": torch.tensor(lengths),
                   "base_logits": base.contiguous()}, str(tmp))
        os.replace(tmp, cache)
    return enc


def cache_key(model_fp: str, k: int, width: int, examples: list[Example]) -> str:
    h = hashlib.sha256(json.dumps(["packed", model_fp, k, width,
                                   [[e.prompt, e.options, e.label] for e in examples]]).encode())
    return h.hexdigest()[:20]


# --------------------------------------------------------------------------- methods


@dataclass
class Fit:
    """What training one method cost and how its loss went."""

    seconds: float
    peak_rss_mb: float | None
    history: list[float]  # the members' mean loss at each step
    member_history: list[list[float]] = field(default_factory=list)  # [step][member]: each one's own loss


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) so a phase's own peak can be read."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Method:
    """M members over the top blocks. Subclasses build members and say how they run."""

    family = ""
    fitted_: dict[str, Any] | None = None  # what training cost, once trained (set by the runner)

    def __init__(self, members: int, lr: float, *, seed: int = 0, weight_decay: float = 0.0) -> None:
        self.members, self.lr, self.seed, self.weight_decay = members, lr, seed, weight_decay

    @property
    def name(self) -> str:
        return f"{self.family} M={self.members}"

    def build(self, top: Top) -> None:
        raise NotImplementedError

    def parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def trainable_per_member(self) -> int:
        return sum(p.numel() for p in self.parameters()) // self.members

    def stored(self) -> int:
        """Parameters this method must store beyond the one pretrained model."""
        return sum(p.numel() for p in self.parameters())

    def settings(self) -> dict[str, Any]:
        return {"members": self.members, "lr": self.lr, "weight_decay": self.weight_decay, "seed": self.seed}

    # one step's logits for (member, rows) pairs, member-major; and all members' logits for rows
    def train_logits(self, top: Top, enc: Encoded, rows: list[list[int]]) -> list[torch.Tensor]:
        raise NotImplementedError

    def member_logits(self, top: Top, enc: Encoded, rows: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)

    def fit(self, top: Top, enc: Encoded, *, steps: int, batch: int, max_grad_norm: float = 1.0,
            progress: bool = True) -> Fit:
        """AdamW on every member's own mean cross-entropy; members never share a gradient."""
        reset_peak_rss()
        start = time.perf_counter()
        optim = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        history, member_history = [], []
        labels = torch.as_tensor(enc.labels)
        for step in tqdm(range(steps), desc=f"fit {self.name}", unit="step", disable=not progress, leave=False):
            rows = [member_batch(len(enc), m, step, batch, self.seed) for m in range(self.members)]
            logits = self.train_logits(top, enc, rows)
            losses = [nn.functional.cross_entropy(lg, labels[r]) for lg, r in zip(logits, rows, strict=True)]
            loss = torch.stack(losses).sum()  # each member's gradient is its own loss's
            optim.zero_grad(set_to_none=True)
            loss.backward()
            self.clip(max_grad_norm)
            optim.step()
            history.append(float(loss.detach()) / self.members)
            member_history.append([float(m.detach()) for m in losses])
        return Fit(time.perf_counter() - start, peak_rss_mb(), history, member_history)

    def predict(self, top: Top, enc: Encoded, *, batch: int = 32) -> np.ndarray:
        """[M, n, C] member log-probabilities over each item's options."""
        out = []
        with torch.no_grad():
            for i in range(0, len(enc), batch):
                rows = list(range(i, min(i + batch, len(enc))))
                out.append(torch.log_softmax(self.member_logits(top, enc, rows), -1))
        return torch.cat(out, dim=1).numpy()


class SVEMethod(Method):
    """Frozen U, V of each targeted projection; members own their spectrum and bias, raw
    (Σᵐ = Σ ⊙ (1 + εᵐ), b in absolute units: the harness's default, what docs/ensembles ran) or
    scale-free (Σᵐ = Σ ⊙ exp(δᵐ), b = b₀ + s·βᵐ; ``guarduq.sve.SVELinear``)."""

    family = "SVE"

    def __init__(self, members: int, lr: float, *, sigma_init: float = 0.05, targets: Sequence[str] = LLAMA_TARGETS,
                 seed: int = 0, weight_decay: float = 0.0, parametrisation: str = "raw", bias: str = "raw") -> None:
        super().__init__(members, lr, seed=seed, weight_decay=weight_decay)
        self.sigma_init, self.targets = sigma_init, tuple(targets)
        self.parametrisation, self.bias = parametrisation, bias

    @property
    def name(self) -> str:
        return "fine-tuned (SVE M=1)" if self.members == 1 else f"SVE M={self.members}"

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "sigma_init": self.sigma_init, "targets": list(self.targets),
                "parametrisation": self.parametrisation, "bias": self.bias}

    def build(self, top: Top) -> None:
        self.blocks = nn.ModuleList(copy.deepcopy(top.frozen_blocks()))
        self.blocks.requires_grad_(False)
        gen = torch.Generator().manual_seed(self.seed)
        self.layers: list[SVELinear] = []
        for name, module in sorted(self.blocks.named_modules()):
            if name.rpartition(".")[2] in self.targets and isinstance(module, nn.Linear):
                u, s, vh = torch.linalg.svd(module.weight.detach().double(), full_matrices=False)
                layer = SVELinear(u.to(module.weight.dtype), s.to(module.weight.dtype), vh.T.to(module.weight.dtype),
                                  module.bias, members=self.members, sigma_init=self.sigma_init, generator=gen,
                                  parametrisation=self.parametrisation, bias_mode=self.bias)
                parent, _, child = name.rpartition(".")
                setattr(self.blocks.get_submodule(parent), child, layer)
                self.layers.append(layer)

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.trainable()]

    def clip(self, max_norm: float) -> None:
        clip_per_member(self.parameters(), max_norm)

    def _folded(self, top: Top, enc: Encoded, rows: list[list[int]]) -> list[torch.Tensor]:
        width = len(rows[0])
        flat = [r for member_rows in rows for r in member_rows]  # member-major: what SVELinear expects
        logits = top.logits(enc, flat, self.blocks)
        return list(logits.split(width))

    def train_logits(self, top: Top, enc: Encoded, rows: list[list[int]]) -> list[torch.Tensor]:
        return self._folded(top, enc, rows)

    def member_logits(self, top: Top, enc: Encoded, rows: list[int]) -> torch.Tensor:
        return torch.stack(self._folded(top, enc, [rows] * self.members))


class _CopiesMethod(Method):
    """Members are separate copies of the top blocks; each runs its own forward."""

    def build(self, top: Top) -> None:
        self.copies = [self._member(top, m) for m in range(self.members)]

    def _member(self, top: Top, m: int) -> nn.ModuleList:
        raise NotImplementedError

    def parameters(self) -> list[nn.Parameter]:
        return [p for c in self.copies for p in c.parameters() if p.requires_grad]

    def clip(self, max_norm: float) -> None:
        for c in self.copies:
            torch.nn.utils.clip_grad_norm_([p for p in c.parameters() if p.requires_grad], max_norm)

    def train_logits(self, top: Top, enc: Encoded, rows: list[list[int]]) -> list[torch.Tensor]:
        return [top.logits(enc, r, c) for c, r in zip(self.copies, rows, strict=True)]

    def member_logits(self, top: Top, enc: Encoded, rows: list[int]) -> torch.Tensor:
        return torch.stack([top.logits(enc, rows, c) for c in self.copies])


class LoRAMethod(_CopiesMethod):
    """LoRA-Ensemble: M adapters (rank r on every targeted projection), each its own init."""

    family = "LoRA-Ensemble"

    def __init__(self, members: int, lr: float, *, rank: int = 8, alpha: float = 16.0,
                 targets: Sequence[str] = LLAMA_TARGETS, seed: int = 0, weight_decay: float = 0.0) -> None:
        super().__init__(members, lr, seed=seed, weight_decay=weight_decay)
        self.rank, self.alpha, self.targets = rank, alpha, tuple(targets)

    @property
    def name(self) -> str:
        return "LoRA (M=1)" if self.members == 1 else f"LoRA-Ensemble M={self.members}"

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    def _member(self, top: Top, m: int) -> nn.ModuleList:
        from peft import LoraConfig, inject_adapter_in_model

        blocks = nn.ModuleList(copy.deepcopy(top.frozen_blocks()))
        blocks.requires_grad_(False)
        torch.manual_seed(self.seed * 1_000_003 + m)  # member m's own A initialisation
        cfg = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, target_modules=list(self.targets))
        blocks = inject_adapter_in_model(cfg, blocks)
        for name, p in blocks.named_parameters():
            p.requires_grad_("lora_" in name)
        return blocks


class DeepMethod(_CopiesMethod):
    """Deep ensemble: M copies of the top blocks, every weight fine-tuned, own data order each,
    and with ``perturb`` > 0 each its own seeded start (NoisyTune; the module's docstring says why).

    Member m's perturbation is seeded by m alone, so member 0 of an M=8 ensemble is the M=1 model
    and its first four members are the M=4 ensemble."""

    family = "deep ensemble"

    def __init__(self, members: int, lr: float, *, perturb: float = 0.0, seed: int = 0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(members, lr, seed=seed, weight_decay=weight_decay)
        self.perturb = perturb

    @property
    def name(self) -> str:
        return "full fine-tune (M=1)" if self.members == 1 else f"deep ensemble M={self.members}"

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "perturb": self.perturb}

    def _member(self, top: Top, m: int) -> nn.ModuleList:
        blocks = nn.ModuleList(copy.deepcopy(top.frozen_blocks()))
        if self.perturb > 0:
            noisy_start(blocks, self.perturb, torch.Generator().manual_seed(self.seed * 1_000_003 + m))
        blocks.requires_grad_(True)
        return blocks


def noisy_start(module: nn.Module, lam: float, gen: torch.Generator) -> None:
    """NoisyTune: each parameter tensor W += U(-λ/2, λ/2) · std(W), in place (tensors of one value,
    with no spread to scale by, are left alone)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.numel() > 1:
                noise = torch.rand(p.shape, generator=gen, dtype=torch.float64) - 0.5
                p.add_((noise * lam * float(p.double().std())).to(p.dtype))


FAMILIES: dict[str, Callable[..., Method]] = {"sve": SVEMethod, "lora": LoRAMethod, "deep": DeepMethod}

