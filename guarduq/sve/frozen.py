"""Training from cached frozen-block states: the blocks below the first SVE block run once per item.

With SVE layers only in blocks k..L-1, blocks 0..k-1 are frozen and the same for every member,
step and epoch, so their output h_k for a training item never changes. ``FrozenStates.compute``
runs them once per item (a forward that stops after block k-1) and keeps h_k; during a training
step ``standing_in`` lets blocks 0..k-1 stand aside and return the cached states of the step's
rows (``guarduq.scoring.reuse.skip_blocks``, the scorer's own generation-reuse path). A step then
costs the N = L-k trained blocks forward and backward, about N/L of a full one; right padding
keeps every real position's state exact. ``tests/unit/test_sve.py`` checks that a fit from
cached states ends where a plain fit does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from guarduq._logging import get_logger
from guarduq.batching import right_pad
from guarduq.scoring.reuse import decoder_blocks, skip_blocks

log = get_logger("sve")


class _Stop(Exception):
    """Raised by the recording hook: nothing above block k-1 needs to run."""


@dataclass
class FrozenStates:
    """h_k ([len_i, d]) of every training item, and the blocks that stand aside to return it."""

    blocks: nn.ModuleList
    k: int
    states: list[torch.Tensor]

    @classmethod
    def compute(
        cls, model: nn.Module, k: int | None, ids: Sequence[list[int]], pad: int, *, batch: int = 16,
        max_bytes: int = 2 << 30, progress: bool = True,
    ) -> FrozenStates | None:
        """Run blocks 0..k-1 once per item; None where the model's blocks cannot stand aside
        (no block list, k = 0, or a block that returns something other than a plain tensor) or
        where the states would take more than ``max_bytes`` of memory."""
        blocks = decoder_blocks(model)
        if k is None or blocks is None or not 0 < k < len(blocks):
            return None
        width = next((getattr(model.config, key) for key in ("hidden_size", "n_embd", "d_model")
                      if isinstance(getattr(model.config, key, None), int)), 0)
        size = sum(len(x) for x in ids) * width * next(model.parameters()).element_size()
        if size > max_bytes:  # e.g. all of SST-2's 67k sentences: train with every block each step
            log.info("sve_frozen_states_off", reason="states too large", bytes=size, max_bytes=max_bytes)
            return None
        recorded: list[torch.Tensor] = []

        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.ndim == 3:
                recorded.append(output.detach())
            raise _Stop

        states: list[torch.Tensor | None] = [None] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # little padding per batch
        handle = blocks[k - 1].register_forward_hook(record)
        try:
            with torch.no_grad():
                for start in tqdm(range(0, len(order), batch), desc="SVE frozen states", unit="batch",
                                  disable=not progress):
                    rows = order[start : start + batch]
                    input_ids, mask = right_pad([ids[r] for r in rows], pad)
                    recorded.clear()
                    with contextlib.suppress(_Stop):
                        model(input_ids=input_ids, attention_mask=mask, use_cache=False)
                    if not recorded:
                        log.info("sve_frozen_states_off", reason="block output is not a plain tensor")
                        return None
                    for j, r in enumerate(rows):
                        states[r] = recorded[0][j, : len(ids[r])].clone()
        finally:
            handle.remove()
        return cls(blocks, k, [s for s in states if s is not None])

    @contextmanager
    def standing_in(self, rows: Sequence[int], width: int) -> Iterator[None]:
        """Within the block, a forward over ``rows`` (right-padded to ``width``) starts at block k."""
        first = self.states[rows[0]]
        hidden = first.new_zeros((len(rows), width, first.shape[-1]))
        for i, r in enumerate(rows):
            hidden[i, : self.states[r].shape[0]] = self.states[r]
        with skip_blocks(self.blocks, self.k, hidden):
            yield
