"""Batched forwards and generation that give each row exactly what it would get alone.

* Generation: prompts are left-padded (``generate`` derives position ids from the attention
  mask), and each row is cut where *it* stopped: HF keeps appending pad tokens to a finished
  row, and a pad id may equal an end-of-turn id, so the stopping criteria are recorded per row
  instead of guessed from the tokens.
* Multiple-choice options: all options of a question share the prompt, which runs once; the
  options continue from its key/value cache, right-padded into one forward, and each option's
  p̄ is averaged over its own response tokens only.

Low layer: imports torch/transformers only, never ``guard``/``policy``/``cli``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from guarduq.errors import InputError

T = TypeVar("T")

DEFAULT_BATCH_SIZE = 8


def check_batch_size(batch_size: int | None) -> int:
    """``None`` means the default; anything but a positive int is an ``InputError``."""
    if batch_size is None:
        return DEFAULT_BATCH_SIZE
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    return batch_size


def chunked(seq: Sequence[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(seq), size):
        yield list(seq[i : i + size])


# Padded tokens per scoring forward+backward. The exact batched backward keeps every layer's
# activations (linear in rows x longest row) plus Gram and attention matrices (quadratic in the
# longest row): on SmolLM2 in fp32, 8 rows of ~53 tokens took 443 MiB, while 16 BoolQ passages
# of ~300 tokens took over 11 GB and were OOM-killed at 24 GB. 2048 keeps a batch to a few GB.
MAX_BATCH_TOKENS = 2048
# SmolLM2-135M's activation width per token, layers x (hidden + intermediate): what 2048 was set for.
REFERENCE_WIDTH = 30 * (576 + 1536)
MIN_BATCH_TOKENS = 256


def token_budget(model: nn.Module) -> int:
    """``MAX_BATCH_TOKENS`` scaled to ``model``: a backward keeps, per token, activations about
    layers x (hidden + intermediate) wide, so the budget shrinks by SmolLM2-135M's width over
    this model's (Qwen2.5-1.5B: 442 tokens); never above 2048 or below 256 (a longer row still
    goes alone). A heuristic set on SmolLM2: the response positions' vocabulary-wide logits come
    on top. Configs without those sizes keep 2048.
    """
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    layers, hidden = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None)
    if not isinstance(layers, int) or not isinstance(hidden, int):
        return MAX_BATCH_TOKENS
    inter = getattr(cfg, "intermediate_size", None)
    width = layers * (hidden + (inter if isinstance(inter, int) else 4 * hidden))
    return max(MIN_BATCH_TOKENS, min(MAX_BATCH_TOKENS, round(MAX_BATCH_TOKENS * REFERENCE_WIDTH / width)))


# A row joins a scoring batch only if it is at least this share of the batch's longest: padding
# costs a padded row's full forward and backward (on Qwen-0.5B, 16 TriviaQA answers scored as one
# padded batch took 5.6 s an answer, split by this rule 3.5 s), so unequal rows are split instead.
MIN_FILL = 0.75


def token_budget_chunks(
    lengths: Sequence[int], batch_size: int, max_tokens: int, min_fill: float | None = None
) -> Iterator[list[int]]:
    """Indices of ``lengths`` (sorted longest first) in runs of at most ``batch_size`` whose
    padded size (rows x the run's first, longest, row) stays within ``max_tokens`` and whose
    every row is at least ``min_fill`` of that longest; a row longer than the budget goes alone.
    Deterministic in ``lengths``, so a batch splits the same way on every run. ``min_fill``:
    ``MIN_FILL`` unless given."""
    fill = MIN_FILL if min_fill is None else min_fill
    i = 0
    while i < len(lengths):
        first = max(1, lengths[i])
        rows = max(1, min(batch_size, max_tokens // first))
        end = i + 1
        while end < min(i + rows, len(lengths)) and lengths[end] >= fill * first:
            end += 1
        yield list(range(i, end))
        i = end


# --------------------------------------------------------------------------- generation


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with every row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with every row left-aligned: positions and the causal mask of
    every real token are those of the row alone (training and teacher-forced passes)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


class FinishRecorder:
    """A stopping criterion that records the step at which each row first stopped.

    It wraps the criteria that decide per row (stop strings, the caller's own) and returns their
    verdict, so ``generate`` stops exactly as it would without it; end-of-turn ids are checked
    here too (``generate``'s own EOS criterion stops on them).
    """

    def __init__(self, eos_ids: Sequence[int], criteria: Sequence[Any], prompt_width: int) -> None:
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)
        self.criteria = list(criteria)
        self.prompt_width = prompt_width
        self.stopped_at: torch.Tensor | None = None  # new-token count at the first stop, -1 if none

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for c in self.criteria:
            done = done | c(input_ids, scores, **kwargs)
        hit = done | torch.isin(input_ids[:, -1], self.eos.to(input_ids.device))
        if self.stopped_at is None:
            self.stopped_at = torch.full((input_ids.shape[0],), -1, dtype=torch.long)
        first = hit.cpu() & (self.stopped_at < 0)
        self.stopped_at[first] = input_ids.shape[1] - self.prompt_width
        return done

    def rows(self, new: torch.Tensor) -> list[list[int]]:
        """Each row's own new tokens: up to and including its stop, else all of them."""
        out = []
        for i, row in enumerate(new.tolist()):
            n = int(self.stopped_at[i]) if self.stopped_at is not None else -1
            out.append(row[:n] if n > 0 else row)
        return out


def recorder_settings(gen: dict[str, Any], prompt_width: int) -> tuple[dict[str, Any], FinishRecorder]:
    """``gen`` with its stop strings and stopping criteria moved inside a ``FinishRecorder``."""
    gen = dict(gen)
    criteria = list(gen.pop("stopping_criteria", None) or [])
    stops = gen.pop("stop_strings", None)
    if stops:
        from transformers import StopStringCriteria

        tokenizer = gen.get("tokenizer")
        if tokenizer is None:
            raise InputError("stop_strings needs the tokenizer passed as tokenizer=")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stops))
    eos = gen["eos_token_id"]
    recorder = FinishRecorder(eos if isinstance(eos, list) else [eos], criteria, prompt_width)
    gen["stopping_criteria"] = [recorder]
    return gen, recorder


# --------------------------------------------------------------------------- multiple choice


def forward_with_cache(model: nn.Module, cache: Any, **inputs: Any) -> tuple[Any, Any]:
    """(output, its key/value cache): ``model(**inputs)`` continuing ``cache`` (None: a new one).

    transformers 5.25 renamed the argument and output ``past_key_values`` to ``cache`` (the old
    name warns, and goes in 5.40); 5.23 knows only the old one.
    """
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(**inputs, **{name: cache}, use_cache=True)
    new = out.get("cache")
    return out, out.get("past_key_values") if new is None else new


def option_mean_probs(
    model: nn.Module, prompt: Sequence[int], options: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> list[float]:
    """p̄ of each option after ``prompt`` (no grad): the prompt once, then every option from its
    key/value cache.

    Every option shares the prompt, so the prompt's keys and values are the same in every row:
    one forward over the prompt, its cache repeated once per option, then one forward over the
    right-padded options. A question with K options and a P-token prompt costs P + K·|option|
    token positions instead of K·(P + |option|) (BoolQ's passages: about half; ARC-Easy's four
    options: about a quarter). Equals :func:`padded_option_mean_probs`, which runs the prompt in
    every row, to float rounding; models whose cache cannot be repeated use that path.
    """
    start, k = len(prompt), len(options)
    ids, mask = right_pad(options, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    width = ids.shape[1]
    with torch.no_grad():
        prompt_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        try:  # only the last position's logits are needed
            head, cache = forward_with_cache(model, None, input_ids=prompt_ids, logits_to_keep=1)
        except TypeError:  # a forward without logits_to_keep or a cache argument
            head, cache = None, None
        if not hasattr(cache, "batch_repeat_interleave"):  # no transformers Cache: run the prompt per row
            return padded_option_mean_probs(model, prompt, options, pad_id, device)
        cache.batch_repeat_interleave(k)
        full_mask = torch.cat([torch.ones((k, start), dtype=mask.dtype, device=device), mask], dim=1)
        positions = torch.arange(start, start + width, device=device).expand(k, width)
        tail, _ = forward_with_cache(model, cache, input_ids=ids, attention_mask=full_mask, position_ids=positions)
        tail = tail.logits
        first = head.logits[:, -1:].expand(k, 1, tail.shape[-1])  # predicts each option's first token
        logits = torch.cat([first, tail[:, :-1]], dim=1)
    return _mean_probs(logits, ids, mask)


def padded_option_mean_probs(
    model: nn.Module, prompt: Sequence[int], options: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> list[float]:
    """p̄ of each option after ``prompt``, in one right-padded forward of prompt + option per
    row (no grad): the simple path :func:`option_mean_probs` must equal."""
    start = len(prompt)
    ids, mask = right_pad([[*prompt, *o] for o in options], pad_id)
    ids, mask = ids.to(device), mask.to(device)
    keep = ids.shape[1] - start + 1  # positions start-1 .. width-1
    with torch.no_grad():
        try:
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
        except TypeError:  # models whose forward has no logits_to_keep
            logits = model(input_ids=ids, attention_mask=mask).logits
    return _mean_probs(logits[:, -keep:-1], ids[:, start:], mask[:, start:])


def _mean_probs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Mean over each row's real tokens of p(token); ``logits[:, t]`` predicts ``ids[:, t]``."""
    with torch.no_grad():
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        tok = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        valid = mask.to(torch.float64)
        p_bar = (tok.exp().double() * valid).sum(-1) / valid.sum(-1)
    return [float(x) for x in p_bar.cpu()]
