"""Serving benchmark: the guarduq server under concurrent load, against the Guard called directly.

1. Direct: the same Guard (policy + audit) answers the prompts one after another in this
   process: the throughput a server can at best reach on this machine.
2. Server, ``--batching off`` then ``on``: ``guarduq serve`` in a subprocess on a free loopback
   port, ``--clients`` threads each sending ``--requests`` chat completions over HTTP.
   Reports errors, p50/p95 latency, requests/s, and the ratio server / direct (goal >= 0.9).
   ``--batching on`` only changes anything when the Guard has ``generate_batch``.
3. Crash: the server is ``kill -9``-ed mid-load; every audit line must still be complete JSON,
   and a restarted server on the same port and log must answer again.

    python benchmarks/serve.py                       # 16 clients x 20 requests, max_tokens 16
    python benchmarks/serve.py --clients 4 --requests 5 --direct 8    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from _server import ServeProcess, free_port, percentile
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
PROMPTS = (
    "What is the capital of France?", "How many legs does a spider have?",
    "What is the boiling point of water at sea level in Celsius?", "Who wrote Hamlet?",
    "What happens if you swallow chewing gum?", "Do we only use 10% of our brains?",
    "What is the largest planet in the solar system?", "What colour is the sky on a clear day?",
    "How many days are in a leap year?", "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?", "What is the square root of 81?",
    "Which ocean is the largest?", "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?", "Who was the first person on the Moon?",
)


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


# --------------------------------------------------------------------------- direct


def direct(guard: Any, n: int, max_tokens: int, offset: int) -> dict[str, Any]:
    lat = []
    t0 = time.perf_counter()
    for i in tqdm(range(n), desc="direct Guard.generate", unit="req", file=sys.stderr):
        t = time.perf_counter()
        guard.generate(messages(offset + i), max_new_tokens=max_tokens)
        lat.append(time.perf_counter() - t)
    return {"lat": lat, "errors": [], "wall_s": time.perf_counter() - t0}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for r in rounds for x in r["lat"]]
    errors = [e for r in rounds for e in r["errors"]]
    wall = sum(r["wall_s"] for r in rounds)
    return {"n": len(lat), "errors": len(errors), "error_examples": errors[:3], "wall_s": round(wall, 2),
            "rps": len(lat) / wall if wall else 0.0,
            "p50_s": percentile(lat, 0.5) if lat else None, "p95_s": percentile(lat, 0.95) if lat else None,
            "p99_s": percentile(lat, 0.99) if lat else None}


# --------------------------------------------------------------------------- the server


class Server(ServeProcess):
    """``guarduq serve`` in a subprocess; ``model`` and ``extra`` flags (e.g. ``--store URL``) let
    other benchmarks (store_load.py) start the same server on another model or with a store."""

    def __init__(self, port: int, policy: Path, audit: Path, batching: str, log: Path, *,
                 model: str = MODEL, extra: Sequence[str] = ()) -> None:
        super().__init__(port, ["--model", model, "--policy", str(policy), "--audit", str(audit),
                                "--batching", batching, "--max-queue", "256", "--log-level", "warning", *extra], log)

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Seconds until the server was ready."""
        return self.ready(timeout)[0]


def load(url: str, clients: int, requests: int, max_tokens: int, stop_event: threading.Event | None = None,
         progress: bool = True, model: str = MODEL) -> dict[str, Any]:
    """``clients`` threads x ``requests`` chat completions: latencies, errors, wall time, and the
    request ids of the answered ones (``ids``, to find them in an audit log or a store)."""
    lat: list[float] = []
    errors: list[str] = []
    ids: list[str] = []
    lock = threading.Lock()
    bar = tqdm(total=clients * requests, desc="requests", unit="req", file=sys.stderr, disable=not progress)

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            for j in range(requests):
                if stop_event is not None and stop_event.is_set():
                    return
                body = {"model": model, "messages": messages(c * requests + j), "max_tokens": max_tokens}
                t = time.perf_counter()
                rid = None
                try:
                    r = http.post("/v1/chat/completions", json=body)
                    ok = r.status_code == 200 and "guarduq" in r.json()
                    err = None if ok else f"HTTP {r.status_code}: {r.text[:120]}"
                    rid = r.json()["guarduq"].get("request_id") if ok else None
                except httpx.HTTPError as exc:
                    err = f"{type(exc).__name__}"
                with lock:
                    if err is None:
                        lat.append(time.perf_counter() - t)
                        if rid is not None:
                            ids.append(rid)
                    else:
                        errors.append(err)
                bar.update()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    bar.close()
    return {"lat": lat, "errors": errors, "wall_s": wall, "ids": ids}


