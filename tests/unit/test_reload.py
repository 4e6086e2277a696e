"""Hot reload of the policy and calibrator: Guard.reload, POST /admin/reload, SIGHUP, --watch.

A tiny random model with a real calibrator file; each test rewrites the files and checks which
pair (policy sha, calibrator sha) decided each reply.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from guarduq import Guard  # noqa: E402
from guarduq.calibration import Calibrator  # noqa: E402
from guarduq.decider import Decider, Identity  # noqa: E402
from guarduq.errors import (  # noqa: E402
    ArtifactError,
    CalibrationError,
    FingerprintMismatchError,
    PolicyError,
    ReloadError,
)
from guarduq.serve import Settings, create_app  # noqa: E402
from guarduq.serve.engine import Engine, Job  # noqa: E402
from tests.conftest import make_tokenizer, tiny_llama  # noqa: E402
from tests.unit.serve_helpers import USER, FakeGuard, body, free_port, local_client, serving, varied  # noqa: E402

ADMIN = "admin-key-0123456789abcdef"
API = "api-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fitted_calibrator_doc(fp: str) -> dict[str, Any]:
    """A calibrator artifact for the model with fingerprint ``fp`` (synthetic scores)."""
    rng = np.random.default_rng(0)
    log_e = rng.normal(0, 1, 200)
    scores = [{"epistemic": float(np.exp(v)), "aleatoric": float(a), "valid": True}
              for v, a in zip(log_e, rng.uniform(0, 0.25, 200), strict=True)]
    labels = (rng.random(200) < 1 / (1 + np.exp(log_e))).astype(int)
    cal = Calibrator("paper", model_name="tiny", model_fingerprint=fp).fit(scores, labels)
    return cal.to_dict(include_evaluation_data=False)


class Files:
    """The policy and calibrator files a Guard/server reads; ``write(k)`` writes version k of both."""

    def __init__(self, folder: Path, fp: str) -> None:
        self.policy, self.cal = folder / "policy.yaml", folder / "cal.json"
        self.doc = fitted_calibrator_doc(fp)
        self.pairs: dict[str, str] = {}  # policy sha -> calibrator sha, as written together
        self.write(1)

    def write(self, k: int) -> Identity:
        replace_text(self.policy, f"name: t\nversion: '{k}'\ncalibrator: cal.json\nrules:\n"
                                  "  - name: ok\n    when: {risk: {le: 1}}\n    action: allow\n"
                                  "  - name: unsure\n    action: abstain\n    message: 'Not sure.'\n")
        replace_text(self.cal, json.dumps({**self.doc, "created": f"2025-01-0{k % 9 + 1}"}))
        self.pairs[sha(self.policy)] = sha(self.cal)
        return Identity(f"t@{k}", sha(self.policy), sha(self.cal))


def replace_text(path: Path, text: str) -> None:
    """Write as an operator should (temp file + rename): a poll never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def model(tokenizer) -> Any:
    return tiny_llama(seed=3), tokenizer


@pytest.fixture
def files(tmp_path, model) -> Files:
    from guarduq.models import fingerprint

    return Files(tmp_path, fingerprint(model[0]))


@pytest.fixture
def guard(model, files, tmp_path) -> Guard:
    return Guard(model, policy=files.policy, audit=tmp_path / "audit.jsonl", max_new_tokens=8)


def client_for(guard: Guard, **settings: Any) -> Any:
    s = Settings(model_ids=("tiny",), generation_defaults=varied(guard.tokenizer), **settings)
    return local_client(create_app(guard, settings=s))


def pair_of(reply: dict[str, Any]) -> tuple[str, str, str]:
    g = reply["guarduq"]
    return g["policy"], g["policy_sha256"], g["calibrator_sha256"]


def metric(text: str, outcome: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(f'guarduq_reloads_total{{outcome="{outcome}"}}'))
    return float(line.split()[-1])


# --------------------------------------------------------------------------- the library


