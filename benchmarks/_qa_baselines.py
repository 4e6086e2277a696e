"""benchmarks/qa.py's baseline pass: P(True), sampling consistency and one timed greedy answer
per scored item, on the very (prompt, response) pair guarduq scored, in an append-only, fsynced
JSONL cache (a killed run resumes where it stopped)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from guarduq import Guard, layout
from guarduq.calibration.datasets import Item
from guarduq.calibration.evaluation import QA_MAX_NEW_TOKENS, ScoredItem
from guarduq.scoring.baselines import Consistency, PTrue, cut_at_stops


@dataclass(frozen=True)
class BaselineRow:
    id: str
    prompt_hash: str
    model_fingerprint: str
    k: int
    p_true: float | None
    consistency: float | None
    greedy_s: float
    p_true_s: float
    consistency_s: float | None
    samples: list[str]
    response_sha: str | None = None  # the scored response these baselines judged (None: old rows)


def response_sha(response: str | None) -> str:
    return hashlib.sha256((response or "").encode()).hexdigest()[:16]


def greedy_seconds(guard: Guard, item: Item, max_new_tokens: int) -> float:
    """Time of one plain greedy generation (no scoring): the unit every cost is divided by.

    Guard's own generation settings and call, minus the scoring that ``Guard.generate`` adds.
    """
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if item.stop_strings:
        kwargs.update(stop_strings=list(item.stop_strings), tokenizer=guard.tokenizer)
    ids = layout.prompt_ids(guard.tokenizer, item.prompt)
    gen = guard._generation_settings(kwargs)
    t0 = time.perf_counter()
    guard._run_generate(ids, gen)
    return time.perf_counter() - t0


def baseline_row(guard: Guard, item: Item, rec: ScoredItem, k: int, max_new_tokens: int) -> BaselineRow:
    assert rec.response is not None
    t0 = time.perf_counter()
    p_true = PTrue().score(guard, item.prompt, cut_at_stops(rec.response, item.stop_strings) or
                           rec.response, question=item.question)
    p_true_s = time.perf_counter() - t0
    consistency = consistency_s = None
    samples: list[str] = []
    if item.kind == "qa":
        c = Consistency(k=k, max_new_tokens=max_new_tokens, stop=item.stop_strings, seed=0)
        t0 = time.perf_counter()
        consistency = c.score(guard, item.prompt, rec.response)
        consistency_s = time.perf_counter() - t0
        samples = c.samples_
    return BaselineRow(
        id=item.id, prompt_hash=item.prompt_hash, model_fingerprint=guard.info.fingerprint, k=k,
        p_true=p_true, consistency=consistency, greedy_s=greedy_seconds(guard, item, max_new_tokens),
        p_true_s=p_true_s, consistency_s=consistency_s, samples=samples,
        response_sha=response_sha(rec.response),
    )


def read_baselines(path: Path, k: int, fingerprint: str | None) -> dict[str, BaselineRow]:
    """Rows of the append-only cache for this K (and model, when given), keyed by id + prompt hash."""
    done: dict[str, BaselineRow] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = BaselineRow(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue  # a torn last line from an interrupted run
            if row.k == k and fingerprint in (None, row.model_fingerprint):
                done[row.id + row.prompt_hash] = row
    return done


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line left without its newline by a killed run, so the next row starts clean."""
    if path.exists() and (raw := path.read_bytes()) and not raw.endswith(b"\n"):
        with path.open("r+b") as fh:
            fh.truncate(raw.rfind(b"\n") + 1)


def run_baselines(
    guard: Guard, items: list[Item], records: list[ScoredItem], path: Path, k: int, desc: str
) -> dict[str, BaselineRow]:
    """Append-only, fsynced cache keyed by (id, prompt hash, fingerprint, k)."""
    done = read_baselines(path, k, guard.info.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    _cut_torn_tail(path)
    todo = [(it, r) for it, r in zip(items, records, strict=True)
            if r.usable and it.id + it.prompt_hash not in done]
    with path.open("a") as fh:
        for item, rec in tqdm(todo, desc=desc, file=sys.stderr, unit="item"):
            row = baseline_row(guard, item, rec, k, QA_MAX_NEW_TOKENS)
            fh.write(json.dumps(row.__dict__, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            done[item.id + item.prompt_hash] = row
    return done
