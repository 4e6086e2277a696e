"""Long contexts within memory: activation checkpointing of the scored blocks.

A backward needs, for every block, the activations its forward saved: for a Llama-style block
about a dozen [L, d]-sized tensors and a few [L, d_ff] ones, so all-parameter scoring of an
8k-token sequence holds gigabytes on SmolLM2, where a no-grad forward holds one block's worth at
a time. With checkpointing each block's forward runs without saving anything but its inputs;
the backward re-runs that one block (with saving) just before it needs its activations, then
frees them. Peak memory becomes the block inputs ([L, d] per block) plus one block's
activations, for the price of a second forward through every checkpointed block (a full
scoring pass: about 4 forwards instead of 3).

The result is the same computation in the same order (eval mode: no dropout, nothing random),
so the scores are bit-identical to the unchecked pass; ``tests/unit/test_long_context.py``
checks it. Only the lean path uses it: the batched path's ghost-norm hooks would see every
checkpointed module twice, so ``GradientScorer.score_batch`` scores long sequences one at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from guarduq.scoring.reuse import instance_forwards


@contextmanager
def checkpoint_blocks(blocks: nn.ModuleList | None, first: int = 0) -> Iterator[None]:
    """Within the block, blocks ``first``.. run under ``torch.utils.checkpoint`` (non-reentrant,
    so parameter hooks and keyword arguments behave as without it). Blocks stood aside by
    ``reuse.skip_blocks`` are left alone; nothing happens without a block list."""
    wrapped = [b for b in (list(blocks)[first:] if blocks is not None else [])
               if not getattr(vars(b).get("forward"), "stood_aside", False)]
    forwards = [functools.partial(_checkpointed, b.forward) for b in wrapped]  # the current forward,
    with instance_forwards(wrapped, forwards):  # a dispatch hook's included
        yield


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
