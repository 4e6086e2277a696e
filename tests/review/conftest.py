"""Review-page fixtures: real ``guarduq.store.Store`` instances filled with sampled replies."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")
pytest.importorskip("sqlalchemy")

from fastapi.testclient import TestClient  # noqa: E402

from guarduq.review import ReviewPageSettings, create_review_app  # noqa: E402
from guarduq.store import Store  # noqa: E402
from guarduq.store.records import ReplyRecord, Sample  # noqa: E402

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
LOOPBACK = ("127.0.0.1", 50000)
# Without a key the page answers only requests addressed to a loopback name (DNS rebinding), and
# TestClient's default Host is "testserver": test clients address the page as a browser would.
BASE_URL = "http://127.0.0.1:8100"
XSS_PROMPT = "Is <script>window.__pwned=1;alert(1)</script> safe?"
XSS_ANSWER = 'Yes <img src=x onerror="window.__pwned=1"> it is'


def reply(i: int, *, risk: float | None = 0.5, action: str = "allow", rule: str | None = "confident",
          prompt: Any = None, response: str | None = None, tokens: list[str] | None = None,
          token_probs: list[float] | None = None, **kw: Any) -> ReplyRecord:
    """Reply ``i`` (newer for larger i), text kept."""
    response = f"answer {i}" if response is None else response
    return ReplyRecord(
        request_id=f"req{i:04d}", time=T0 + timedelta(minutes=i), model_fingerprint="f" * 32,
        policy="default@1.0", policy_sha256="a" * 64, calibrator_sha256="b" * 64, parameter_set="all",
        scores={"epistemic": 0.012, "aleatoric": 0.21, "mean_token_prob": 0.7, "n_tokens": 3,
                "valid": True, "reason": None},
        risk=risk, action=action, rule=rule, shown=action == "allow", escalated=action == "escalate",
        prompt=prompt if prompt is not None else f"question {i}?", response=response,
        tokens=tokens, token_probs=token_probs, **kw)


UNIFORM = Sample(("uniform",), True, 0.1, 0.0, 0.1)
ESCALATION = Sample(("escalation",), False, 0.1, 1.0, 1.0)
BAND = Sample(("band",), False, 0.1, 0.5, 0.55)
NOT_SAMPLED = Sample((), False, 0.1, 0.0, 0.1)


def fill(store: Store, n: int = 12) -> list[str]:
    """``n`` replies, every third an escalation (abstain, risk 0.9), every third a band item
    (risk 0.6), the rest uniform (risk 0.1 + i/100, allow); plus two replies not sampled."""
    ids = []
    for i in range(n):
        if i % 3 == 0:
            r, s = reply(i, risk=0.9, action="abstain", rule="uncertain"), ESCALATION
        elif i % 3 == 1:
            r, s = reply(i, risk=0.6, action="allow"), BAND
        else:
            r, s = reply(i, risk=round(0.1 + i / 100, 2), action="allow"), UNIFORM
        store.record(r, s)
        ids.append(r.request_id)
    store.record(reply(900), NOT_SAMPLED)
    store.record(reply(901), None)
    return ids


@pytest.fixture
def store(tmp_path: Any) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'store.db'}")
    yield s
    s.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    """The store on SQLite, then on PostgreSQL (``pg_database_url``: a fresh database)."""
    url = f"sqlite:///{tmp_path / 'store.db'}" if request.param == "sqlite" \
        else request.getfixturevalue("pg_database_url")
    s = Store(url)
    yield s
    s.close()


def page_client(app: Any, host: tuple[str, int] = LOOPBACK, base_url: str = BASE_URL) -> TestClient:
    """A TestClient on ``app``; requests come from ``host`` and are sent to ``base_url``
    (``Host: 127.0.0.1:8100``, as a browser on this machine sends)."""
    return TestClient(app, client=host, base_url=base_url)


def client(store: Store, host: tuple[str, int] = LOOPBACK, **settings: Any) -> TestClient:
    """A TestClient on the review app; requests come from ``host`` (loopback by default)."""
    return page_client(create_review_app(store, ReviewPageSettings(**settings)), host)


def csrf(c: TestClient, path: str = "/") -> str:
    """Open ``path`` (which sets the CSRF cookie) and return the form token."""
    assert c.get(path).status_code == 200
    token = c.cookies.get("guarduq_review_csrf")
    assert token
    return token