def test_guard_reload_rereads_the_files_and_the_next_reply_names_the_new_pair(guard, files, tmp_path):
    first = guard.guarded(USER, "Blue")
    assert first.decided_by == Identity("t@1", sha(files.policy), sha(files.cal))
    assert guard.reload() == first.decided_by  # same files: same pair
    new = files.write(2)
    assert guard.reload() == new and guard.decider.identity == new
    r = guard.guarded(USER, "Blue")
    assert r.decided_by == new and r.metadata()["calibrator_sha256"] == new.calibrator_sha256
    audit = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert audit[-1]["policy"]["sha256"] == new.policy_sha256
    assert audit[-1]["calibrator_sha256"] == new.calibrator_sha256
    assert guard.policy.version == "2" and guard.calibrator.sha256 == new.calibrator_sha256


def test_guard_reload_takes_paths_or_objects_and_a_calibrator_path_stays_pinned(guard, files, tmp_path):
    other = tmp_path / "pinned.json"
    other.write_text(json.dumps({**files.doc, "created": "2024-12-31"}))
    assert guard.reload(calibrator=other).calibrator_sha256 == sha(other)
    files.write(3)  # the policy names cal.json, but the calibrator was given: it stays
    assert guard.reload() == Identity("t@3", sha(files.policy), sha(other))
    cal = Calibrator.load(files.cal)
    assert guard.reload(calibrator=cal).calibrator_sha256 == sha(files.cal)
    assert guard.decider.calibrator is cal


def test_attribute_assignment_still_replaces_one_half(guard, files):
    cal = Calibrator.load(files.cal)
    guard.calibrator = cal
    assert guard.decider.calibrator is cal and guard.decider.policy is not None
    guard.policy = None
    assert guard.guarded(USER, "Blue").decision is None


@pytest.mark.parametrize("bad", ["policy_yaml", "calibrator_json", "fingerprint", "parameter_set"])
def test_guard_reload_refuses_a_bad_file_and_keeps_the_pair(guard, files, bad):
    before = guard.decider
    expected = {"policy_yaml": PolicyError, "calibrator_json": ArtifactError,
                "fingerprint": FingerprintMismatchError, "parameter_set": CalibrationError}[bad]
    write_bad(files, bad)
    with pytest.raises(expected):
        guard.reload()
    assert guard.decider is before
    assert guard.guarded(USER, "Blue").decided_by == before.identity


def logged_reload(c: Any, caplog: Any, level: str, query: str = "") -> Any:
    """POST /admin/reload with guarduq's log lines captured at ``level``."""
    logger = logging.getLogger("guarduq")  # the CLI tests may have stopped its propagation
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger="guarduq"):
            return c.post("/admin/reload" + query, headers=AUTH)
    finally:
        logger.removeHandler(caplog.handler)


def write_bad(files: Files, bad: str) -> None:
    if bad == "policy_yaml":
        files.policy.write_text("name: t\nrules: [\n")
    elif bad == "calibrator_json":
        files.cal.write_text('{"format": "guarduq-calibrator", ')
    elif bad == "fingerprint":
        files.cal.write_text(json.dumps({**files.doc, "model": {"name": "other", "fingerprint": "0" * 32}}))
    else:
        files.cal.write_text(json.dumps({**files.doc, "parameter_set": "last_n_blocks=1"}))


def test_reload_refuses_a_policy_for_another_model_or_using_risk_without_calibrator(guard, files):
    before = guard.decider
    files.policy.write_text(files.policy.read_text().replace("name: t\n", "name: t\nmodel: other-model\n"))
    with pytest.raises(PolicyError, match="is for model 'other-model'"):
        guard.reload()
    files.policy.write_text(files.policy.read_text().replace("model: other-model\n", "").replace(
        "calibrator: cal.json\n", ""))
    with pytest.raises(PolicyError, match="risk comes from the calibrator"):
        guard.reload()
    assert guard.decider is before


def test_decider_files_are_what_a_reload_rereads(guard, files, tmp_path):
    assert guard.decider.files() == (files.policy, files.cal)
    plain = Decider.load(None, files.cal, guard.info)
    assert plain.files() == (files.cal,) and plain.identity.policy is None


# --------------------------------------------------------------------------- the engine


