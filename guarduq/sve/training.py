"""SVE training pieces: the objectives (LM and classification) and each member's batch order."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from guarduq import layout
from guarduq.errors import SVEError


class Trainee(Protocol):
    """What the objectives read of the ensemble they train (``SVEnsemble``, which imports this
    module): its model, tokenizer, hidden states, LM head and label-word logits."""

    model: nn.Module

    def require_tokenizer(self) -> Any: ...

    def label_token_ids(self, label_words: Sequence[str]) -> list[int]: ...

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor: ...

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def label_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: torch.Tensor, label_ids: list[int]
    ) -> torch.Tensor: ...


# --------------------------------------------------------------------------- objectives


@dataclass
class Batch:
    """M·B right-padded sequences, member-major, with what each objective needs."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor  # real length of each row
    starts: torch.Tensor  # first answer token (LM) of each row
    labels: torch.Tensor  # class index (classification) of each row


class Objective:
    """Turns (prompt, target) items into token ids and a batch into a loss. One subclass per kind."""

    kind = ""

    def __init__(self, ensemble: Trainee) -> None:
        self.ensemble = ensemble

    def encode(self, item: Any) -> tuple[list[int], int, int]:
        raise NotImplementedError

    def loss(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


class LMObjective(Objective):
    """Mean negative log-likelihood of the answer tokens (+ end of turn), in guarduq's layout."""

    kind = "lm"

    def encode(self, item: Any) -> tuple[list[int], int, int]:
        if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[1], str)):
            raise SVEError("LM training data must be (prompt, answer) pairs with a string answer")
        tok = self.ensemble.require_tokenizer()
        p = layout.prompt_ids(tok, item[0])
        r = layout.response_ids(tok, item[1], ended=True)
        layout.check_fits(self.ensemble.model, len(p) + len(r))
        return p + r, len(p), -1

    def loss(self, batch: Batch) -> torch.Tensor:
        hidden = self.ensemble.hidden_states(batch.input_ids, batch.attention_mask)
        rows, pos = [], []
        for i, (start, length) in enumerate(zip(batch.starts.tolist(), batch.lengths.tolist(), strict=True)):
            rows += [i] * (length - start)
            pos += list(range(start - 1, length - 1))
        rows_t, pos_t = torch.tensor(rows), torch.tensor(pos)
        logp = torch.log_softmax(self.ensemble.head_logits(hidden[rows_t, pos_t]).float(), dim=-1)
        nll = -logp.gather(-1, batch.input_ids[rows_t, pos_t + 1].unsqueeze(-1)).squeeze(-1)
        per_row = torch.zeros(len(batch.lengths)).index_add(0, rows_t, nll)
        return (per_row / (batch.lengths - batch.starts)).mean()


class ClassificationObjective(Objective):
    """Cross-entropy over the label words' next-token logits after the (chat-templated) prompt."""

    kind = "classification"

    def __init__(self, ensemble: Trainee, label_words: Sequence[str]) -> None:
        super().__init__(ensemble)
        self.label_ids = ensemble.label_token_ids(label_words)

    def encode(self, item: Any) -> tuple[list[int], int, int]:
        if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[1], int | np.integer)):
            raise SVEError("classification data must be (prompt, label index) pairs")
        label = int(item[1])
        if not 0 <= label < len(self.label_ids):
            raise SVEError(f"label {label} out of range for {len(self.label_ids)} label words")
        ids = layout.prompt_ids(self.ensemble.require_tokenizer(), item[0])
        layout.check_fits(self.ensemble.model, len(ids) + 1)
        return ids, len(ids), label

    def loss(self, batch: Batch) -> torch.Tensor:
        logits = self.ensemble.label_logits(batch.input_ids, batch.attention_mask, batch.lengths, self.label_ids)
        return nn.functional.cross_entropy(logits, batch.labels)


def clip_per_member(params: Sequence[nn.Parameter], max_norm: float) -> None:
    """Clip each member's gradient to ``max_norm`` on its own (in place).

    Member m's parameters are row m of every ``sigma`` [M, r] and ``bias`` [M, out]. One joint
    norm would let a member with a large gradient shrink every other member's step: members
    would share a gradient, and the first M of an ensemble would differ from those M trained
    alone (``tests/unit/test_ensembles_bench.py`` shows the joint clip moves them by ~0.02).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    norms = torch.sqrt(sum((g.double() ** 2).flatten(1).sum(dim=1) for g in grads))  # [M]
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1))))


def member_batch(n: int, member: int, step: int, batch_size: int, seed: int) -> list[int]:
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


def data_digest(items: list[tuple[list[int], int, int]]) -> str:
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
