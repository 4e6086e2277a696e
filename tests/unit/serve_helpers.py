"""Shared pieces of the server tests: a tiny-model app and a fake Guard for the HTTP boundary."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from guarduq.guard import GuardedResponse
from guarduq.models import ModelInfo
from guarduq.scoring.uncertainty import Scores
from guarduq.serve import Settings, create_app

USER = [{"role": "user", "content": "Hi there"}]


def varied(tokenizer: Any) -> dict[str, Any]:
    """A random tiny model repeats one token; these settings make greedy output varied text."""
    return {"suppress_tokens": tokenizer.convert_tokens_to_ids(["Ġ", "Ċ", "ĉ", "č"]),
            "no_repeat_ngram_size": 1}


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 6, **kw}


class FakeGuard:
    """Just enough of a Guard for the server: fixed scores, text made from the prompt, a
    ``delay`` per call, and an optional ``generate_batch`` that records its batch sizes."""

    def __init__(self, tokenizer: Any, *, delay: float = 0.0, batch: bool = False,
                 policy: Any = None) -> None:
        self.tokenizer = tokenizer
        self.model = torch.nn.Linear(1, 1)  # a module: model_lock and context_length accept it
        self.info = ModelInfo(name="tiny", fingerprint="f" * 32, source="object", n_params=2)
        self.max_new_tokens, self.policy, self.calibrator, self.delay = 8, policy, None, delay
        self.calls: list[dict[str, Any]] = []
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        if batch:
            self.generate_batch = self._generate_batch

    def _response(self, prompt: Any, text: str, ended: bool = True) -> GuardedResponse:
        s = Scores(0.5, 0.25, 0.5, -0.69, 0.4, 1.0, 3, (), 2)
        return GuardedResponse(text=text, scores=s, ended=ended, prompt=prompt, model=self.info,
                               timings={"generate_s": self.delay, "score_s": 0.0})

    def _work(self, prompt: Any, kw: dict[str, Any]) -> str:
        self.gate.wait(10)
        self.calls.append(kw)
        if self.delay:
            time.sleep(self.delay)
        return "echo " + prompt[-1]["content"][:20]

    def generate(self, prompt: Any, **kw: Any) -> GuardedResponse:
        return self._response(prompt, self._work(prompt, kw))

    def stream(self, prompt: Any, *, stop: Any = (), **kw: Any) -> Any:
        text = self._work(prompt, kw)
        words = text.split(" ")
        yield from [w + " " for w in words[:-1]] + words[-1:]
        yield self._response(prompt, text)

    def guarded(self, prompt: Any, response: str, *, ended: bool = True) -> GuardedResponse:
        return self._response(prompt, response, ended)

    def _generate_batch(self, prompts: list[Any], **kw: Any) -> list[GuardedResponse]:
        self.batches.append(len(prompts))
        return [self._response(p, self._work(p, kw)) for p in prompts]


def fake_app(tokenizer: Any, **settings: Any) -> tuple[Any, FakeGuard]:
    guard_kw = {k: settings.pop(k) for k in ("delay", "batch", "policy") if k in settings}
    guard = FakeGuard(tokenizer, **guard_kw)
    return create_app(guard, settings=Settings(**settings)), guard  # type: ignore[arg-type]


def local_client(app: Any, **kw: Any) -> Any:
    """A TestClient as an SDK or browser on this machine calls a server without a key: from a
    loopback peer, to a loopback Host (TestClient's own default, ``testserver``, is refused)."""
    from fastapi.testclient import TestClient

    return TestClient(app, base_url="http://127.0.0.1:8000", client=("127.0.0.1", 50000), **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(app: Any) -> Iterator[int]:
    """uvicorn serving ``app`` on a free loopback port in a thread, for the block; yields the port."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)
