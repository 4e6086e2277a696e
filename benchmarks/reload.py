"""Hot reload under load: tail latency while the policy/calibrator pair is swapped, against steady.

``guarduq serve`` runs in a subprocess with an admin key; ``--clients`` threads send chat
completions. Rounds alternate a steady phase and a reload phase: the same load, plus a
``POST /admin/reload`` every ``--reload-every`` seconds, each after replacing the calibrator file
with the other of two versions (different sha256, same numbers), so every reload swaps the pair.
Reports errors, p50/p99/max latency per phase, the reloads done and how long each took, whether
every reply named a calibrator that was in force, and the ratio p99 during reload / steady p99
(goal <= 1.5), all measured in one run.

    python benchmarks/reload.py --quick    # a tiny random model, seconds (tests/unit/test_reload_bench.py)
    python benchmarks/reload.py            # SmolLM2-135M-Instruct, policies/default.yaml -> docs/results/reload.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _pages import rerun_command, write_json, write_whole_page
from _server import ServeProcess, free_port, percentile

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
ADMIN_ENV, ADMIN_KEY = "GUARDUQ_BENCH_ADMIN_KEY", "bench-admin-key-0123456789"
PROMPTS = (
    "What is the capital of France?", "How many legs does a spider have?", "Who wrote Hamlet?",
    "What is the largest planet in the solar system?", "How many days are in a leap year?",
    "What is the chemical symbol for gold?", "Which ocean is the largest?", "Who painted the Mona Lisa?",
)


# --------------------------------------------------------------------------- set-up


def files_full(tmp: Path) -> tuple[str, Path, Path, list[bytes]]:
    """The shipped default policy and calibrator, copied so the benchmark may rewrite them."""
    cal = tmp / "calibrator.json"
    shutil.copy(ROOT / "policies/calibrators/smollm2-135m-instruct.json", cal)
    policy = tmp / "policy.yaml"
    text = (ROOT / "policies/default.yaml").read_text()
    policy.write_text(text.replace("calibrator: calibrators/smollm2-135m-instruct.json", f"calibrator: {cal}"))
    return MODEL, policy, cal, _versions(cal)


def files_quick(tmp: Path) -> tuple[str, Path, Path, list[bytes]]:
    """A tiny random Llama saved as an HF folder, a calibrator fitted for it, an allow-all policy."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from guarduq.calibration import Calibrator
    from guarduq.models import load_model
    from tests.conftest import make_tokenizer, tiny_llama

    folder = tmp / "tiny-model"
    tiny_llama(seed=0).save_pretrained(folder)
    make_tokenizer(chat_template=True).save_pretrained(folder)
    fp = load_model(folder).info.fingerprint
    rng = np.random.default_rng(0)
    log_e = rng.normal(0, 1, 200)
    scores = [{"epistemic": float(np.exp(v)), "aleatoric": float(a), "valid": True}
              for v, a in zip(log_e, rng.uniform(0, 0.25, 200), strict=True)]
    labels = (rng.random(200) < 1 / (1 + np.exp(log_e))).astype(int)
    cal = tmp / "calibrator.json"
    Calibrator("paper", model_name="tiny", model_fingerprint=fp).fit(scores, labels).save(cal)
    policy = tmp / "policy.yaml"
    policy.write_text(f"name: bench\nversion: '1'\ncalibrator: {cal}\nrules:\n"
                      "  - name: ok\n    when: {risk: {le: 1}}\n    action: allow\n")
    return str(folder), policy, cal, _versions(cal)


def _versions(cal: Path) -> list[bytes]:
    """Two byte-different versions of one calibrator (its ``created`` differs): two sha256s."""
    doc = json.loads(cal.read_bytes())
    return [cal.read_bytes(), (json.dumps({**doc, "created": "2000-01-01T00:00:00+00:00"}, indent=1) + "\n").encode()]


class Server(ServeProcess):
    def __init__(self, model: str, policy: Path, tmp: Path, max_tokens: int) -> None:
        super().__init__(free_port(), ["--model", model, "--policy", str(policy), "--audit", str(tmp / "audit.jsonl"),
                                       "--max-queue", "512", "--default-max-tokens", str(max_tokens),
                                       "--admin-key-env", ADMIN_ENV, "--log-level", "warning"],
                         tmp / "server.log", env={ADMIN_ENV: ADMIN_KEY})

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """What ``/readyz`` said once the server was ready."""
        return self.ready(timeout)[1]


