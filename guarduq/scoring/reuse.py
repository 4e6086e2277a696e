"""Reuse what generation computed: run only the blocks whose parameters enter the gradient.

Let the scored parameters all lie in decoder blocks k..L-1, the final norm and an untied LM head.
Then the gradient norm needs blocks 0..k-1 only for h_k, the hidden states entering block k: no
scored parameter lies below, so the backward stops at block k and h_k is a constant of the pass.
Generation already computed h_k at every position it fed the model (the prompt at prefill, then
one position per decoding step), and under the causal mask position t's state depends on
positions ≤ t only, so the h_k it computed for the first L-1 tokens of the scored sequence are
the h_k a fresh forward would compute (to float rounding: padding and the KV cache change the
order of some sums, never what is summed). Position L-1 only predicts past the end of the
response and feeds nothing the score reads, so its state is never needed.

So: a forward hook on block k-1 records its output during ``generate`` (``StateCapture``), and
scoring stands blocks 0..k-1 aside so that block k-1 "returns" the recorded states
(``skip_blocks``). The rest of the model's forward (embedding lookup, masks, rotary tables) runs
as usual; a scoring pass then costs the N = L-k scored blocks forward and backward, about N/L of
a full one, plus the LM head at the response positions only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from guarduq.scoring.parameters import BLOCK_LIST_NAMES

_BLOCK_LIST = re.compile(rf"(?:^|\.)(?:{BLOCK_LIST_NAMES})$")
# Outside the blocks, what may be scored without the lower blocks' own gradients.
_ABOVE_BLOCKS = {"final_norm", "head"}


def decoder_blocks(
    model: nn.Module, selected: Sequence[tuple[str, nn.Parameter]] | None = None
) -> nn.ModuleList | None:
    """The model's list of transformer blocks (``model.layers`` for Llama/Gemma, ``h`` for GPT-2).

    With ``selected``, the list whose numbered blocks hold scored parameters, the largest if
    several do (a multimodal model's language decoder, not its vision encoder)."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0 and _BLOCK_LIST.search(name)]
    if selected is not None:
        names = [n for n, _ in selected]
        lists = [(name, m) for name, m in lists
                 if any(re.match(re.escape(name) + r"\.\d+\.", n) for n in names)]
        lists.sort(key=lambda nm: -sum(p.numel() for p in nm[1].parameters()))
    return lists[0][1] if lists else None


def _block_index(name: str, blocks_name: str) -> int | None:
    m = re.match(re.escape(blocks_name) + r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def first_scored_block(
    model: nn.Module, selected: Sequence[tuple[str, nn.Parameter]], groups: Sequence[str]
) -> int | None:
    """k, the lowest block holding a scored parameter, when the pass may start there; else None.

    None when a scored parameter lies below every block (the input embedding, and so an LM head
    tied to it: its gradient needs the backward down to the embeddings), when k = 0 (nothing to
    skip), or when the model has no block list to stand aside.
    """
    blocks = decoder_blocks(model, selected)
    if blocks is None:
        return None
    blocks_name = next(n for n, m in model.named_modules() if m is blocks)
    indices = []
    for (name, _), group in zip(selected, groups, strict=True):
        if (i := _block_index(name, blocks_name)) is not None:
            indices.append(i)
        elif group not in _ABOVE_BLOCKS:
            return None
    if not indices or min(indices) == 0:
        return None
    return min(indices)


class StateCapture:
    """Records the output of block k-1 (= the input of block k) at every forward while active.

    Generation calls the model once for the prompt and once per new token; ``states`` joins the
    pieces along the sequence axis: [B, positions fed, d]. Only a plain tensor output is
    recorded; a block returning anything else makes ``ok`` False, and the caller scores the
    ordinary way.
    """

    def __init__(self, blocks: nn.ModuleList, k: int) -> None:
        self.block = blocks[k - 1]  # k comes from ``first_scored_block`` on this list: 0 < k < len
        self.pieces: list[torch.Tensor] = []
        self.ok = True
        self._handle: Any = None

    def __enter__(self) -> StateCapture:
        self._handle = self.block.register_forward_hook(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _record(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.ndim == 3:
            self.pieces.append(output.detach().clone())
        else:
            self.ok = False

    def states(self) -> torch.Tensor | None:
        if not self.ok or not self.pieces:
            return None
        if len({p.shape[0] for p in self.pieces}) != 1:  # beams or a changing batch
            return None
        return torch.cat(self.pieces, dim=1)


# What generation recorded for one reply: (the token ids the model was fed, their states [1, n, d]).
Recorded = tuple[tuple[int, ...], torch.Tensor] | None


def plain_decoding(gen: dict[str, Any]) -> bool:
    """One sequence per row, extended one token per step (greedy or sampling): the recorded
    states line up with the output rows. Beams, several returns per prompt and assisted decoding
    reorder or re-run positions; those replies are scored the ordinary way."""
    try:
        single = int(gen.get("num_beams") or 1) == 1 and int(gen.get("num_return_sequences") or 1) == 1
    except (TypeError, ValueError):  # generate() itself will refuse such settings, with its message
        return False
    return single and gen.get("assistant_model") is None and gen.get("prompt_lookup_num_tokens") is None


def recorded_rows(states: torch.Tensor | None, out: torch.Tensor, pads: Sequence[int]) -> list[Recorded]:
    """Per row i of a left-padded ``generate`` output ``out`` [B, W]: the ids the model was fed
    (row i without its ``pads[i]`` left padding, up to the last position a forward saw) and
    their states. Rows whose counts do not add up get None."""
    if states is None or states.shape[0] != out.shape[0] or states.shape[1] > out.shape[1]:
        return [None] * int(out.shape[0])
    fed = states.shape[1]
    return [(tuple(out[i, pad:fed].tolist()), states[i : i + 1, pad:fed]) for i, pad in enumerate(pads)]


def states_for(reuse: Recorded, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The recorded states for a scored sequence ``input_ids`` [1, L], or None when generation did
    not feed the model its first L-1 tokens (a reply re-tokenized differently, a stop string cut
    inside a token): then the sequence is scored the ordinary way."""
    if reuse is None:
        return None
    fed, states = reuse
    need = int(input_ids.shape[1]) - 1
    if len(fed) < need or tuple(input_ids[0, :need].tolist()) != fed[:need]:
        return None
    return states[:, :need]


@contextmanager
def skip_blocks(blocks: nn.ModuleList, k: int, states: torch.Tensor) -> Iterator[None]:
    """Within the block, blocks 0..k-1 do no work and block k-1 returns ``states``
    ([B, L, d], the scored batch's layout); every other module runs as usual. A ``forward``
    already set on a block (accelerate's dispatch hooks) is put back afterwards."""

    def stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
        return states

    stand_in.stood_aside = True  # type: ignore[attr-defined]  # memory.checkpoint_blocks skips it
    skipped = list(blocks)[:k]
    with instance_forwards(skipped, [stand_in] * len(skipped)):
        yield


@contextmanager
def instance_forwards(modules: Sequence[nn.Module], forwards: Sequence[Any]) -> Iterator[None]:
    """Within the block, each module's ``forward`` is the given callable (an instance attribute,
    which ``nn.Module.__call__`` calls); whatever instance attribute was there before returns."""
    saved = [vars(m).get("forward") for m in modules]
    try:
        for m, f in zip(modules, forwards, strict=True):
            m.forward = f
        yield
    finally:
        for m, f in zip(modules, saved, strict=True):
            if f is None:
                vars(m).pop("forward", None)
            else:
                m.forward = f


def pad_states(states: torch.Tensor, length: int) -> torch.Tensor:
    """[1, n, d] states extended with zeros to [1, length, d] (n ≥ length - 1).

    The positions filled are never read by a scored probability: the last position of a
    sequence predicts past its end, and right padding comes after every real position."""
    n = states.shape[1]
    if n >= length:
        return states[:, :length]
    pad = states.new_zeros(states.shape[0], length - n, states.shape[2])
    return torch.cat([states, pad], dim=1)
