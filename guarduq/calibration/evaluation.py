"""Run a guard over a labelled dataset: answer, label, score, and remember every result on disk.

Scoring is slow (one backward pass per response), so every finished item is appended at once to a
JSON Lines cache (flush + fsync). A re-run skips what the cache already holds for the same item,
prompt and model fingerprint, so a run killed halfway loses at most the batch in flight; a torn
last line left by the kill is cut off when the cache is reopened.

Per item kind:

* ``qa``: ``guard.generate_batch`` (greedy, short), then the dataset's grader labels the text.
* ``mc``: ``guard.option_probs`` over the options (the prompt once, the options from its
  cache); the argmax is the model's choice, and that option, as the response, is what
  ``guard.score_batch`` scores; correct when it is the key. With a few-shot prompt the option
  ends with the stop string (a newline) instead of end-of-turn.
* ``labelled``: ``guard.score_batch`` over (prompt, response) with the label from the data.

Items go ``batch_size`` at a time; a batch's records are appended as soon as it is done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tqdm.auto import tqdm

from guarduq import batching
from guarduq._logging import get_logger
from guarduq._storage import append_line, check_writable
from guarduq.calibration.datasets import Item
from guarduq.calibration.features import derive_parameter_set
from guarduq.calibration.labels import label_choice, label_response
from guarduq.errors import CacheCorruptError, InputError, ScoringError, StorageError

log = get_logger("evaluation")

CACHE_VERSION = 1
QA_MAX_NEW_TOKENS = 32


class GuardLike(Protocol):
    """What scoring needs from a guard (``guarduq.Guard`` satisfies it; tests use fakes)."""

    info: Any  # .name, .fingerprint

    def generate_batch(self, prompts: Sequence[Any], *, batch_size: int | None = None, **kwargs: Any) -> list[Any]: ...

    def score_batch(self, pairs: Sequence[tuple[Any, str]], *, ended: bool = True) -> list[Any]: ...

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
    def key(self) -> tuple[str, str, str, str]:
        """One record per item, prompt, model and parameter set (scores over another set are
        another quantity; a cache may hold both)."""
        return (self.id, self.prompt_hash, self.model_fingerprint, self.parameter_set)

    @property
    def parameter_set(self) -> str:
        """The set the scores cover; an item that could not be scored keeps its run's in ``extra``."""
        return str((self.scores or {}).get("parameter_set") or self.extra.get("parameter_set") or "all")

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
        self.entries: dict[tuple[str, str, str, str], ScoredItem] = {}
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

    def get(self, item: Item, fingerprint: str, parameter_set: str = "all") -> ScoredItem | None:
        """The record for this item, model and parameter set; for ``last_n_blocks=N``, failing
        that, the all-parameter record read down to those blocks (exact: ``derive_parameter_set``),
        so a calibrator over the last blocks needs no second scoring of what a frontier scored."""
        hit = self.entries.get((item.id, item.prompt_hash, fingerprint, parameter_set))
        if hit is not None or parameter_set == "all":
            return hit
        full = self.entries.get((item.id, item.prompt_hash, fingerprint, "all"))
        derived = derive_parameter_set(full.scores, parameter_set) if full is not None and full.scores else None
        return None if derived is None else replace(full, scores=derived)  # type: ignore[arg-type]

    def append(self, rec: ScoredItem) -> None:
        if self.read_only:
            raise RuntimeError(f"{self.path} was opened read-only")
        line = json.dumps(asdict(rec), ensure_ascii=True, allow_nan=True) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.path, line.encode(), "scoring cache")
        self.entries[rec.key] = rec


def parameter_set_of(guard: Any) -> str:
    """The parameter set a Guard (``guard.scorer``) or a pool of them (``RayScorer``) scores over."""
    scorer = getattr(guard, "scorer", None)
    return str(getattr(scorer, "parameter_set", None) or getattr(guard, "parameter_set", None) or "all")


def score_item(guard: GuardLike, item: Item, *, max_new_tokens: int = QA_MAX_NEW_TOKENS) -> ScoredItem:
    """Answer (or choose), label and score one item. Bad input for one item is recorded, not raised."""
    return score_items(guard, [item], max_new_tokens=max_new_tokens)[0]