def test_call_between_runs_after_the_running_job_and_before_the_next(tokenizer):
    fake = FakeGuard(tokenizer)
    fake.gate.clear()
    engine = Engine(fake, max_queue=4, batching=False)  # type: ignore[arg-type]
    order: list[str] = []
    first = engine.submit(Job("generate", USER, gen={"max_new_tokens": 2}))
    time.sleep(0.2)  # the worker is inside the first job
    second = engine.submit(Job("generate", [{"role": "user", "content": "two"}], gen={"max_new_tokens": 2}))
    first.future.add_done_callback(lambda f: order.append("first"))
    second.future.add_done_callback(lambda f: order.append("second"))
    done = engine.call_between(lambda: order.append("between") or 42)
    time.sleep(0.2)
    assert not done.done()
    fake.gate.set()
    assert done.result(5) == 42 and second.future.result(5)
    assert order == ["first", "between", "second"]
    failing = engine.call_between(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert engine.submit(Job("generate", USER, gen={"max_new_tokens": 2})).future.result(5)  # still alive
    engine.close()
    with pytest.raises(RuntimeError, match="stopped"):
        engine.call_between(lambda: None).result(1)


# --------------------------------------------------------------------------- POST /admin/reload


def test_admin_reload_swaps_the_pair_for_the_next_request(guard, files):
    c = client_for(guard, admin_keys=(ADMIN,))
    old = Identity("t@1", sha(files.policy), sha(files.cal))
    assert pair_of(c.post("/v1/chat/completions", json=body()).json()) == (old.policy, old.policy_sha256,
                                                                          old.calibrator_sha256)
    new = files.write(2)
    resp = c.post("/admin/reload", headers=AUTH, json={"policy": "/etc/passwd"})  # the body is ignored
    assert resp.status_code == 200
    assert resp.json() == {"object": "guarduq.reload", "changed": True, "old": old.to_dict(), "new": new.to_dict()}
    reply = c.post("/v1/chat/completions", json=body()).json()
    assert pair_of(reply) == (new.policy, new.policy_sha256, new.calibrator_sha256)
    ready = c.get("/readyz").json()
    assert (ready["policy"], ready["policy_sha256"], ready["calibrator_sha256"]) == pair_of(reply)
    listed = c.get("/v1/models").json()["data"][0]["guarduq"]
    assert (listed["policy"], listed["policy_sha256"], listed["calibrator_sha256"]) == pair_of(reply)
    assert c.post("/admin/reload", headers=AUTH).json()["changed"] is False
    assert metric(c.get("/metrics").text, "ok") == 2.0


@pytest.mark.parametrize("bad", ["policy_yaml", "calibrator_json", "fingerprint", "parameter_set"])
def test_admin_reload_refuses_a_bad_file_and_the_old_pair_serves(guard, files, bad, caplog):
    c = client_for(guard, admin_keys=(ADMIN,))
    old = pair_of(c.post("/v1/chat/completions", json=body()).json())
    write_bad(files, bad)
    resp = logged_reload(c, caplog, "ERROR")
    assert resp.status_code == 422
    err = resp.json()["error"]
    assert err["code"] == "reload_failed" and "the policy and calibrator in force stay" in err["message"]
    needle = {"policy_yaml": "policy.yaml", "calibrator_json": "not valid JSON", "fingerprint": "fingerprint",
              "parameter_set": "parameter"}[bad]
    assert needle in err["message"]
    assert any("reload_failed" in r.getMessage() for r in caplog.records)
    assert pair_of(c.post("/v1/chat/completions", json=body()).json()) == old
    text = c.get("/metrics").text
    assert metric(text, "failed") == 1.0 and metric(text, "ok") == 0.0


def test_admin_key_is_required_and_separate_from_api_keys(guard, files):
    off = client_for(guard)
    resp = off.post("/admin/reload", headers=AUTH)
    assert resp.status_code == 403 and resp.json()["error"]["message"] == \
        "admin endpoints are disabled (no --admin-key-env)"
    c = client_for(guard, admin_keys=(ADMIN,), api_keys=(API,))
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": f"Bearer {API}"}):
        resp = c.post("/admin/reload", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert c.post("/admin/reload", headers=AUTH).status_code == 200
    assert c.post("/v1/chat/completions", json=body(), headers=AUTH).status_code == 401  # not an API key


def test_in_flight_request_finishes_on_the_old_pair(guard, files):
    c = client_for(guard, admin_keys=(ADMIN,), batching=False)
    old = ("t@1", sha(files.policy), sha(files.cal))
    entered, release = threading.Event(), threading.Event()
    original = guard.model.forward

    def blocking(*a: Any, **kw: Any) -> Any:
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return original(*a, **kw)

    guard.model.forward = blocking
    out: dict[str, Any] = {}
    chat = threading.Thread(target=lambda: out.update(chat=c.post("/v1/chat/completions", json=body())))
    chat.start()
    assert entered.wait(10)
    new = files.write(2)
    reload = threading.Thread(target=lambda: out.update(reload=c.post("/admin/reload", headers=AUTH)))
    reload.start()
    time.sleep(0.5)
    assert reload.is_alive() and guard.decider.identity.calibrator_sha256 == old[2]  # built, waiting
    release.set()
    chat.join(30)
    reload.join(30)
    assert pair_of(out["chat"].json()) == old
    assert out["reload"].status_code == 200 and out["reload"].json()["new"] == new.to_dict()
    assert pair_of(c.post("/v1/chat/completions", json=body()).json())[2] == new.calibrator_sha256


def test_watch_reloads_when_a_file_changes(guard, files):
    app = create_app(guard, settings=Settings(model_ids=("tiny",), watch_s=0.05))
    with serving(app) as port:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/readyz").json()["calibrator_sha256"] == sha(files.cal)
        new = files.write(2)
        assert wait_for(lambda: httpx.get(url + "/readyz").json()["calibrator_sha256"] == new.calibrator_sha256)
        replace_text(files.cal, "{broken")
        assert wait_for(lambda: metric(httpx.get(url + "/metrics").text, "failed") == 1.0)
        assert httpx.get(url + "/readyz").json()["calibrator_sha256"] == new.calibrator_sha256


def wait_for(cond: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- under load


def test_reload_under_load_fails_no_request_and_never_mixes_a_pair(guard, files):
    """16 concurrent clients on a real uvicorn server while the pair is swapped 6 times."""
    app = create_app(guard, settings=Settings(model_ids=("tiny",), admin_keys=(ADMIN,), max_queue=256,
                                              generation_defaults=varied(guard.tokenizer)))
    clients, per_client = 16, 6
    replies: list[tuple[str, str, str]] = []
    errors: list[str] = []
    reloads: list[int] = []
    lock = threading.Lock()
    with serving(app) as port:
        url = f"http://127.0.0.1:{port}"

        def client(i: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                for j in range(per_client):
                    kw = {"stream": True} if (i + j) % 4 == 0 else {}
                    r = http.post("/v1/chat/completions", json=body(
                        messages=[{"role": "user", "content": f"q{i}-{j}"}], **kw))
                    with lock:
                        if r.status_code != 200:
                            errors.append(f"{r.status_code}: {r.text[:100]}")
                        elif kw:
                            replies.append(pair_of(last_event(r.text)))
                        else:
                            replies.append(pair_of(r.json()))

        def reloader() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                for k in range(2, 8):
                    files.write(k)
                    reloads.append(http.post("/admin/reload", headers=AUTH).status_code)
                    time.sleep(0.05)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        threads.append(threading.Thread(target=reloader))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        final = httpx.get(url + "/readyz").json()
    assert errors == [] and reloads == [200] * 6
    assert len(replies) == clients * per_client
    assert all(files.pairs.get(p) == c for _, p, c in replies)  # each reply: a pair as written
    assert final["policy"] == "t@7"


def last_event(sse: str) -> dict[str, Any]:
    events = [json.loads(e[len("data: "):]) for e in sse.split("\n\n") if e.startswith("data: {")]
    return next(e for e in reversed(events) if "guarduq" in e)


# --------------------------------------------------------------------------- SIGHUP on guarduq serve


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX only")
def test_sighup_swaps_the_pair_of_a_real_serve_process(tmp_path):
    from guarduq.models import load_model

    folder = tmp_path / "tiny-model"
    tiny_llama(seed=0).save_pretrained(folder)
    make_tokenizer(chat_template=True).save_pretrained(folder)
    files = Files(tmp_path, load_model(folder).info.fingerprint)
    port = free_port()
    env = {**os.environ, "GUARDUQ_TEST_ADMIN": ADMIN}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "guarduq", "serve", "--model", str(folder), "--policy",
                             str(files.policy), "--port", str(port), "--default-max-tokens", "4",
                             "--admin-key-env", "GUARDUQ_TEST_ADMIN"], stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> dict[str, Any] | None:
        try:
            r = httpx.get(url + "/readyz", timeout=2)
            return r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    try:
        assert wait_for(lambda: ready() is not None or proc.poll() is not None, 120) and proc.poll() is None
        assert ready()["calibrator_sha256"] == sha(files.cal)
        name = ready()["model"]
        new = files.write(2)
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: (ready() or {}).get("calibrator_sha256") == new.calibrator_sha256)
        reply = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"model": name, "messages": USER}).json()
        assert pair_of(reply) == (new.policy, new.policy_sha256, new.calibrator_sha256)
        replace_text(files.cal, "{broken")  # a failed reload from SIGHUP is logged and counted, no more
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: metric(httpx.get(url + "/metrics").text, "failed") == 1.0)
        assert proc.poll() is None and ready()["calibrator_sha256"] == new.calibrator_sha256
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert b"reload_failed" in (tmp_path / "serve.log").read_bytes()