# --------------------------------------------------------------------------- load


def phase(url: str, name: str, clients: int, requests: int, reload: dict[str, Any] | None) -> dict[str, Any]:
    """``clients`` threads x ``requests`` chat completions; with ``reload``, a thread swaps the
    calibrator file and POSTs /admin/reload every ``reload['every_s']`` until the load is done."""
    lat: list[float] = []
    errors: list[str] = []
    shas: list[str] = []
    reloads: list[dict[str, Any]] = []
    lock = threading.Lock()
    done = threading.Event()

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            for j in range(requests):
                body = {"model": name, "messages": [{"role": "user", "content": PROMPTS[(c + j) % len(PROMPTS)]}]}
                t = time.perf_counter()
                try:
                    r = http.post("/v1/chat/completions", json=body)
                    ok = r.status_code == 200 and "guarduq" in r.json()
                    err = None if ok else f"HTTP {r.status_code}: {r.text[:160]}"
                except httpx.HTTPError as exc:
                    err = type(exc).__name__
                with lock:
                    if err is None:
                        lat.append(time.perf_counter() - t)
                        shas.append(r.json()["guarduq"]["calibrator_sha256"])
                    else:
                        errors.append(err)

    def reloader() -> None:
        cal, versions, k = reload["cal"], reload["versions"], reload["next"]
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:  # one at once, then every every_s until the load is done
                tmp = cal.with_suffix(".tmp")
                tmp.write_bytes(versions[k % 2])
                os.replace(tmp, cal)  # as an operator should: a reader never sees half a file
                t = time.perf_counter()
                r = http.post("/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                reloads.append({"status": r.status_code, "seconds": time.perf_counter() - t,
                                "changed": r.json().get("changed") if r.status_code == 200 else None})
                k += 1
                if done.wait(reload["every_s"]):
                    break
        reload["next"] = k

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    side = threading.Thread(target=reloader) if reload is not None else None
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    if side is not None:
        side.start()
    for t in threads:
        t.join()
    done.set()
    if side is not None:
        side.join()
    return {"lat": lat, "errors": errors, "shas": shas, "reloads": reloads, "wall_s": time.perf_counter() - t0}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for r in runs for x in r["lat"]]
    reloads = [x for r in runs for x in r["reloads"]]
    errors = [e for r in runs for e in r["errors"]]
    out = {"n": len(lat), "errors": len(errors), "error_examples": errors[:3],
           "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99), "max_s": max(lat, default=None),
           "wall_s": sum(r["wall_s"] for r in runs)}
    if reloads:
        secs = [x["seconds"] for x in reloads]
        out |= {"reloads": len(reloads), "reloads_ok": sum(x["status"] == 200 and x["changed"] for x in reloads),
                "reload_mean_s": sum(secs) / len(secs), "reload_max_s": max(secs)}
    return out


# --------------------------------------------------------------------------- report


