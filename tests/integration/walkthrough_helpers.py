"""The README walkthrough's steps 1 to 3 as the walkthrough tests run them: a folder with your
policy and calibrator, ``guarduq serve`` with a store, the review page and an admin key, and
chat requests as any OpenAI client sends them. Shared by ``test_walkthrough.py`` and
``test_walkthrough_groups_drift.py``, which go on from here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.serve_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
GUARDUQ = str(Path(sys.executable).with_name("guarduq"))
ADMIN = "walkthrough-admin-key"
DATA = Path(os.environ.get("GUARDUQ_DATA") or ROOT / ".." / "shared" / "data")
TRIVIAQA = DATA / "triviaqa" / "triviaqa_dev_1k.jsonl"


def my_folder(tmp_path: Path, policy_extra: str = "") -> Path:
    """Step 1: a folder with your policy and calibrator (copies of the shipped ones), set to
    sample every reply for review while you start out; ``policy_extra`` is YAML appended to the
    policy (top-level keys such as ``groups`` and ``on_drift``)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    shutil.copy(ROOT / "policies/calibrators/smollm2-135m-instruct.json", folder / "calibrator.json")
    text = (ROOT / "policies/review.yaml").read_text()
    edited = text.replace("calibrator: calibrators/smollm2-135m-instruct.json", "calibrator: calibrator.json")
    edited = edited.replace("  rate: 0.1\n", "  rate: 1.0\n")
    assert edited.count("calibrator.json") == 1 and "rate: 1.0" in edited  # the README's two edits
    (folder / "policy.yaml").write_text(edited + policy_extra)
    return folder


@contextmanager
def serving(policy: Path, tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """Step 2: ``guarduq serve`` with a store, the review page and an admin key (``flags`` add
    to the README's command; ``env`` to the environment), stopped with SIGTERM afterwards."""
    port, db = free_port(), tmp_path / "guarduq.db"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [GUARDUQ, "serve", "--policy", str(policy), "--store", f"sqlite:///{db}", "--review",
         "--admin-key-env", "GUARDUQ_ADMIN_KEY", "--port", str(port), "--default-max-tokens", "16", *flags],
        env={**os.environ, **(env or {}), "GUARDUQ_ADMIN_KEY": ADMIN}, stdout=log, stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("guarduq serve did not become ready:\n" + (tmp_path / "serve.log").read_text()[-3000:])
        yield {"base": base, "store": f"sqlite:///{db}", "proc": proc}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def chat(base: str, question: str, **fields: Any) -> dict[str, Any]:
    """Step 3: one chat completion (``fields`` add to the OpenAI body, e.g. ``metadata``)."""
    r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": question}], **fields})
    assert r.status_code == 200, r.text
    return r.json()
