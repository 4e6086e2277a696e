"""The ensemble harness's model side: tasks, cached frozen-block states, and the methods compared.

Every method trains only the last N transformer blocks (blocks k = L-N .. L-1) of one frozen
model. Blocks 0..k-1 then compute the same hidden states for every epoch, every member and every
method, so they run once per sequence (``encode_split``: one full forward, which also gives the
base model's own answer) and their output h_k is kept; every later pass starts at block k from
h_k (``Top``), using guarduq's own ``skip_blocks`` (the scorer's generation-reuse path), and costs
about N/L of a full one. ``tests/unit/test_ensembles_bench.py`` checks the cached path against the
full model with each method's member blocks swapped in.

Classification is cloze style, as guarduq scores multiple choice (``Guard.option_probs``): each
option is the response to the item's prompt, scored by its mean token log-probability (end of
turn included); the class probabilities are the softmax of those scores over the item's options.
(A letter-answer format leaves SmolLM2-135M at chance on ARC-Easy: 24.7% on its test split.)
Every item is padded to the task's largest option count with copies of its first option, masked
out, so that members folded into one batch hold equal numbers of sequences.

Methods (one small subclass each; all share the data order of ``guarduq.sve.training``):
* ``SVEMethod``: the targeted projections become ``SVELinear`` (frozen U, V; per-member Σ, bias);
  M = 1 with σ_init = 0 is plain singular-value fine-tuning ("one fine-tuned model").
* ``LoRAMethod``: M independent LoRA adapters (``peft``), each its own initialisation and order.
* ``DeepMethod``: M independently fine-tuned copies of the same blocks (all their weights).
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
from guarduq.batching import right_pad
from guarduq.calibration.datasets import Item, load_dataset
from guarduq.layout import PromptLike
from guarduq.scoring.reuse import StateCapture, decoder_blocks, skip_blocks
from guarduq.sve import LLAMA_TARGETS, SVELinear
from guarduq.sve.training import _member_batch, clip_per_member

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


@dataclass
class Encoded:
    """A split as option sequences: ids, where each answer starts, the states entering block k.

    Item i owns sequences ``i·C .. i·C + C - 1`` (C = ``width``, the task's largest option
    count); its options beyond ``n_options[i]`` are padding copies, masked out of every score.
    """

    ids: list[list[int]]  # per sequence: prompt + option (+ end of turn)
    starts: list[int]  # per sequence: first option token
    labels: np.ndarray
    n_options: np.ndarray
    width: int
    states: list[torch.Tensor]  # per sequence [len, d]: the input of block k
    base_logits: torch.Tensor  # [n, C] option scores from the full forward that recorded the states
    seconds: float = 0.0  # time to compute (0 when read from the cache)

    def __len__(self) -> int:
        return len(self.labels)

    def sequences(self, items: Sequence[int]) -> list[int]:
        return [i * self.width + j for i in items for j in range(self.width)]


def option_sequences(tok: Any, examples: Sequence[Example], width: int) -> tuple[list[list[int]], list[int]]:
    ids, starts = [], []
    for ex in examples:
        prompt = layout.prompt_ids(tok, ex.prompt)
        options = list(ex.options) + [ex.options[0]] * (width - ex.n_options)
        for option in options:
            ids.append(prompt + layout.response_ids(tok, option, ended=True))
            starts.append(len(prompt))
    return ids, starts


class Top:
    """The frozen model from block k up, run from cached states; member blocks swap in.

    ``scores`` pads a batch of option sequences on the right (positions and the causal mask
    stay exact), lets blocks 0..k-1 stand aside returning the cached states, and scores each
    option by the mean log-probability of its tokens; options an item does not have get -inf.
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

    def option_scores(self, hidden: torch.Tensor, ids: torch.Tensor, starts: Sequence[int],
                      lengths: Sequence[int]) -> torch.Tensor:
        """Mean log-probability of each row's answer tokens, from the last hidden states."""
        rows, pos = [], []
        for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            rows += [i] * (length - start)
            pos += list(range(start - 1, length - 1))
        rows_t, pos_t = torch.tensor(rows), torch.tensor(pos)
        logits = self.model.get_output_embeddings()(hidden[rows_t, pos_t]).float()
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        logp = torch.log_softmax(logits, -1).gather(-1, ids[rows_t, pos_t + 1].unsqueeze(-1)).squeeze(-1)
        total = torch.zeros(len(starts)).index_add(0, rows_t, logp)
        return total / torch.tensor([length - start for start, length in zip(starts, lengths, strict=True)])

    def _as_items(self, scores: torch.Tensor, enc: Encoded, items: Sequence[int]) -> torch.Tensor:
        scores = scores.reshape(len(items), enc.width)
        absent = torch.arange(enc.width) >= torch.as_tensor(enc.n_options[list(items)]).unsqueeze(1)
        return scores.masked_fill(absent, float("-inf"))

    def logits(self, enc: Encoded, items: Sequence[int], member: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """[len(items), C] option scores of ``items`` of ``enc`` with blocks k.. replaced by ``member``."""
        seqs = enc.sequences(items)
        ids = [enc.ids[s] for s in seqs]
        input_ids, mask = right_pad(ids, self.pad)
        hidden = enc.states[seqs[0]].new_zeros((len(seqs), input_ids.shape[1], enc.states[0].shape[-1]))
        for i, s in enumerate(seqs):
            hidden[i, : enc.states[s].shape[0]] = enc.states[s]
        with skip_blocks(self.blocks, self.k, hidden), swap_blocks(self.blocks, self.k, member):
            out = self.model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        scores = self.option_scores(out.last_hidden_state, input_ids, [enc.starts[s] for s in seqs],
                                    [len(x) for x in ids])
        return self._as_items(scores, enc, items)

    def full_logits(self, enc: Encoded, items: Sequence[int], member: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """The same scores from a plain full forward (the reference the cached path must equal)."""
        seqs = enc.sequences(items)
        ids = [enc.ids[s] for s in seqs]
        input_ids, mask = right_pad(ids, self.pad)
        with swap_blocks(self.blocks, self.k, member):
            out = self.model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        scores = self.option_scores(out.last_hidden_state, input_ids, [enc.starts[s] for s in seqs],
                                    [len(x) for x in ids])
        return self._as_items(scores, enc, items)


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


def encode_split(top: Top, examples: list[Example], width: int, *, batch: int = 8, cache: Path | None = None,
                 desc: str = "encode") -> Encoded:
    """Option sequences of every example and their states at block k (one full forward each),
    cached on disk: the file is keyed by the model's state, k and the prompts, written atomically."""
    ids, starts = option_sequences(top.tok, examples, width)
    labels = np.array([ex.label for ex in examples])
    n_options = np.array([ex.n_options for ex in examples])
    lengths = [len(x) for x in ids]
    if cache is not None and cache.is_file():
        t = load_file(str(cache))
        if t["lengths"].tolist() == lengths:
            return Encoded(ids, starts, labels, n_options, width, list(torch.split(t["states"], lengths)),
                           t["base_logits"])
    states: list[torch.Tensor | None] = [None] * len(ids)
    scores = torch.zeros(len(ids))
    real = [i * width + j for i, ex in enumerate(examples) for j in range(ex.n_options)]  # padding copies later
    order = sorted(real, key=lambda s: lengths[s])  # little padding per batch
    start = time.perf_counter()
    with torch.no_grad():
        for i in tqdm(range(0, len(order), batch * 4), desc=desc, unit="batch", leave=False):
            rows = order[i : i + batch * 4]
            input_ids, mask = right_pad([ids[r] for r in rows], top.pad)
            with StateCapture(top.blocks, top.k) as cap:
                out = top.model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            got = cap.states()
            if got is None:
                raise RuntimeError("the block before k returned no plain tensor; cannot cache its states")
            scores[rows] = top.option_scores(out.last_hidden_state, input_ids, [starts[r] for r in rows],
                                             [lengths[r] for r in rows])
            for j, r in enumerate(rows):
                states[r] = got[j, : lengths[r]].clone()
    for i, ex in enumerate(examples):  # padding options: copies of the item's first option
        for j in range(ex.n_options, width):
            states[i * width + j] = states[i * width]
    base = scores.reshape(len(examples), width)
    base = base.masked_fill(torch.arange(width) >= torch.as_tensor(n_options).unsqueeze(1), float("-inf"))
    enc = Encoded(ids, starts, labels, n_options, width, [s for s in states if s is not None], base,
                  time.perf_counter() - start)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        save_file({"states": torch.cat(enc.states).contiguous(), "lengths": torch.tensor(lengths),
                   "base_logits": base.contiguous()}, str(tmp))
        os.replace(tmp, cache)
    return enc


def cache_key(model_fp: str, k: int, width: int, examples: list[Example]) -> str:
    h = hashlib.sha256(json.dumps([model_fp, k, width, [[e.prompt, e.options, e.label] for e in examples]]).encode())
    return h.hexdigest()[:20]


# --------------------------------------------------------------------------- methods


@dataclass
class Fit:
    """What training one method cost and how its loss went."""

    seconds: float
    peak_rss_mb: float | None
    history: list[float]


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
        history = []
        labels = torch.as_tensor(enc.labels)
        for step in tqdm(range(steps), desc=f"fit {self.name}", unit="step", disable=not progress, leave=False):
            rows = [_member_batch(len(enc), m, step, batch, self.seed) for m in range(self.members)]
            logits = self.train_logits(top, enc, rows)
            losses = [nn.functional.cross_entropy(lg, labels[r]) for lg, r in zip(logits, rows, strict=True)]
            loss = torch.stack(losses).sum()  # each member's gradient is its own loss's
            optim.zero_grad(set_to_none=True)
            loss.backward()
            self.clip(max_grad_norm)
            optim.step()
            history.append(float(loss.detach()) / self.members)
        return Fit(time.perf_counter() - start, peak_rss_mb(), history)

    def predict(self, top: Top, enc: Encoded, *, batch: int = 32) -> np.ndarray:
        """[M, n, C] member log-probabilities over each item's options."""
        out = []
        with torch.no_grad():
            for i in range(0, len(enc), batch):
                rows = list(range(i, min(i + batch, len(enc))))
                out.append(torch.log_softmax(self.member_logits(top, enc, rows), -1))
        return torch.cat(out, dim=1).numpy()


class SVEMethod(Method):
    """Frozen U, V of each targeted projection; members own Σᵐ = Σ ⊙ (1 + εᵐ) and a bias."""

    family = "SVE"

    def __init__(self, members: int, lr: float, *, sigma_init: float = 0.05, targets: Sequence[str] = LLAMA_TARGETS,
                 seed: int = 0, weight_decay: float = 0.0) -> None:
        super().__init__(members, lr, seed=seed, weight_decay=weight_decay)
        self.sigma_init, self.targets = sigma_init, tuple(targets)

    @property
    def name(self) -> str:
        return "fine-tuned (SVE M=1)" if self.members == 1 else f"SVE M={self.members}"

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "sigma_init": self.sigma_init, "targets": list(self.targets)}

    def build(self, top: Top) -> None:
        self.blocks = nn.ModuleList(copy.deepcopy(top.frozen_blocks()))
        self.blocks.requires_grad_(False)
        gen = torch.Generator().manual_seed(self.seed)
        self.layers: list[SVELinear] = []
        for name, module in sorted(self.blocks.named_modules()):
            if name.rpartition(".")[2] in self.targets and isinstance(module, nn.Linear):
                u, s, vh = torch.linalg.svd(module.weight.detach().double(), full_matrices=False)
                layer = SVELinear(u.to(module.weight.dtype), s.to(module.weight.dtype), vh.T.to(module.weight.dtype),
                                  module.bias, members=self.members, sigma_init=self.sigma_init, generator=gen)
                parent, _, child = name.rpartition(".")
                setattr(self.blocks.get_submodule(parent), child, layer)
                self.layers.append(layer)

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in (layer.sigma, layer.bias)]

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
    """Deep ensemble: M copies of the top blocks, every weight fine-tuned, own data order each.

    The copies start from the same pretrained weights (there is no random init to vary), so they
    differ by their data orders, as fine-tuned LLM deep ensembles do.
    """

    family = "deep ensemble"

    @property
    def name(self) -> str:
        return "full fine-tune (M=1)" if self.members == 1 else f"deep ensemble M={self.members}"

    def _member(self, top: Top, m: int) -> nn.ModuleList:
        blocks = nn.ModuleList(copy.deepcopy(top.frozen_blocks()))
        blocks.requires_grad_(True)
        return blocks


FAMILIES: dict[str, Callable[..., Method]] = {"sve": SVEMethod, "lora": LoRAMethod, "deep": DeepMethod}