def page(report: dict[str, Any], command: str) -> str:
    s, r = report["steady"], report["reloading"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    return f"""# Hot reload under load

Issue item 5 asks that swapping the policy and calibrator of a running server (`POST /admin/reload`,
SIGHUP, `--watch`) fail no request and keep the tail latency within 1.5x the steady state. One run
of `benchmarks/reload.py` on {report['machine']} (torch {report['torch']}, {report['model']}, fp32,
`policies/default.yaml` with its calibrator, an audit log):

```sh
{command}
```

{report['clients']} concurrent HTTP clients; {report['rounds']} round(s), each a steady phase then a
reload phase of {report['requests_per_client']} requests per client (max_tokens {report['max_tokens']},
batching on). In a reload phase the calibrator file is replaced (temp file + rename) by the other of
two versions that differ in their `created` field, so in their sha256, and `POST /admin/reload`
follows, every {report['reload_every_s']} s.

| phase | requests | errors | p50 | p99 | max | reloads (ok) | reload call: mean / max |
|---|---:|---:|---:|---:|---:|---:|---:|
| steady | {s['n']} | {s['errors']} | {ms(s['p50_s'])} | {ms(s['p99_s'])} | {ms(s['max_s'])} | - | - |
| reloading | {r['n']} | {r['errors']} | {ms(r['p50_s'])} | {ms(r['p99_s'])} | {ms(r['max_s'])} | {r.get('reloads', 0)} ({r.get('reloads_ok', 0)}) | {ms(r.get('reload_mean_s'))} / {ms(r.get('reload_max_s'))} |

**p99 during reload / steady p99 = {report['p99_ratio']:.2f}** (goal <= 1.5). Every reply named a
calibrator sha256 that was in force: {report['replies_named_a_served_calibrator']}. The p99 of
{s['n']} latencies is the {s['n'] - round(0.99 * (s['n'] - 1))}th largest, so one slow batch moves
it: read the ratio next to the p50s.

* A reload reads and checks the new pair (policy schema, model, calibrator fingerprint and parameter
  set, binding) on a thread beside the worker, then the worker swaps it in between two batches: the
  batch running at that moment finishes on the old pair. The reload call's time is mostly that
  wait for the running batch; what the requests pay is the GIL time of reading the calibrator JSON
  (the shipped one, with its evaluation data, is 250 kB) and its drift reference.
* The latencies are queueing-dominated (16 clients share one model on {report['cpus']} CPU cores), as in
  [serve.md](serve.md); the ratio compares two phases of the same run, interleaved in rounds.

Raw figures: `{_relative(report['out'])}`.
"""


def _relative(path: str) -> str:
    p = Path(path)
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny random model, small load (make test)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, help="per client per phase (default 10; --quick 4)")
    ap.add_argument("--rounds", type=int, help="steady/reload phase pairs (default 2; --quick 1)")
    ap.add_argument("--max-tokens", type=int, help="default 16; --quick 4")
    ap.add_argument("--reload-every", type=float, help="seconds between reloads (default 2; --quick 0.1)")
    ap.add_argument("--out", type=Path, help="JSON report (default runs/bench/reload[-quick].json)")
    ap.add_argument("--page", type=Path, help="results page (default docs/results/reload.md; --quick: none)")
    args = ap.parse_args(argv)
    q = args.quick
    requests = args.requests or (4 if q else 10)
    rounds = args.rounds or (1 if q else 2)
    max_tokens = args.max_tokens or (4 if q else 16)
    every = args.reload_every or (0.1 if q else 2.0)
    out = args.out or ROOT / f"runs/bench/reload{'-quick' if q else ''}.json"
    page_path = args.page or (None if q else ROOT / "docs/results/reload.md")
    tmp = Path(tempfile.mkdtemp(prefix="guarduq-reload-bench-"))
    model, policy, cal, versions = (files_quick if q else files_full)(tmp)
    served = {hashlib.sha256(v).hexdigest() for v in versions}
    srv = Server(model, policy, tmp, max_tokens)
    try:
        name = srv.wait_ready()["model"]
        phase(srv.url, name, 2, 1, None)  # warm-up
        reload = {"cal": cal, "versions": versions, "next": 1, "every_s": every}
        runs: dict[str, list[dict[str, Any]]] = {"steady": [], "reloading": []}
        for _ in range(rounds):
            runs["steady"].append(phase(srv.url, name, args.clients, requests, None))
            runs["reloading"].append(phase(srv.url, name, args.clients, requests, reload))
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    import torch

    report: dict[str, Any] = {
        "model": "tiny random Llama (--quick)" if q else "SmolLM2-135M-Instruct", "clients": args.clients,
        "requests_per_client": requests, "rounds": rounds, "max_tokens": max_tokens, "reload_every_s": every,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores", "cpus": os.cpu_count(),
        "torch": torch.__version__, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "out": str(out),
        "steady": summary(runs["steady"]), "reloading": summary(runs["reloading"]),
        "server_reloads_total": [x for x in metrics.splitlines() if x.startswith("guarduq_reloads_total")],
    }
    report["p99_ratio"] = report["reloading"]["p99_s"] / report["steady"]["p99_s"]
    report["replies_named_a_served_calibrator"] = all(
        sha in served for r in runs["steady"] + runs["reloading"] for sha in r["shas"])
    write_json(out, report)
    print(json.dumps(report, indent=1))
    print(f"p99 during reload / steady p99 = {report['p99_ratio']:.2f} (goal <= 1.5)")
    if page_path is not None:
        write_whole_page(page_path, page(report, rerun_command("reload.py", argv, report["OMP_NUM_THREADS"])))
    ok = report["steady"]["errors"] == 0 and report["reloading"]["errors"] == 0
    ok &= report["reloading"].get("reloads", 0) > 0 and report["reloading"]["reloads"] == report["reloading"]["reloads_ok"]
    return 0 if ok and report["replies_named_a_served_calibrator"] else 1


if __name__ == "__main__":
    sys.exit(main())