def score_items(
    guard: GuardLike, items: Sequence[Item], *, max_new_tokens: int = QA_MAX_NEW_TOKENS
) -> list[ScoredItem]:
    """Answer (or choose), label and score a batch of items, batched where the guard can:
    one ``generate_batch`` per set of generation settings, one forward per multiple-choice
    question, one ``score_batch`` for every chosen option and labelled response.

    Bad input for one item (e.g. a prompt too long for the model) is recorded on that item, not
    raised; ``seconds`` is the batch's wall time shared equally.
    """
    t0 = time.perf_counter()
    out: dict[int, dict[str, Any] | Exception] = {}
    by_settings: dict[tuple[str, ...], list[int]] = {}
    to_score: list[tuple[int, str, bool, dict[str, Any]]] = []  # (index, response, ended, fields)
    for i, item in enumerate(items):
        if item.kind == "qa":
            by_settings.setdefault(item.stop_strings, []).append(i)
        elif item.kind == "mc":
            # A few-shot answer ends with its stop string, as a generated one does, not with EOS.
            ended = not item.stop_strings
            options = [o + item.stop_strings[0] if item.stop_strings else o for o in item.options]
            try:
                probs = [float(p) for p in guard.option_probs(item.prompt, options, ended=ended)]
            except InputError as exc:
                out[i] = exc
                continue
            choice = max(range(len(probs)), key=probs.__getitem__)
            fields = {"label": label_choice(item, choice), "choice": choice, "option_probs": probs}
            to_score.append((i, options[choice], ended, fields))
        elif item.kind == "labelled":
            assert item.response is not None
            to_score.append((i, item.response, bool(item.meta.get("ended", True)), {"label": item.label}))
        else:
            out[i] = InputError(f"unknown item kind {item.kind!r}")
    for stops, idx in by_settings.items():
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        if stops:
            kwargs.update(stop_strings=list(stops), tokenizer=guard.tokenizer)  # type: ignore[attr-defined]
        replies = _each_or_error(
            lambda ps, kw=kwargs: guard.generate_batch(ps, batch_size=len(ps), **kw),
            [items[i].prompt for i in idx],
        )
        for i, r in zip(idx, replies, strict=True):
            out[i] = r if isinstance(r, Exception) else {
                "response": r.text, "label": label_response(items[i], r.text),
                "scores": r.scores.to_dict(), "ended": r.ended,
            }
    scored = _each_or_error(
        lambda rows: guard.score_batch([(p, r) for p, r, _ in rows], ended=[e for *_, e in rows]),
        [(items[i].prompt, response, ended) for i, response, ended, _ in to_score],
    )
    for (i, response, ended, fields), s in zip(to_score, scored, strict=True):
        out[i] = s if isinstance(s, Exception) else {
            "response": response, "scores": s.to_dict(), "ended": ended, **fields,
        }
    seconds = (time.perf_counter() - t0) / max(len(items), 1)
    pset = parameter_set_of(guard)
    return [_record(item, guard.info.fingerprint, out[i], seconds, pset) for i, item in enumerate(items)]


def _each_or_error(run: Callable[[list[Any]], list[Any]], xs: list[Any]) -> list[Any]:
    """``run(xs)``; when that raises ``InputError``, each x alone, with its error in its place."""
    if not xs:
        return []
    try:
        return run(xs)
    except InputError as exc:
        if len(xs) == 1:
            return [exc]
    out: list[Any] = []
    for x in xs:
        try:
            out.append(run([x])[0])
        except InputError as exc:
            out.append(exc)
    return out


def _record(
    item: Item, fingerprint: str, result: dict[str, Any] | Exception, seconds: float, parameter_set: str = "all"
) -> ScoredItem:
    base = {
        "id": item.id,
        "dataset": item.dataset,
        "kind": item.kind,
        "prompt_hash": item.prompt_hash,
        "model_fingerprint": fingerprint,
        "split": item.split,
        "seconds": seconds,
    }
    if isinstance(result, Exception):  # e.g. a prompt too long for this model: skip the item, say why
        log.warning("item_not_scored", id=item.id, error=str(result))
        return ScoredItem(
            **base, response=None, label=None, scores=None, error=f"{type(result).__name__}: {result}",
            extra={"parameter_set": parameter_set} if parameter_set != "all" else {},
        )
    return ScoredItem(**base, **result)


@runtime_checkable
class BatchScorer(Protocol):
    """Scores batches of items elsewhere (e.g. ``guarduq.distributed.RayScorer``), in any order."""

    info: Any

    def score_item_batches(
        self, batches: list[list[Item]], *, max_new_tokens: int
    ) -> Iterator[list[ScoredItem]]: ...


