"""Run a guard over a labelled dataset: answer, label, score, and remember every result on disk.

Scoring is slow (one backward pass per response), so every finished item is appended at once to a
JSON Lines cache (flush + fsync). A re-run skips what the cache already holds for the same item,
prompt and model fingerprint, so a run killed halfway loses at most the item in flight; a torn
last line left by the kill is cut off when the cache is reopened.

Per item kind:

* ``qa``: ``guard.generate`` (greedy, short), then the dataset's grader labels the text.
* ``mc``: ``guard.option_probs`` over the options; the argmax is the model's choice, and that
  option, as the response, is what ``guard.score`` scores; correct when it is the key. With a
  few-shot prompt the option ends with the stop string (a newline) instead of end-of-turn.
* ``labelled``: ``guard.score(prompt, response)`` with the label from the data.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from guarduq._logging import get_logger
from guarduq._storage import append_line, check_writable
from guarduq.calibration.datasets import Item, label_choice, label_response
from guarduq.errors import CacheCorruptError, InputError, ScoringError, StorageError

log = get_logger("evaluation")

CACHE_VERSION = 1
QA_MAX_NEW_TOKENS = 32


class GuardLike(Protocol):
    """What scoring needs from a guard (``guarduq.Guard`` satisfies it; tests use fakes)."""

    info: Any  # .name, .fingerprint

    def generate(self, prompt: Any, **kwargs: Any) -> Any: ...

    def score(self, prompt: Any, response: str, *, ended: bool = True) -> Any: ...

    def option_probs(self, prompt: Any, options: Sequence[str], *, ended: bool = True) -> list[float]: ...


@dataclass(frozen=True)
class ScoredItem:
    """One cache line: the model's response to one item, its label and all its scores."""

    id: str
    dataset: str
    kind: str
    prompt_hash: str
    model_fingerprint: str
    response: str | None
    label: int | None  # 1 = correct; None when the item could not be scored
    scores: dict[str, Any] | None
    split: str
    ended: bool | None = None
    choice: int | None = None
    option_probs: list[float] | None = None
    error: str | None = None
    seconds: float = 0.0
    version: int = CACHE_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.id, self.prompt_hash, self.model_fingerprint)

    @property
    def usable(self) -> bool:
        """Labelled and scored with valid scores: counts toward fitting and metrics."""
        return self.label is not None and self.scores is not None and bool(self.scores.get("valid"))


class ScoreCache:
    """Append-only JSON Lines file of ``ScoredItem``s, safe against interruption.

    Opening it reads every complete line; a torn last line (no newline, unparsable) is truncated
    away with a warning; an unparsable line in the middle means real corruption and raises
    ``CacheCorruptError`` naming the path and line.
    """

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only  # a reader beside a live writer: never repair, never append
        self.entries: dict[tuple[str, str, str], ScoredItem] = {}
        if not read_only:  # a read-only folder or a full disk fails here, not after an hour of scoring
            check_writable(self.path, "scoring cache")
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read scoring cache {self.path}: {exc.strerror or exc}") from exc
        *complete, tail = raw.split(b"\n")  # `tail` is whatever follows the last newline
        for lineno, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                self._add(line)
            except ValueError as exc:
                raise CacheCorruptError(
                    f"scoring cache {self.path} is corrupt at line {lineno} ({exc}); delete the "
                    "file (or that line) to re-score"
                ) from exc
        if not tail.strip() or self.read_only:
            return  # read-only: a last line without its newline may still be being written
        with open(self.path, "r+b") as f:
            try:  # a last line without its newline: the process died while writing it
                self._add(tail)
                f.seek(0, os.SEEK_END)
                f.write(b"\n")  # it was complete after all: just end it
            except ValueError:
                log.warning("cache_torn_line_dropped", path=str(self.path), line=len(complete) + 1)
                f.truncate(len(raw) - len(tail))
            f.flush()
            os.fsync(f.fileno())

    def _add(self, line: bytes) -> None:
        try:
            rec = ScoredItem(**json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(str(exc)) from exc
        self.entries[rec.key] = rec

    def get(self, item: Item, fingerprint: str) -> ScoredItem | None:
        return self.entries.get((item.id, item.prompt_hash, fingerprint))

    def append(self, rec: ScoredItem) -> None:
        if self.read_only:
            raise RuntimeError(f"{self.path} was opened read-only")
        line = json.dumps(asdict(rec), ensure_ascii=True, allow_nan=True) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.path, line.encode(), "scoring cache")
        self.entries[rec.key] = rec


