"""How fast the review page answers on a realistically full store.

    .venv/bin/python benchmarks/review_pages.py [--replies 10000] [--sampled 3000] [--labelled 1000]
                                                [--n 50] [--store URL] [--via server|testclient] [--json]

Fills a store (a fresh SQLite file by default; ``--store`` names another, e.g. an empty
PostgreSQL database) with ``--replies`` replies of which ``--sampled`` are review items (kept text:
a two-message prompt, a ~300-character answer with its token probabilities) and ``--labelled``
carry a label, then times ``--n`` requests per page through a real uvicorn server on loopback
(HTTP keep-alive, as a browser does) or, with ``--via testclient``, in-process:

- queue: the first page, unfiltered (unlabelled first, 50 rows);
- queue filtered: uniform items, risk 0.3-0.7, unlabelled only;
- queue deep: page 40 of the unfiltered queue;
- item: a random item page (conversation, shaded answer, scores, history);
- label: POST a label (CSRF-checked, committed) and follow nothing (the 303 is the answer);
- export: the whole JSONL export, timed once.

Prints median and p95 milliseconds per page; the goal is <= 100 ms for every page.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_MS = 100.0
WORDS = ("the", "river", "model", "answer", "capital", "because", "therefore", "probably", "maybe",
         "seven", "north", "paris", "energy", "protein", "ancient", "ocean", "signal", "theory",
         "market", "winter")


def fill(store: Any, n_replies: int, n_sampled: int, n_labelled: int, seed: int = 0) -> list[str]:
    """Replies, review items and labels; returns the sampled request ids."""
    from guarduq.store.records import ReplyRecord, Sample

    rng = random.Random(seed)
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    sampled = set(rng.sample(range(n_replies), n_sampled))
    pairs, ids = [], []
    for i in range(n_replies):
        keep = i in sampled
        toks = [(" " if j else "") + rng.choice(WORDS) for j in range(60)]
        probs = [round(rng.betavariate(5, 1.5), 4) for _ in toks]
        risk = round(rng.random(), 4)
        action = "allow" if risk < 0.5 else rng.choice(("abstain", "escalate"))
        reply = ReplyRecord(
            request_id=f"{i:032x}", time=t0 + timedelta(seconds=7 * i), model_fingerprint="f" * 64,
            policy="default@1.0", policy_sha256="a" * 64, calibrator_sha256="b" * 64, parameter_set="all",
            scores={"epistemic": rng.random() / 50, "aleatoric": 0.2, "mean_token_prob": sum(probs) / 60,
                    "min_token_prob": min(probs), "mean_logprob": -0.4, "mean_entropy": 1.1, "n_tokens": 60,
                    "valid": True, "reason": None, "parameter_set": "all"},
            risk=risk, action=action, rule="confident" if action == "allow" else "uncertain",
            shown=action == "allow", escalated=action == "escalate",
            prompt=[{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30)) + "?"}]
            if keep else None,
            response="".join(toks) if keep else None, tokens=toks if keep else None,
            token_probs=probs if keep else None)
        sample = None
        if keep:
            if action == "escalate":
                sample = Sample(("escalation",), False, 0.3, 1.0, 1.0)
            else:
                sample = Sample(("uniform",), True, 0.3, 0.0, 0.3)
            ids.append(reply.request_id)
        pairs.append((reply, sample))
    for start in range(0, len(pairs), 1000):
        store.record_many(pairs[start:start + 1000])
    for rid in rng.sample(ids, n_labelled):
        store.add_label(rid, reviewer="bench", label=rng.choice(("right", "right", "wrong", "unsure")))
    return ids


@contextmanager
def _server(app: Any) -> Iterator[str]:
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        access_log=False))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def _time(fn: Callable[[int], Any], n: int) -> list[float]:
    fn(-1)  # warm: templates compiled, connections open
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replies", type=int, default=10_000)
    ap.add_argument("--sampled", type=int, default=3_000)
    ap.add_argument("--labelled", type=int, default=1_000)
    ap.add_argument("--n", type=int, default=50, help="requests per page")
    ap.add_argument("--store", help="store URL (default: a fresh SQLite file in a temporary folder)")
    ap.add_argument("--via", choices=("server", "testclient"), default="server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import httpx
    from fastapi.testclient import TestClient

    from guarduq.review import ReviewPageSettings, create_review_app
    from guarduq.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(args.store or f"sqlite:///{Path(tmp) / 'bench.db'}")
        t = time.perf_counter()
        ids = fill(store, args.replies, args.sampled, args.labelled)
        fill_s = time.perf_counter() - t
        app = create_review_app(store, ReviewPageSettings(alpha=0.3))
        rng = random.Random(1)
        with (_server(app) if args.via == "server" else _nullctx("")) as url:
            client: Any = httpx.Client(base_url=url) if url else TestClient(app, client=("127.0.0.1", 1))
            with client:
                client.get("/")
                token = client.cookies.get("guarduq_review_csrf")
                unlabelled = [r.request_id for r in store.queue(labelled=False, limit=args.n + 1)]

                def ok(r: Any) -> None:
                    if r.status_code not in (200, 303):
                        raise RuntimeError(f"{r.request.url}: {r.status_code} {r.text[:200]}")

                pages: dict[str, Callable[[int], Any]] = {
                    "queue": lambda i: ok(client.get("/")),
                    "queue filtered": lambda i: ok(client.get(
                        "/?reason=uniform&risk_min=0.3&risk_max=0.7&labelled=false")),
                    "queue deep (page 40)": lambda i: ok(client.get("/?page=40")),
                    "item": lambda i: ok(client.get(f"/items/{rng.choice(ids)}")),
                    "label (POST)": lambda i: ok(client.post(
                        f"/items/{unlabelled[i + 1]}/label",
                        data={"label": "right", "csrf": token}, follow_redirects=False)),
                }
                results = {name: _time(fn, args.n) for name, fn in pages.items()}
                t = time.perf_counter()
                exported = client.get("/export.jsonl?include_chat=true")
                export_ms = (time.perf_counter() - t) * 1000
        store.close()

    rows = {name: {"median_ms": statistics.median(v), "p95_ms": _p95(v), "max_ms": max(v)}
            for name, v in results.items()}
    summary = {"replies": args.replies, "sampled": args.sampled, "labelled": args.labelled, "n": args.n,
               "via": args.via, "store": "sqlite (temporary file)" if not args.store else "given",
               "fill_s": round(fill_s, 1), "pages": rows,
               "export": {"ms": export_ms, "rows": int(exported.headers.get("x-guarduq-rows", 0))},
               "goal_ms": GOAL_MS, "all_within_goal": all(r["p95_ms"] <= GOAL_MS for r in rows.values())}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"store: {args.replies:,} replies, {args.sampled:,} review items, {args.labelled:,} labelled "
          f"(filled in {fill_s:.1f} s); {args.n} requests per page via {args.via}")
    print(f"{'page':<22} {'median ms':>10} {'p95 ms':>8} {'max ms':>8}")
    for name, r in rows.items():
        flag = "" if r["p95_ms"] <= GOAL_MS else f"  over the {GOAL_MS:.0f} ms goal"
        print(f"{name:<22} {r['median_ms']:>10.1f} {r['p95_ms']:>8.1f} {r['max_ms']:>8.1f}{flag}")
    print(f"export (all labelled, once): {export_ms:.0f} ms for {summary['export']['rows']:,} lines")
    return 0


def _p95(v: list[float]) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


@contextmanager
def _nullctx(value: str) -> Iterator[str]:
    yield value


if __name__ == "__main__":
    sys.exit(main())
