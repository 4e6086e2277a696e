"""Load with the store on: ``guarduq serve --store`` (SQLite, PostgreSQL) with review sampling, against no store.

The issue item: with the store on and 10% review sampling, 16 clients x 20 requests fail nothing
and keep at least 0.95x the throughput of the same run without a store. Three ``guarduq serve``
subprocesses (``benchmarks/serve.py``'s ``Server``), the same policy (``policies/review.yaml``:
a uniform 10% plus half of the risk band 0.6-0.9, sampled replies keep their text), the same
audit log, batching on:

- ``none``: no store;
- ``sqlite``: ``--store sqlite:///<tmp>/store.db`` (WAL, ``synchronous=FULL``);
- ``postgresql``: ``--store postgresql://...`` on a throwaway local PostgreSQL with its default
  durability (fsync on), started by ``tests/pg_server.py``.

Rounds interleave the three (their order rotating), so a shared machine's load swings hit all
alike. Reports per configuration errors, requests/s, p50/p95/p99 latency and the ratio
store / no store (goal >= 0.95); then checks each store: every answered reply recorded, review
items against the number the sampler's probabilities predict, every sampled item with its text
and no other reply with text; and times ``Store.record`` alone on each database.

    python benchmarks/store_load.py --quick    # a tiny random model, seconds (tests/unit/test_store_load_bench.py)
    OMP_NUM_THREADS=2 python benchmarks/store_load.py   # SmolLM2 -> docs/results/store_load.md
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from sqlalchemy.engine import make_url
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]  # serve.py / reload.py beside this file; tests.pg_server

from _pages import rerun_command, write_json, write_whole_page  # noqa: E402
from _server import free_port, percentile  # noqa: E402
from reload import _relative, files_quick  # noqa: E402
from serve import MODEL, Server, load, mean_batch, summary  # noqa: E402

from tests.pg_server import temporary_postgres, unavailable  # noqa: E402

CONFIGS = ("none", "sqlite", "postgresql")
GOAL = 0.95
QUIET = 0.10  # a round is "quiet" when the rest of the machine used under 10% of its cores in every phase


# --------------------------------------------------------------------------- set-up


def quick_files(tmp: Path) -> tuple[str, Path]:
    """reload.py's tiny random Llama and its calibrator, with an allow-all policy that samples for
    review exactly as policies/review.yaml does (its ``review`` section, copied)."""
    model, _, cal, _ = files_quick(tmp)
    review = yaml.safe_load((ROOT / "policies/review.yaml").read_text())["review"]
    policy = tmp / "review-quick.yaml"
    policy.write_text(yaml.safe_dump({
        "name": "review-quick", "version": "1", "calibrator": str(cal), "review": review,
        "rules": [{"name": "ok", "when": {"risk": {"le": 1}}, "action": "allow"}],
    }, sort_keys=False))
    return model, policy


def pg_version(url: str) -> str:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as c:
        row = c.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def sampler_of(policy: Path) -> Any:
    from guarduq.policy import Policy
    from guarduq.store import ReviewSampler

    return ReviewSampler.from_settings(Policy.from_yaml(policy).config.review)


# --------------------------------------------------------------------------- the machine's other load


def _cpu_ticks(pid: int, children: bool = True) -> int:
    """utime + stime (+ reaped children's) of ``pid`` in clock ticks; 0 once it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return sum(int(x) for x in f[11:15 if children else 13])  # utime stime cutime cstime


def _postgres_ticks(port: int | None) -> int:
    """Our PostgreSQL: the postmaster started with ``-p port`` (its reaped children included)
    and its live children (the backends serving our stores)."""
    if port is None:
        return 0
    master, ticks = None, 0
    procs = [d for d in os.listdir("/proc") if d.isdigit()]
    for d in procs:
        with contextlib.suppress(OSError):
            if f"\0-p\0{port}\0".encode() in Path(f"/proc/{d}/cmdline").read_bytes().replace(b" ", b"\0"):
                master = int(d)
    if master is None:
        return 0
    for d in procs:
        with contextlib.suppress(OSError, IndexError):
            if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == master:
                ticks += _cpu_ticks(int(d), children=False)
    return ticks + _cpu_ticks(master)


class OtherLoad:
    """CPU time the rest of the machine used during a phase, as a share of all its cores: what
    tells a round that shared the cores with someone else's job (the benchmark's own process,
    its servers and its PostgreSQL excluded)."""

    def __init__(self, pids: list[int], pg_port: int | None) -> None:
        self.pids, self.pg_port = pids, pg_port
        self.tck, self.cpus = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1

    def _now(self) -> tuple[int, int, float]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(f) - f[3] - f[4]  # all but idle and iowait
        ours = sum(_cpu_ticks(p) for p in self.pids) + _postgres_ticks(self.pg_port)
        return busy, ours, time.perf_counter()

    def __enter__(self) -> OtherLoad:
        self._start = self._now() if Path("/proc/stat").exists() else None
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = None
        if self._start is not None:
            busy, ours, t = self._now()
            other = max(0, (busy - self._start[0]) - (ours - self._start[1])) / self.tck
            self.share = other / ((t - self._start[2]) * self.cpus)


# --------------------------------------------------------------------------- store checks


def check_store(url: str, answered: list[str], sampler: Any) -> tuple[dict[str, Any], list[Any]]:
    """What the store holds after the run, against what the server answered; also the replies
    (for ``time_record``)."""
    from guarduq.store import Store, inclusion_probability

    with Store(url) as store:
        progress = store.progress()
        replies = []
        for rid in tqdm(answered, desc="store check", unit="reply", file=sys.stderr, leave=False):
            r = store.reply(rid)
            if r is not None:
                replies.append(r)
        items = store.queue(unlabelled_first=False, limit=10_000)
        item_ids = {q.request_id for q in items}
        full = [store.item(i) for i in item_ids]
    p = [inclusion_probability(sampler.rate, sampler.extra_probability(r.risk, r.escalated)) for r in replies]
    n = len(replies)
    in_band = sum(sampler.extra_probability(r.risk, False) > 0 for r in replies)
    by_reason = progress["by_reason"]
    uniform_sd = math.sqrt(n * sampler.rate * (1 - sampler.rate))
    expected, sd = sum(p), math.sqrt(sum(x * (1 - x) for x in p))
    out = {
        "answered": len(answered), "answered_unique": len(set(answered)), "recorded": progress["replies"],
        "answered_found": n, "every_reply_recorded": n == len(set(answered)) == progress["replies"],
        "items": progress["items"], "items_expected": expected, "items_sd": sd,
        "items_z": (progress["items"] - expected) / sd if sd else 0.0,
        "by_reason": by_reason, "uniform_expected": n * sampler.rate, "uniform_sd": uniform_sd,
        "replies_in_band": int(in_band),
        "items_without_text": sum(1 for it in full
                                  if it is None or it.reply.prompt is None or it.reply.response is None),
        # a blank reply has no token pieces (it is still recorded with its text); any other
        # sampled item should have them, for the review page's shading by probability
        "items_without_pieces": sum(1 for it in full if it is not None and not it.reply.tokens),
        "unsampled_with_text": sum(1 for r in replies if r.request_id not in item_ids
                                   and (r.prompt is not None or r.response is not None)),
    }
    out["ok"] = (out["every_reply_recorded"] and out["items_without_text"] == 0 and out["unsampled_with_text"] == 0
                 and abs(out["items_z"]) <= 4)
    return out, replies


def time_record(url: str, replies: list[Any], sampler: Any, n: int) -> dict[str, Any]:
    """``Store.record`` alone, ``n`` times, in this process, with the run's own replies as the
    templates (new ids): what one reply costs the engine thread on this database."""
    from guarduq.store import Store

    lat = []
    with Store(url) as store:
        for i, r in zip(range(n), itertools.cycle(replies), strict=False):
            rec = replace(r, request_id=f"timing-{i}-{uuid.uuid4().hex[:8]}", time=datetime.now(UTC))
            sample = sampler.draw(rec.risk, rec.escalated)
            t = time.perf_counter()
            store.record(rec, sample)
            lat.append(time.perf_counter() - t)
    if not lat:  # no reply recorded: nothing to copy (the store check says so)
        return {"n": 0, "median_ms": math.nan, "p95_ms": math.nan, "max_ms": math.nan}
    return {"n": len(lat), "median_ms": 1e3 * statistics.median(lat), "p95_ms": 1e3 * percentile(lat, 0.95),
            "max_ms": 1e3 * max(lat)}


# --------------------------------------------------------------------------- report


def commit() -> dict[str, Any]:
    """The code measured: HEAD and whether the working tree differed from it."""
    import subprocess

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": git("rev-parse", "--short", "HEAD") or None,
            "tree_modified": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine() -> dict[str, Any]:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return {"machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({cpu}), {gpu}",
            "cpus": os.cpu_count(), "torch": torch.__version__}


def table(report: dict[str, Any]) -> str:
    rows = ["| configuration | requests | errors | requests/s | p50 | p95 | p99 | × no store | mean batch |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in report["configs"]:
        s = report[name]
        ratio = "1.00" if name == "none" else f"**{s['ratio_to_none']:.3f}**"
        mb = f"{s['mean_batch_size']:.1f}" if s.get("mean_batch_size") else "-"
        rows.append(f"| {LABELS[name]} | {s['n']} | {s['errors']} | {s['rps']:.2f} | {s['p50_s']:.2f} s "
                    f"| {s['p95_s']:.2f} s | {s['p99_s']:.2f} s | {ratio} | {mb} |")
    return "\n".join(rows)


LABELS = {"none": "no store", "sqlite": "`--store sqlite:///…/store.db`", "postgresql": "`--store postgresql://…`"}


def store_table(report: dict[str, Any]) -> str:
    rows = ["| store | answered | recorded | review items (expected ± sd) | uniform (expected ± sd) | band | "
            "items without text (without token pieces) | other replies with text | `Store.record` median / p95 (n) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in report["configs"]:
        if name == "none":
            continue
        c, t = report[name]["store"], report[name]["record_timing"]
        rows.append(
            f"| {name} | {c['answered']} | {c['recorded']} | {c['items']} ({c['items_expected']:.1f} ± "
            f"{c['items_sd']:.1f}) | {c['by_reason']['uniform']} ({c['uniform_expected']:.1f} ± {c['uniform_sd']:.1f}) "
            f"| {c['by_reason']['band']} of {c['replies_in_band']} in band | {c['items_without_text']} ({c.get('items_without_pieces', '-')}) "
            f"| {c['unsampled_with_text']} | {t['median_ms']:.2f} / {t['p95_ms']:.2f} ms ({t['n']}) |")
    return "\n".join(rows)


def quiet_ratios(report: dict[str, Any]) -> dict[str, Any]:
    """The ratios over the quiet rounds only (``QUIET``), pooled as requests / wall time: what
    the store costs where no one else's job shared the cores. Shown beside the all-rounds ratio,
    never instead of it."""
    configs = report["configs"]
    quiet = [r for r in range(report["rounds"])
             if all((x := report[c]["other_cpu_share_per_round"][r]) is not None and x < QUIET for c in configs)]
    if not quiet:
        return {"quiet_rounds": [], "quiet_ratio_to_none": {}}
    rps = {}
    for c in configs:
        n = report[c].get("n_per_round") or [report[c]["n"] / report["rounds"]] * report["rounds"]
        rps[c] = sum(n[r] for r in quiet) / sum(n[r] / report[c]["rps_per_round"][r] for r in quiet)
    return {"quiet_rounds": [r + 1 for r in quiet],
            "quiet_ratio_to_none": {c: rps[c] / rps["none"] for c in configs if c != "none"}}


def round_table(report: dict[str, Any]) -> str:
    configs = report["configs"]
    rows = ["| round | order | " + " | ".join(LABELS[c] for c in configs) + " |",
            "|---:|---|" + "---:|" * len(configs)]
    for r in range(report["rounds"]):
        cells = []
        for c in configs:
            share = report[c]["other_cpu_share_per_round"][r]
            cells.append(f"{report[c]['rps_per_round'][r]:.2f} ({'-' if share is None else f'{share:.0%}'})")
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        rows.append(f"| {r + 1} | {', '.join(order)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def page(report: dict[str, Any], command: str) -> str:
    stores = [c for c in report["configs"] if c != "none"]
    none = report["none"]
    per_reply_ms = 1e3 / none["rps"]
    ratios = ", ".join(f"{c} {report[c]['ratio_to_none']:.3f}" for c in stores)
    rec = "; ".join(f"{c} {report[c]['record_timing']['median_ms']:.1f} ms" for c in stores)
    share = ", ".join(f"{c} {100 * report[c]['record_timing']['median_ms'] / per_reply_ms:.2f}%" for c in stores)
    met = all(report[c]["ratio_to_none"] >= GOAL for c in stores)
    q = report.get("quiet_ratio_to_none") or {}
    quiet = (f"**In the quiet rounds ({', '.join(map(str, report['quiet_rounds']))}: the rest of the machine under "
             f"{QUIET:.0%} of the cores in every phase): {', '.join(f'{c} {x:.3f}' for c, x in q.items())}** "
             f"(goal: {'met' if all(x >= GOAL for x in q.values()) else 'NOT met'})." if q else
             f"No round was quiet (the rest of the machine under {QUIET:.0%} of the cores in every phase).")
    spread = _spread(report, stores)
    held = ("**Nothing lost, nothing extra.** Every answered request is a row in each store, the review "
            "sample is within 4 sd of what the sampler's probabilities predict, every sampled item has its "
            "text for the reviewers, and no other reply kept any."
            if all(report[c]["store"]["ok"] for c in stores) else
            "**A store check failed**: see the table above and the raw figures.")
    c0 = report[stores[0]]["store"]
    sample_size = (
        f"**The review sample is {c0['items'] / c0['recorded']:.0%} of replies:** the uniform draw "
        f"({c0['by_reason']['uniform'] / c0['recorded']:.0%}, the part a certificate rests on) plus the band, "
        f"which held {c0['replies_in_band'] / c0['recorded']:.0%} of these replies' risks with the shipped "
        "calibrator. Sampled replies keep their prompt, reply and token pieces, so the throughput above "
        "includes those heavier writes.") if c0["recorded"] else ""
    skipped = f"\n\nPostgreSQL was not run: {report['postgresql_skipped']}." if report.get("postgresql_skipped") else ""
    return f"""# Serving with the store on: throughput and what the store holds

The issue item: `benchmarks/serve.py`'s load with the store on (SQLite and PostgreSQL) and 10%
review sampling, {report['clients']} clients x {report['requests_per_client']} requests, fails
nothing and keeps at least {GOAL}x the throughput of the same run without a store. One run of
`benchmarks/store_load.py` (commit {report.get('commit') or '?'}{' + uncommitted changes' if report.get('tree_modified') else ''}) on {report['machine']}, torch {report['torch']}, {report['model']}
(fp32), `{report['policy']}` (a uniform {report['review']['rate']:.0%} of replies plus
{report['review']['bands']}; sampled replies keep their text), an audit log in every
configuration, batching on (the default):

```sh
{command}
```

Three `guarduq serve` subprocesses run side by side: no store, `--store sqlite:///…` (WAL,
`synchronous=FULL`: one fsync per commit) and `--store postgresql://…` on a throwaway local
PostgreSQL {report.get('postgresql_version', '')} with its default durability (fsync on), on the same
{report['cpus']} cores. Each round loads each server in turn ({report['clients']} loopback clients,
{report['requests_per_round']} requests each, max_tokens {report['max_tokens']}), the order rotating
between rounds. Rounds: {report['rounds']}.

{table(report)}

**Throughput with the store / without, all rounds: {ratios}** (goal ≥ {GOAL}: {'met' if met else 'NOT met'}).
{quiet}
Errors: {', '.join(f"{c} {report[c]['errors']}" for c in report['configs'])}.{skipped}

Per round, requests/s and (in brackets) the CPU time the rest of the machine used meanwhile, as a
share of its {report['cpus']} cores (other engineers' jobs; this benchmark's own processes and its
PostgreSQL are not counted):

{round_table(report)}

## What the stores hold after the run

{store_table(report)}

"answered" counts the requests the server answered, warm-up included; "recorded" the replies in
the store. The expected number of review items is Σ P(picked) over the recorded replies, from the
sampler's own probabilities (1 − (1 − rate)(1 − band rate) in the band, the rate elsewhere); the
uniform draw alone expects rate × n. A sampled item must hold its prompt and reply text; a reply
that was not sampled must hold none (`keep_text` covers sampled replies only).
`Store.record` was timed afterwards in the benchmark process, {report['record_timing_n']} calls per
database with the run's own replies as templates.

## Reading

* **Where the time goes.** One `record` per reply costs {rec} (median), on the store's writer
  thread beside the engine: the engine thread only draws the review sample and, for a sampled
  reply, decodes its token pieces, then queues the write. A reply costs the engine about
  {per_reply_ms:.0f} ms of generation and scoring (1 / {none['rps']:.2f} requests/s with batching), so the
  store adds about {share} of the work per reply. {spread}
* {held}
* {sample_size}
* The latencies are queueing ({report['clients']} clients share one model on {report['cpus']} cores), as in
  [serve.md](serve.md); compare the ratio, measured within one run, not the absolute figures.

Raw figures: `{_relative(report['out'])}`.
"""


def _spread(report: dict[str, Any], stores: list[str]) -> str:
    """The ratios' distance from 1 beside the rounds' own spread: how much of it is noise."""
    rounds = report["none"]["rps_per_round"]
    if len(rounds) < 2:
        return "One round only: no spread between rounds to compare the ratios with."
    spread = (max(rounds) - min(rounds)) / statistics.mean(rounds)
    off = max(abs(1 - report[c]["ratio_to_none"]) for c in stores)
    return (f"The ratios are at most {off:.1%} from 1; the no-store server's own throughput moved by "
            f"{spread:.1%} between its rounds: a difference of that size is run-to-run noise, not the store.")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny random model, small load (make test)")
    ap.add_argument("--clients", type=int, help="concurrent clients (default 16; --quick 8)")
    ap.add_argument("--requests", type=int, help="per client, split over the rounds (default 20; --quick 8)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of the configurations (default 2; --quick 1)")
    ap.add_argument("--max-tokens", type=int, help="default 16; --quick 4")
    ap.add_argument("--policy", type=Path, help="default policies/review.yaml (--quick: the same review on a tiny model)")
    ap.add_argument("--no-postgres", action="store_true", help="run no store and SQLite only")
    ap.add_argument("--record-timing", type=int, default=200, help="Store.record calls timed per database")
    ap.add_argument("--out", type=Path, help="JSON report (default runs/bench/store_load[-quick].json)")
    ap.add_argument("--page", type=Path, help="results page (default docs/results/store_load.md; --quick: none)")
    args = ap.parse_args(argv)
    q = args.quick
    clients, requests = args.clients or (8 if q else 16), args.requests or (8 if q else 20)
    rounds, max_tokens = args.rounds or (1 if q else 2), args.max_tokens or (4 if q else 16)
    out = args.out or ROOT / f"runs/bench/store_load{'-quick' if q else ''}.json"
    page_path = args.page or (None if q else ROOT / "docs/results/store_load.md")
    per_round = max(1, requests // rounds)
    tmp = Path(tempfile.mkdtemp(prefix="guarduq-store-load-"))
    if q:
        model, policy = quick_files(tmp)
    else:
        model, policy = MODEL, args.policy or ROOT / "policies/review.yaml"
    sampler = sampler_of(policy)
    report: dict[str, Any] = {
        "model": "tiny random Llama (--quick)" if q else "SmolLM2-135M-Instruct", "clients": clients,
        "requests_per_client": per_round * rounds, "requests_per_round": per_round, "rounds": rounds,
        "max_tokens": max_tokens, "policy": _relative(str(policy)),
        "review": {"rate": sampler.rate, "bands": ", ".join(f"{r:.0%} of the replies with risk in [{lo}, {hi}]"
                                                    for lo, hi, r in sampler.bands)},
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "out": str(out), **machine(), **commit(),
    }
    skip = "--no-postgres" if args.no_postgres else unavailable()
    configs = [c for c in CONFIGS if not (c == "postgresql" and skip)]
    if skip:
        report["postgresql_skipped"] = skip
        print(f"store_load: PostgreSQL skipped ({skip})", file=sys.stderr)
    report["configs"] = configs
    with contextlib.ExitStack() as stack:
        urls: dict[str, str | None] = {"none": None, "sqlite": f"sqlite:///{tmp / 'store.db'}"}
        pg_port: int | None = None
        if "postgresql" in configs:
            urls["postgresql"] = stack.enter_context(temporary_postgres("guarduq_bench", durable=True))
            report["postgresql_version"] = pg_version(urls["postgresql"])
            pg_port = make_url(urls["postgresql"]).port
        servers = {c: Server(free_port(), policy, tmp / f"audit-{c}.jsonl", "on", tmp / f"server-{c}.log",
                             model=model, extra=["--store", urls[c]] if urls[c] else [])
                   for c in configs}
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        answered: dict[str, list[str]] = {c: [] for c in configs}
        try:
            for c, srv in servers.items():
                srv.wait_ready(timeout=300)
                answered[c] += load(srv.url, 2, 1, max_tokens, progress=False, model=model)["ids"]  # warm-up
            for r in range(rounds):  # the order rotates, so no configuration always goes first
                for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                    print(f"store_load: round {r + 1}/{rounds}, {c}", file=sys.stderr)
                    with OtherLoad([os.getpid(), *(v.proc.pid for v in servers.values())], pg_port) as other:
                        res = load(servers[c].url, clients, per_round, max_tokens, model=model)
                    res["other_cpu_share"] = other.share
                    runs[c].append(res)
                    answered[c] += res["ids"]
            batches = {c: mean_batch(httpx.get(srv.url + "/metrics").text) for c, srv in servers.items()}
        finally:
            for srv in servers.values():
                srv.stop()
        for c in configs:
            s = summary(runs[c])
            s["rps_per_round"] = [len(x["lat"]) / x["wall_s"] for x in runs[c]]
            s["n_per_round"] = [len(x["lat"]) for x in runs[c]]
            s["other_cpu_share_per_round"] = [x["other_cpu_share"] for x in runs[c]]
            s["mean_batch_size"] = batches[c]
            report[c] = s
        for c in configs:
            report[c]["ratio_to_none"] = report[c]["rps"] / report["none"]["rps"]
            if urls[c] is not None:
                report[c]["store"], replies = check_store(urls[c], answered[c], sampler)
                report[c]["record_timing"] = time_record(urls[c], replies, sampler, args.record_timing)
        report["record_timing_n"] = args.record_timing
    stores = [c for c in configs if c != "none"]
    report["goal_met"] = all(report[c]["ratio_to_none"] >= GOAL for c in stores)
    report |= quiet_ratios(report)
    write_json(out, report)
    print(table(report))
    print()
    print(store_table(report))
    for c in stores:
        print(f"throughput {c} / no store = {report[c]['ratio_to_none']:.3f} (goal >= {GOAL})")
    for c, x in report["quiet_ratio_to_none"].items():
        print(f"throughput {c} / no store in the quiet rounds {report['quiet_rounds']} = {x:.3f}")
    if page_path is not None:
        write_whole_page(page_path, page(report, rerun_command("store_load.py", argv, report["OMP_NUM_THREADS"])))
    ok = all(report[c]["errors"] == 0 for c in configs) and all(report[c]["store"]["ok"] for c in stores)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