def score_item(guard: GuardLike, item: Item, *, max_new_tokens: int = QA_MAX_NEW_TOKENS) -> ScoredItem:
    """Answer (or choose), label and score one item. Bad input for one item is recorded, not raised."""
    fp = guard.info.fingerprint
    t0 = time.perf_counter()
    base = {
        "id": item.id,
        "dataset": item.dataset,
        "kind": item.kind,
        "prompt_hash": item.prompt_hash,
        "model_fingerprint": fp,
        "split": item.split,
    }
    try:
        if item.kind == "qa":
            kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
            if item.stop_strings:
                kwargs.update(stop_strings=list(item.stop_strings), tokenizer=guard.tokenizer)  # type: ignore[attr-defined]
            r = guard.generate(item.prompt, **kwargs)
            return ScoredItem(
                **base,
                response=r.text,
                label=label_response(item, r.text),
                scores=r.scores.to_dict(),
                ended=r.ended,
                seconds=time.perf_counter() - t0,
            )
        if item.kind == "mc":
            # A few-shot answer ends with its stop string, as a generated one does, not with EOS.
            ended = not item.stop_strings
            options = [o + item.stop_strings[0] if item.stop_strings else o for o in item.options]
            probs = [float(p) for p in guard.option_probs(item.prompt, options, ended=ended)]
            choice = max(range(len(probs)), key=probs.__getitem__)
            scores = guard.score(item.prompt, options[choice], ended=ended)
            return ScoredItem(
                **base,
                response=options[choice],
                label=label_choice(item, choice),
                scores=scores.to_dict(),
                ended=ended,
                choice=choice,
                option_probs=probs,
                seconds=time.perf_counter() - t0,
            )
        if item.kind == "labelled":
            assert item.response is not None
            scores = guard.score(item.prompt, item.response)
            return ScoredItem(
                **base,
                response=item.response,
                label=item.label,
                scores=scores.to_dict(),
                ended=True,
                seconds=time.perf_counter() - t0,
            )
        raise InputError(f"unknown item kind {item.kind!r}")
    except InputError as exc:  # e.g. a prompt too long for this model: skip the item, say why
        log.warning("item_not_scored", id=item.id, error=str(exc))
        return ScoredItem(
            **base,
            response=None,
            label=None,
            scores=None,
            error=f"{type(exc).__name__}: {exc}",
            seconds=time.perf_counter() - t0,
        )


def score_dataset(
    guard: GuardLike,
    items: Iterable[Item],
    cache_path: str | os.PathLike[str] | None = None,
    *,
    progress: bool = True,
    max_new_tokens: int = QA_MAX_NEW_TOKENS,
    desc: str = "scoring",
) -> list[ScoredItem]:
    """Score every item (resuming from ``cache_path``), in item order, with a progress bar + ETA."""
    items = list(items)
    fp = guard.info.fingerprint
    cache = ScoreCache(cache_path) if cache_path is not None else None
    results: dict[str, ScoredItem] = {}
    todo: list[Item] = []
    for item in items:
        hit = cache.get(item, fp) if cache else None
        if hit is not None:
            results[item.id] = hit
        else:
            todo.append(item)
    if cache is not None and results:
        log.info("cache_resume", path=str(cache.path), cached=len(results), todo=len(todo))
    bar = tqdm(
        total=len(items),
        initial=len(results),
        desc=desc,
        unit="item",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    n_correct = sum(1 for r in results.values() if r.label == 1)
    try:
        for item in todo:
            rec = score_item(guard, item, max_new_tokens=max_new_tokens)
            if cache is not None:
                cache.append(rec)
            results[item.id] = rec
            n_correct += rec.label == 1
            bar.update(1)
            bar.set_postfix(acc=f"{n_correct / len(results):.2f}", refresh=False)
    finally:
        bar.close()
    return [results[item.id] for item in items]


def usable(records: Iterable[ScoredItem]) -> Iterator[ScoredItem]:
    """Records that were labelled and validly scored (the others are counted, not used)."""
    return (r for r in records if r.usable)


def summarize(records: Sequence[ScoredItem]) -> dict[str, Any]:
    """Counts per dataset: items, usable, errors, invalid scores, accuracy, mean seconds."""
    out: dict[str, Any] = {}
    for name in sorted({r.dataset for r in records}):
        rs = [r for r in records if r.dataset == name]
        ok = [r for r in rs if r.usable]
        out[name] = {
            "n": len(rs),
            "usable": len(ok),
            "errors": sum(r.error is not None for r in rs),
            "invalid_scores": sum(r.scores is not None and not r.scores.get("valid") for r in rs),
            "accuracy": sum(r.label == 1 for r in ok) / len(ok) if ok else None,
            "mean_seconds": sum(r.seconds for r in rs) / len(rs) if rs else None,
        }
    return out


def check_guard_errors(records: Sequence[ScoredItem]) -> None:
    """Raise when nothing at all could be scored (every item failed): a setup problem, not data."""
    if records and all(r.error is not None for r in records):
        raise ScoringError(f"no item could be scored; first error: {records[0].error}")
