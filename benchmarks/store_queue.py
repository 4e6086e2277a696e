"""How fast the review store answers the review page's queries on a realistic SQLite store.

    .venv/bin/python benchmarks/store_queue.py [--replies 10000] [--sampled 3000] [--labelled 1000]
                                               [--repeat 50] [--url sqlite:///path.db] [--json]

Fills a fresh store (a temporary SQLite file unless ``--url``) with ``--replies`` replies with
text, of which ``--sampled`` are review items (escalations, uniform and band draws) and
``--labelled`` carry labels (a fifth of those two labels), then times each read ``--repeat``
times and prints the median and the 95th percentile in milliseconds. Also times ``record`` (one
transaction, one fsync per reply) and ``add_label``. No assertions: the numbers are the output.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from guarduq.store import ReplyRecord, Sample, Store

T0 = datetime(2025, 1, 1, tzinfo=UTC)
UNIFORM = Sample(("uniform",), True, 0.3, 0.0, 0.3)
ESCALATION = Sample(("escalation",), False, 0.3, 1.0, 1.0)
BAND = Sample(("band",), False, 0.3, 0.5, 0.65)


def make_reply(i: int, rng: random.Random) -> ReplyRecord:
    risk = rng.random()
    action = "escalate" if risk > 0.9 else "abstain" if risk > 0.7 else "allow"
    words = " ".join(rng.choice(("the", "answer", "is", "Paris", "because", "of", "history")) for _ in range(60))
    return ReplyRecord(
        request_id=f"r{i:06d}", time=T0 + timedelta(seconds=i), model_fingerprint="f" * 32,
        policy="default@1.0", policy_sha256="a" * 64, calibrator_sha256="b" * 64, parameter_set="all",
        scores={"epistemic": rng.random() / 100, "aleatoric": rng.random() / 4, "mean_token_prob": 0.7,
                "n_tokens": 60, "valid": True, "reason": None},
        risk=risk, action=action, rule=action, shown=action == "allow", escalated=action == "escalate",
        prompt=f"Question number {i}?", response=words, tokens=words.split(), token_probs=[0.5] * 60,
    )


def fill(store: Store, n: int, sampled: int, labelled: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    picked = set(rng.sample(range(n), sampled))
    items: list[str] = []
    batch: list[tuple[ReplyRecord, Sample | None]] = []
    for i in range(n):
        r = make_reply(i, rng)
        sample = None
        if i in picked:
            sample = ESCALATION if r.escalated else rng.choice((UNIFORM, BAND))
            items.append(r.request_id)
        batch.append((r, sample))
        if len(batch) == 500:
            store.record_many(batch)
            batch = []
    store.record_many(batch)
    for k, rid in enumerate(rng.sample(items, labelled)):
        store.add_label(rid, reviewer="bench", label=rng.choice(("right", "wrong", "unsure")))
        if k % 5 == 0:
            store.add_label(rid, reviewer="second", label="right")
    return items


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    fn()  # warm
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return {"median_ms": statistics.median(times), "p95_ms": times[min(len(times) - 1, int(0.95 * len(times)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=10_000)
    ap.add_argument("--sampled", type=int, default=3_000)
    ap.add_argument("--labelled", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--url", default=None, help="an empty store (default: a temporary SQLite file)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'store.db'}"
        store = Store(url)
        t = time.perf_counter()
        items = fill(store, args.replies, args.sampled, args.labelled)
        fill_s = time.perf_counter() - t
        rng = random.Random(1)
        mid = items[len(items) // 2]
        n0 = args.replies
        counter = iter(range(10**9))
        results = {
            "queue()": timed(lambda: store.queue(), args.repeat),
            "queue(page 20)": timed(lambda: store.queue(offset=1000), args.repeat),
            "queue(reason=band, risk 0.4-0.6)": timed(
                lambda: store.queue(reason="band", risk_min=0.4, risk_max=0.6), args.repeat),
            "count()": timed(lambda: store.count(), args.repeat),
            "count(labelled=False)": timed(lambda: store.count(labelled=False), args.repeat),
            "item()": timed(lambda: store.item(rng.choice(items)), args.repeat),
            "next_unlabelled(after)": timed(lambda: store.next_unlabelled(mid), args.repeat),
            "progress()": timed(lambda: store.progress(), args.repeat),
            "labelled()": timed(lambda: store.labelled(), max(5, args.repeat // 10)),
            "record() (1 reply, 1 commit)": timed(
                lambda: store.record(make_reply(n0 + next(counter), rng), UNIFORM), args.repeat),
            "add_label()": timed(lambda: store.add_label(rng.choice(items), reviewer="b", label="right"),
                                 args.repeat),
        }
        store.close()
    meta = {"store": "sqlite (temporary file)" if args.url is None else args.url, "replies": args.replies,
            "sampled": args.sampled, "labelled": args.labelled, "fill_s": round(fill_s, 2)}
    if args.json:
        print(json.dumps({"setup": meta, "results": results}, indent=2))
        return
    print(f"{meta['store']}: {args.replies:,} replies, {args.sampled:,} items, {args.labelled:,} labelled "
          f"(filled in {fill_s:.1f} s)")
    print(f"{'call':<36} {'median ms':>10} {'p95 ms':>10}")
    for name, r in results.items():
        print(f"{name:<36} {r['median_ms']:>10.2f} {r['p95_ms']:>10.2f}")


if __name__ == "__main__":
    main()
