"""Shared by the server benchmarks (serve.py, reload.py, store_load.py): a ``guarduq serve``
subprocess on a free loopback port, waited for and stopped alike, and the latency percentile."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile of ``xs`` (nearest rank); None for no values."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else None


class ServeProcess:
    """``python -m guarduq serve <args>`` on ``port``, its output appended to ``log``."""

    def __init__(self, port: int, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = open(log, "ab")  # noqa: SIM115 - kept open for the subprocess' lifetime
        cmd = [sys.executable, "-m", "guarduq", "serve", "--port", str(port), *args]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, env=full_env, cwd=ROOT)

    def ready(self, timeout: float) -> tuple[float, dict[str, Any]]:
        """Seconds until ``/readyz`` answered 200, and what it said; RuntimeError if the server
        exits or is not ready within ``timeout``."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200:
                    return time.perf_counter() - t0, r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready in time")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
