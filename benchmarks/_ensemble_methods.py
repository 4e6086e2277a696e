"""The ensemble harness's model side: tasks, cached frozen-block states, and the methods compared.

Every method trains only the last N transformer blocks (blocks k = L-N .. L-1) of one frozen
model. Blocks 0..k-1 then compute the same hidden states for every epoch, every member and every
method, so they run once per item (``encode_split``: one full forward, which also gives the base
model's own answer) and their output h_k is kept; every later pass starts at block k from h_k
(``Top``), using guarduq's own ``skip_blocks`` (the scorer's generation-reuse path), and costs
about N/L of a full one. ``tests/unit/test_ensembles_bench.py`` checks the cached path against the
full model with each method's member blocks swapped in.

Classification is by the next-token logits of the label words (letters for multiple choice)
after the chat-templated prompt, softmaxed over the item's own options.

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
import math
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
from guarduq.layout import PromptLike
from guarduq.scoring.reuse import StateCapture, decoder_blocks, skip_blocks
from guarduq.sve import LLAMA_TARGETS, SVELinear
from guarduq.sve.training import _member_batch, clip_per_member

LETTERS = "ABCDE"
MC_INSTRUCTION = "Answer with the letter of the correct option."

# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Example:
    prompt: PromptLike
    label: int
    n_options: int


@dataclass
class Task:
    """One cell's data: label words, train / dev (selection) / test splits, optional OOD items."""

    name: str
    words: tuple[str, ...]
    splits: dict[str, list[Example]]
    ood_name: str | None = None
    describe: dict[str, Any] = field(default_factory=dict)


def mc_prompt(stem: str, options: Sequence[str], *, base: bool = False) -> str:
    """Question, lettered options, the instruction; a base model's prompt ends in "Answer:"."""
    lines = [stem.strip(), *(f"{LETTERS[i]}. {o.strip()}" for i, o in enumerate(options))]
    lines += ["Answer:"] if base else [MC_INSTRUCTION]
    return "\n".join(lines)


def mc_words(base: bool) -> tuple[str, ...]:
    """The label words: the letters, after a space for a base model's "Answer:"."""
    return tuple(f" {c}" if base else c for c in LETTERS)


def read_mc(path: Path, *, four_options: bool = False, base: bool = False) -> list[Example]:
    """ARC / CommonsenseQA JSONL as letter multiple choice (options lettered by position).

    ``four_options`` keeps the answer and the first three other options, in order (CommonsenseQA
    has five; as ARC's out-of-distribution foil it must offer as many as ARC's four-option items).
    """
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        choices = row["question"]["choices"]
        labels = [str(c["label"]).strip() for c in choices]
        answer = labels.index(str(row["answerKey"]).strip())
        texts = [c["text"] for c in choices]
        if four_options and len(texts) > 4:
            keep = sorted([answer, *[i for i in range(len(texts)) if i != answer][:3]])
            answer, texts = keep.index(answer), [texts[i] for i in keep]
        if len(texts) > len(LETTERS):
            continue
        out.append(Example(mc_prompt(row["question"]["stem"], texts, base=base), answer, len(texts)))
    return out


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
    """A split's token ids, labels, the states entering block k, and the base model's logits."""

    ids: list[list[int]]
    labels: np.ndarray
    n_options: np.ndarray
    states: list[torch.Tensor]  # [len_i, d] each: the input of block k
    base_logits: torch.Tensor  # [n, C], from the full forward that recorded the states
    seconds: float = 0.0  # time to compute (0 when read from the cache)

    def __len__(self) -> int:
        return len(self.ids)


def label_token_ids(tok: Any, words: Sequence[str]) -> list[int]:
    ids = [int(tok(w, add_special_tokens=False)["input_ids"][0]) for w in words]
    if len(set(ids)) != len(ids):
        raise ValueError(f"label words {list(words)} share a first token")
    return ids