# --------------------------------------------------------------------------- uncertified pairs


def uncertified_files(files: Files) -> Identity:
    """A policy answering when risk <= threshold at alpha 0.01, and a calibrator whose labels
    (every one wrong) certify no threshold at that alpha: its allow rule can never match."""
    rng = np.random.default_rng(1)
    scores = [{"epistemic": float(e), "aleatoric": 0.1, "valid": True} for e in rng.uniform(0.1, 2, 60)]
    cal = Calibrator.load(files.cal)
    cal.fit_thresholds(scores, [0] * 60, alphas=(0.01,), delta=0.1)
    assert cal.threshold_for(0.01) is None
    replace_text(files.cal, json.dumps(cal.to_dict(include_evaluation_data=False)))
    replace_text(files.policy, "name: t\nversion: 'u'\ncalibrator: cal.json\nalpha: 0.01\nrules:\n"
                               "  - name: confident\n    when: {risk: {le: threshold}}\n    action: allow\n"
                               "  - name: unsure\n    action: abstain\n"
                               "    message: 'Not sure (chance of a wrong answer: {risk:.0%}).'\n")
    return Identity("t@u", sha(files.policy), sha(files.cal))


def test_an_uncertified_pair_is_refused_with_422_and_the_old_pair_serves(guard, files):
    c = client_for(guard, admin_keys=(ADMIN,))
    old = pair_of(c.post("/v1/chat/completions", json=body()).json())
    uncertified_files(files)
    resp = c.post("/admin/reload", headers=AUTH)
    assert resp.status_code == 422
    err = resp.json()["error"]
    assert err["code"] == "uncertified_pair" and "rule confident can never match" in err["message"]
    assert "no threshold is certified at alpha 0.01" in err["message"] and "force=true" in err["message"]
    reply = c.post("/v1/chat/completions", json=body()).json()
    assert pair_of(reply) == old and c.get("/readyz").json()["calibrator_sha256"] == old[2]
    assert metric(c.get("/metrics").text, "failed") == 1.0
    assert c.post("/admin/reload?force=maybe", headers=AUTH).status_code == 400


def test_sighup_and_watch_never_force_an_uncertified_pair(guard, files):
    c = client_for(guard, admin_keys=(ADMIN,))
    reloader = c.app.state.reloader
    old = guard.decider.identity
    uncertified_files(files)
    for trigger in ("sighup", "watch"):
        with pytest.raises(ReloadError, match="can never match"):
            reloader.reload(trigger)
    assert guard.decider.identity == old


def test_force_takes_it_with_a_warning_and_withheld_replies_say_why(guard, files, caplog):
    c = client_for(guard, admin_keys=(ADMIN,))
    new = uncertified_files(files)
    resp = logged_reload(c, caplog, "WARNING", "?force=true")
    assert resp.status_code == 200 and resp.json()["new"] == new.to_dict()
    assert any("reload_forced_uncertified" in r.getMessage() for r in caplog.records)
    reply = c.post("/v1/chat/completions", json=body()).json()
    g, text = reply["guarduq"], reply["choices"][0]["message"]["content"]
    assert g["calibrator_sha256"] == new.calibrator_sha256 and reply["choices"][0]["finish_reason"] == "content_filter"
    assert "no certified risk threshold at alpha 0.01" in text and "%" not in text  # no risk quoted as the reason