def score_dataset(
    guard: GuardLike | BatchScorer,
    items: Iterable[Item],
    cache_path: str | os.PathLike[str] | None = None,
    *,
    batch_size: int | None = None,
    progress: bool = True,
    max_new_tokens: int = QA_MAX_NEW_TOKENS,
    desc: str = "scoring",
) -> list[ScoredItem]:
    """Score every item (resuming from ``cache_path``), in item order, with a progress bar + ETA.

    Items go ``batch_size`` at a time (default ``batching.DEFAULT_BATCH_SIZE``); each record is
    appended (fsynced) as soon as its batch is done, so a killed run loses at most the batches
    in flight. ``guard`` may be a ``BatchScorer`` that scores the batches elsewhere.

    Batches are fixed slices of ``items``, whatever the cache holds: a batch with any item
    missing is scored whole and only the missing records are appended. Padding, and so the fp32
    rounding of a score, depends on a batch's members, so a resumed run then writes the very
    numbers an uninterrupted one would (bit for bit on the same machine and threads).
    """
    items = list(items)
    size = batching.check_batch_size(batch_size)
    fp = guard.info.fingerprint
    pset = parameter_set_of(guard)
    cache = ScoreCache(cache_path) if cache_path is not None else None
    results: dict[tuple[str, str], ScoredItem] = {}  # by _slot: one id may come in two prompt styles
    for item in items:
        hit = cache.get(item, fp, pset) if cache else None
        if hit is not None:
            results[_slot(item)] = hit
    batches = [b for b in batching.chunked(items, size) if any(_slot(i) not in results for i in b)]
    if cache is not None and results:
        log.info("cache_resume", path=str(cache.path), cached=len(results), todo=len(items) - len(results))
    bar = tqdm(
        total=len(items),
        initial=len(results),
        desc=desc,
        unit="item",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    if isinstance(guard, BatchScorer):
        done = guard.score_item_batches(batches, max_new_tokens=max_new_tokens)
    else:
        done = (score_items(guard, batch, max_new_tokens=max_new_tokens) for batch in batches)
    n_correct = sum(1 for r in results.values() if r.label == 1)
    try:
        for recs in done:
            new = [r for r in recs if _slot(r) not in results]  # cached members of a batch stay
            for rec in new:
                if rec.model_fingerprint != fp:
                    raise ScoringError(f"a record was scored by model {rec.model_fingerprint}, expected {fp}")
                if cache is not None:
                    cache.append(rec)
                results[_slot(rec)] = rec
                n_correct += rec.label == 1
            bar.update(len(new))
            bar.set_postfix(acc=f"{n_correct / len(results):.2f}", refresh=False)
    finally:
        bar.close()
    return [results[_slot(item)] for item in items]


def _slot(x: Item | ScoredItem) -> tuple[str, str]:
    """An item's place in one run: its id and prompt (the cache key, less the model)."""
    return (x.id, x.prompt_hash)


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


def add_p_true(
    guard: Any,
    items: Sequence[Item],
    records: Sequence[ScoredItem],
    cache_path: str | os.PathLike[str] | None = None,
    *,
    progress: bool = True,
    desc: str = "P(True)",
) -> list[ScoredItem]:
    """Add ``scores["p_true"]`` (the model's P(True) for its own answer: one extra forward each)
    to every usable record that lacks it, appending the updated lines to the cache.

    Only for calibrators that ask for the opt-in ``p_true`` feature; the cache's last line per
    item wins, so a re-run reuses what was computed.
    """
    from dataclasses import replace

    from guarduq.scoring.baselines import PTrue, cut_at_stops

    by_id = {it.id: it for it in items}
    cache = ScoreCache(cache_path) if cache_path is not None else None
    todo = [i for i, r in enumerate(records) if r.usable and "p_true" not in (r.scores or {})]
    out = list(records)
    scorer = PTrue()
    for i in tqdm(todo, desc=desc, unit="item", file=sys.stderr, disable=not progress):
        rec = out[i]
        item = by_id.get(rec.id)
        if item is None or rec.response is None:
            continue
        answer = cut_at_stops(rec.response, item.stop_strings).strip() or rec.response
        try:
            p = scorer.true_prob(guard, item.question, answer)
        except InputError as exc:
            log.warning("p_true_not_scored", id=rec.id, error=str(exc))
            continue
        new = replace(rec, scores={**(rec.scores or {}), "p_true": p})
        if cache is not None:
            cache.append(new)
        out[i] = new
    return out


SVE_KEYS_PREFIX = "sve_"  # every key add_sve_opinion writes starts so: replaced together, never mixed


class EnsembleLike(Protocol):
    """What the SVE features need (``guarduq.sve.SVEnsemble`` satisfies it; tests may fake it)."""

    def second_opinion(self, prompt: Any, response: str, *, ended: bool = True, max_new_tokens: int = 0) -> Any: ...

    def overhead(self) -> Any: ...  # .members, .targeted_blocks, .total_blocks


def add_sve_opinion(
    ensemble: EnsembleLike,
    items: Sequence[Item],
    records: Sequence[ScoredItem],
    cache_path: str | os.PathLike[str] | None = None,
    *,
    max_new_tokens: int = QA_MAX_NEW_TOKENS,
    ensemble_id: str | None = None,
    progress: bool = True,
    desc: str = "SVE",
) -> list[ScoredItem]:
    """Add the SVE second opinion's features to every usable record that lacks them (one folded
    forward of the members each, plus their greedy answer when ``max_new_tokens > 0``), appending
    the updated lines to the cache.

    ``sve_mean_prob``, ``sve_variance``, ``sve_mi`` and, with ``max_new_tokens > 0``,
    ``sve_agree`` (1.0/0.0), over the very tokens the guard scored (the item's prompt, the
    recorded response and whether it ended its turn). Stored beside them: ``sve_members``,
    ``sve_targeted_blocks``, ``sve_total_blocks`` (what the cost in forward passes depends on),
    ``sve_answer_tokens``, ``sve_answer`` and ``sve_id``. A record is recomputed when its
    ``sve_id`` is not ``ensemble_id`` (members trained again; ``None`` takes any), or when a
    greedy answer is asked for with another token budget. Only for calibrators that ask for the
    opt-in SVE features; the cache's last line per item wins, so a re-run reuses what was computed.
    """
    from dataclasses import replace

    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    by_id = {it.id: it for it in items}
    cache = ScoreCache(cache_path) if cache_path is not None else None
    todo = [i for i, r in enumerate(records) if r.usable and _needs_sve(r.scores or {}, max_new_tokens, ensemble_id)]
    out = list(records)
    if not todo:
        return out
    shape = ensemble.overhead()
    about = {"sve_members": int(shape.members), "sve_targeted_blocks": int(shape.targeted_blocks),
             "sve_total_blocks": int(shape.total_blocks), "sve_answer_tokens": int(max_new_tokens),
             "sve_id": ensemble_id}
    for i in tqdm(todo, desc=desc, unit="item", file=sys.stderr, disable=not progress):
        rec = out[i]
        item = by_id.get(rec.id)
        if item is None or rec.response is None:
            continue
        ended = rec.ended if rec.ended is not None else not item.stop_strings  # as score_items had it
        try:
            op = ensemble.second_opinion(item.prompt, rec.response, ended=ended, max_new_tokens=max_new_tokens)
        except InputError as exc:
            log.warning("sve_not_scored", id=rec.id, error=str(exc))
            continue
        new_scores = {k: v for k, v in (rec.scores or {}).items() if not k.startswith(SVE_KEYS_PREFIX)}
        new_scores.update(about, sve_mean_prob=float(op.mean_prob), sve_variance=float(op.variance),
                          sve_mi=float(op.mutual_information))
        if max_new_tokens > 0:
            new_scores.update(sve_answer=op.answer, sve_agree=_agreement(op, rec.response, item.stop_strings))
        new = replace(rec, scores=new_scores)
        if cache is not None:
            cache.append(new)
        out[i] = new
    return out


def _needs_sve(scores: dict[str, Any], max_new_tokens: int, ensemble_id: str | None) -> bool:
    if "sve_mean_prob" not in scores:
        return True
    if ensemble_id is not None and scores.get("sve_id") != ensemble_id:
        return True
    return max_new_tokens > 0 and scores.get("sve_answer_tokens") != max_new_tokens


def _agreement(op: Any, response: str, stop_strings: Sequence[str]) -> float:
    """1.0/0.0: the members' greedy answer agrees with the response. A few-shot answer runs on
    past its stop string (the ensemble stops at end-of-turn only): both are cut there first, or
    the next made-up question would count towards agreement."""
    if not stop_strings or op.answer is None:
        return float(bool(op.agrees))
    from guarduq.answers import same_answer
    from guarduq.scoring.baselines import cut_at_stops

    return float(same_answer(cut_at_stops(op.answer, stop_strings), cut_at_stops(response, stop_strings)))