class Top:
    """The frozen model from block k up, run from cached states; member blocks swap in.

    ``logits`` pads a batch on the right (positions and the causal mask stay exact), lets blocks
    0..k-1 stand aside returning the cached states, and reads the label words' logits at each
    row's last real token. Options an item does not have get -inf.
    """

    def __init__(self, model: nn.Module, tok: Any, k: int, words: Sequence[str]) -> None:
        self.model, self.tok, self.k = model, tok, k
        blocks = decoder_blocks(model)
        if blocks is None or not 0 < k < len(blocks):
            raise ValueError(f"cannot start at block {k} of this model")
        self.blocks = blocks
        self.label_ids = label_token_ids(tok, words)
        head = model.get_output_embeddings()
        self.head_w = head.weight[self.label_ids].detach()
        self.head_b = None if getattr(head, "bias", None) is None else head.bias[self.label_ids].detach()
        self.cap = getattr(model.config, "final_logit_softcapping", None)
        self.pad = int(tok.pad_token_id) if tok.pad_token_id is not None else 0

    def frozen_blocks(self) -> list[nn.Module]:
        return list(self.blocks)[self.k :]

    def head(self, last: torch.Tensor, n_options: torch.Tensor) -> torch.Tensor:
        logits = last.float() @ self.head_w.float().T
        if self.head_b is not None:
            logits = logits + self.head_b.float()
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        absent = torch.arange(logits.shape[1]) >= n_options.unsqueeze(1)
        return logits.masked_fill(absent, float("-inf"))

    def collate(self, ids: Sequence[list[int]], states: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        if states is None:
            return input_ids, mask
        hidden = states[0].new_zeros((len(ids), width, states[0].shape[-1]))
        for i, s in enumerate(states):
            hidden[i, : s.shape[0]] = s
        return input_ids, mask, hidden

    def logits(self, enc: Encoded, rows: Sequence[int], member: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """[len(rows), C] label logits of ``rows`` of ``enc`` with blocks k.. replaced by ``member``."""
        input_ids, mask, hidden = self.collate([enc.ids[r] for r in rows], [enc.states[r] for r in rows])
        with skip_blocks(self.blocks, self.k, hidden), swap_blocks(self.blocks, self.k, member):
            out = self.model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        last = out.last_hidden_state[torch.arange(len(rows)), mask.sum(1) - 1]
        return self.head(last, torch.as_tensor(enc.n_options[list(rows)]))

    def full_logits(self, ids: Sequence[list[int]], n_options: np.ndarray,
                    member: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """The same logits from a plain full forward (the reference the cached path must equal)."""
        input_ids, mask = self.collate(ids, None)
        with swap_blocks(self.blocks, self.k, member):
            out = self.model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        last = out.last_hidden_state[torch.arange(len(ids)), mask.sum(1) - 1]
        return self.head(last, torch.as_tensor(n_options))


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


def encode_split(top: Top, examples: list[Example], *, batch: int = 8, cache: Path | None = None,
                 desc: str = "encode") -> Encoded:
    """Token ids and states at block k of every example (one full forward each), cached on disk.

    The file is keyed by the model's state, k and the prompts, written atomically once complete.
    """
    ids = [layout.prompt_ids(top.tok, ex.prompt) for ex in examples]
    labels = np.array([ex.label for ex in examples])
    n_options = np.array([ex.n_options for ex in examples])
    if cache is not None and cache.is_file():
        t = load_file(str(cache))
        lengths = [len(x) for x in ids]
        if t["lengths"].tolist() == lengths:
            return Encoded(ids, labels, n_options, list(torch.split(t["states"], lengths)), t["base_logits"])
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # little padding per batch
    states: list[torch.Tensor | None] = [None] * len(ids)
    base = torch.zeros(len(ids), len(top.label_ids))
    start = time.perf_counter()
    with torch.no_grad():
        for i in tqdm(range(0, len(order), batch), desc=desc, unit="batch", leave=False):
            rows = order[i : i + batch]
            input_ids, mask = top.collate([ids[r] for r in rows], None)
            with StateCapture(top.blocks, top.k) as cap:
                out = top.model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)
            got = cap.states()
            if got is None:
                raise RuntimeError("the block before k returned no plain tensor; cannot cache its states")
            last = out.last_hidden_state[torch.arange(len(rows)), mask.sum(1) - 1]
            base[rows] = top.head(last, torch.as_tensor(n_options[rows]))
            for j, r in enumerate(rows):
                states[r] = got[j, : len(ids[r])].clone()
    enc = Encoded(ids, labels, n_options, [s for s in states if s is not None], base, time.perf_counter() - start)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        save_file({"states": torch.cat(enc.states).contiguous(), "lengths": torch.tensor([len(x) for x in ids]),
                   "base_logits": base.contiguous()}, str(tmp))
        os.replace(tmp, cache)
    return enc


def cache_key(model_fp: str, k: int, examples: list[Example]) -> str:
    h = hashlib.sha256(json.dumps([model_fp, k, [[e.prompt, e.label, e.n_options] for e in examples]]).encode())
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


def mean_probs(member_logp: np.ndarray) -> np.ndarray:
    """The ensemble's prediction: the mean of the members' probabilities."""
    return np.exp(member_logp).mean(axis=0)


def log_or_nan(x: float) -> float:
    return math.log(x) if x > 0 else float("nan")
