"""Streaming helpers for ``Guard.stream``: text pieces that can no longer change, cut at stops.

``generate`` duck-types a streamer (``put``/``end``) and a stopping criterion (``__call__``);
``TextPieces`` is both, so one object decodes on the generation thread and halts it.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import torch

from guarduq.errors import InputError


def check_stops(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = [stop]
    stops = tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise InputError(f"stop sequences must be non-empty strings, got {stop!r}")
    return stops


_DONE = object()


class TextPieces:
    """Streamer and stopping criterion for ``Guard.stream`` (``generate`` duck-types both).

    It decodes the generated ids on the generation thread as they arrive and queues only text
    that can no longer change: a trailing partial UTF-8 character (``\ufffd``) or a possible
    beginning of a stop string waits for the next token. When a stop string appears, the text
    is cut before it and generation halts at this step.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False  # a stop string was generated
        self._halted = False  # the consumer went away
        self._prompt_seen = False
        self._queue: queue.Queue[Any] = queue.Queue()

    # -- generation thread

    def run(self, generate: Any, ids: list[int], gen: dict[str, Any]) -> None:
        try:
            generate(ids, gen)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._queue.put(exc)
        self._queue.put(_DONE)

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        if self.stopped:
            return
        self.ids.extend(int(i) for i in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            ready = text[: min(cuts)]
        else:
            ready = stable_prefix(text, self.stops)
        if len(ready) > len(self.sent) and ready.startswith(self.sent):
            self._queue.put(ready[len(self.sent) :])
            self.sent = ready

    def end(self) -> None:
        pass  # the worker signals the end once generate() has returned or raised

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        halt = self.stopped or self._halted
        return torch.full((input_ids.shape[0],), halt, dtype=torch.bool, device=input_ids.device)

    # -- consumer thread

    def halt(self) -> None:
        self._halted = True

    def __iter__(self) -> Iterator[str]:
        while (item := self._queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item


def stable_prefix(text: str, stops: tuple[str, ...]) -> str:
    """``text`` less a trailing partial character and any tail that may begin a stop string."""
    text = text.rstrip("\ufffd")
    hold = max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )
    return text[: len(text) - hold]