def mean_batch(metrics: str) -> float | None:
    """Requests per model call, from the server's own guarduq_batch_size histogram."""
    values = {}
    for line in metrics.splitlines():
        if line.startswith(("guarduq_batch_size_sum", "guarduq_batch_size_count")):
            name, value = line.split()
            values[name] = float(value)
    count = values.get("guarduq_batch_size_count")
    return values["guarduq_batch_size_sum"] / count if count else None


def audit_lines_ok(path: Path) -> tuple[int, int]:
    """(complete JSON lines, broken lines)."""
    raw = path.read_bytes() if path.exists() else b""
    good = bad = 0
    for line in raw.split(b"\n"):
        if not line:
            continue
        try:
            json.loads(line)
            good += 1
        except json.JSONDecodeError:
            bad += 1
    if raw and not raw.endswith(b"\n"):
        bad += 1 if good or bad else 0
    return good, bad


def crash_test(tmp: Path, policy: Path, clients: int, max_tokens: int, after: int) -> dict[str, Any]:
    audit, port = tmp / "crash-audit.jsonl", free_port()
    srv = Server(port, policy, audit, "on", tmp / "crash-server.log")
    srv.wait_ready()
    stop = threading.Event()
    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(
        load(srv.url, clients, 1000, max_tokens, stop_event=stop, progress=False)))
    runner.start()
    while audit_lines_ok(audit)[0] < after:  # mid-load: some answered, many in flight
        time.sleep(0.1)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()
    stop.set()
    runner.join()
    good, bad = audit_lines_ok(audit)
    srv.stop()
    again = Server(port, policy, audit, "on", tmp / "crash-server.log")
    ready_s = again.wait_ready()
    r = httpx.post(again.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": messages(0), "max_tokens": max_tokens})
    good2, bad2 = audit_lines_ok(audit)
    again.stop()
    return {"audit_lines_at_kill": good, "broken_lines_at_kill": bad,
            "client_errors_at_kill": len(result.get("errors", [])),
            "restart_ready_s": ready_s, "status_after_restart": r.status_code,
            "audit_lines_after": good2, "broken_lines_after": bad2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20, help="per client")
    ap.add_argument("--direct", type=int, default=64, help="requests for the direct baseline")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of direct/off/on")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--crash-after", type=int, default=8, help="kill -9 once this many are audited")
    ap.add_argument("--policy", type=Path, default=ROOT / "policies/default.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench/serve.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="guarduq-serve-bench-"))
    report: dict[str, Any] = {"clients": args.clients, "requests_per_client": args.requests,
                              "direct_requests": args.direct, "rounds": args.rounds,
                              "max_tokens": args.max_tokens, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    servers = {b: Server(free_port(), args.policy, tmp / f"audit-{b}.jsonl", b, tmp / f"server-{b}.log")
               for b in ("off", "on")}
    try:
        for srv in servers.values():
            srv.wait_ready()
            load(srv.url, 2, 1, args.max_tokens, progress=False)  # warm-up
        from guarduq import Guard

        guard = Guard(MODEL, policy=args.policy, audit=tmp / "direct-audit.jsonl")
        guard.generate(messages(0), max_new_tokens=args.max_tokens)  # warm-up
        # Rounds interleave the three set-ups, so a shared machine's load swings hit all alike.
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "off": [], "on": []}
        for r in range(args.rounds):
            runs["direct"].append(direct(guard, args.direct // args.rounds, args.max_tokens, r))
            for b, srv in servers.items():
                runs[b].append(load(srv.url, args.clients, args.requests // args.rounds, args.max_tokens))
        report["direct"] = summary(runs["direct"])
        for b, srv in servers.items():
            res = summary(runs[b])
            res["ratio_to_direct"] = res["rps"] / report["direct"]["rps"]
            res["mean_batch_size"] = mean_batch(httpx.get(srv.url + "/metrics").text)
            report[f"server_batching_{b}"] = res
    finally:
        for srv in servers.values():
            srv.stop()
    report["crash"] = crash_test(tmp, args.policy, args.clients, args.max_tokens, args.crash_after)
    report["guard_has_generate_batch"] = hasattr(Guard, "generate_batch")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    ok = all(report[k]["errors"] == 0 for k in ("server_batching_off", "server_batching_on"))
    ok &= report["crash"]["broken_lines_after"] == 0 and report["crash"]["status_after_restart"] == 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
