"""Who may open which door of ``guarduq serve``: without an API key every route answers only a
loopback client that addressed a loopback name (a DNS-rebinding page is refused), and each kind
of key opens its own door only (API: /v1 and /metrics; admin: /admin; review: /review)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sqlalchemy")
pytest.importorskip("jinja2")

from fastapi.testclient import TestClient  # noqa: E402

from guarduq.cli import main  # noqa: E402
from guarduq.review import ReviewPageSettings, mount_review  # noqa: E402
from guarduq.store import Store  # noqa: E402
from tests.unit.serve_helpers import body, fake_app  # noqa: E402

API, ADMIN, REVIEW = "api-key-0123456789abcdef", "admin-key-0123456789abcdef", "review-key-0123456789abcdef"
LOOPBACK_PEER = ("127.0.0.1", 50000)
# Every route of `guarduq serve --review`, with what a client would send.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", body()),
    ("POST", "/v1/guarduq/score", {"messages": [{"role": "user", "content": "Hi"}], "response": "Hello"}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/readyz", None),
    ("GET", "/healthz", None),
    ("POST", "/admin/reload", None),
    ("GET", "/review/", None),
    ("GET", "/review/export.jsonl", None),
]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'store.db'}")
    yield s
    s.close()


def served(tokenizer: Any, store: Store, review_keys: tuple[str, ...] = (), **settings: Any) -> Any:
    app, _ = fake_app(tokenizer, model_ids=("tiny",), **settings)
    mount_review(app, store, ReviewPageSettings(api_keys=review_keys))
    return app


def call(c: TestClient, method: str, path: str, payload: dict[str, Any] | None, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return c.request(method, path, json=payload, headers=headers)


@pytest.mark.parametrize(("method", "path", "payload"), ROUTES)
def test_without_a_key_every_route_refuses_a_dns_rebinding_host(tokenizer, store, method, path, payload):
    app = served(tokenizer, store, admin_keys=(ADMIN,))
    rebinding = TestClient(app, base_url="http://attacker.example:8000", client=LOOPBACK_PEER)
    resp = call(rebinding, method, path, payload, ADMIN if path.startswith("/admin") else None)
    assert resp.status_code == 403, resp.text
    assert resp.json()["error"]["code"] == "loopback_host_only" and "attacker.example" in resp.text
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "127.8.9.10"):
        local = TestClient(app, base_url=f"http://{host}", client=LOOPBACK_PEER)
        assert call(local, method, path, payload, ADMIN if path.startswith("/admin") else None).status_code != 403


def test_without_a_key_a_remote_client_is_refused_even_under_a_loopback_name(tokenizer, store):
    c = TestClient(served(tokenizer, store), base_url="http://127.0.0.1:8000", client=("10.1.2.3", 4000))
    resp = c.get("/v1/models")
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "loopback_only"


def test_allow_unauthenticated_remote_answers_any_host(tokenizer, store):
    app = served(tokenizer, store, allow_unauthenticated_remote=True)
    assert TestClient(app, base_url="http://attacker.example").get("/v1/models").status_code == 200


def test_each_key_opens_its_own_door_only(tokenizer, store):
    app = served(tokenizer, store, review_keys=(REVIEW,), api_keys=(API,), admin_keys=(ADMIN,))
    c = TestClient(app, base_url="http://guarduq.internal", client=("10.1.2.3", 4000))  # remote, keyed
    doors = {"/v1/chat/completions": API, "/v1/guarduq/score": API, "/v1/models": API, "/metrics": API,
             "/admin/reload": ADMIN, "/review/": REVIEW, "/review/export.jsonl": REVIEW}
    for method, path, payload in ROUTES:
        if path not in doors:
            continue
        for key in (API, ADMIN, REVIEW):
            status = call(c, method, path, payload, key).status_code
            if key == doors[path]:
                assert status not in (401, 403), (path, key)
            else:
                assert status == 401, (path, key, status)


@pytest.mark.parametrize(("env", "argv", "message"), [
    ({"A": API, "R": API}, ["--api-key-env", "A", "--review", "--review-key-env", "R"],
     "--api-key-env and --review-key-env share a key"),
    ({"A": API, "M": f"{ADMIN},{API}"}, ["--api-key-env", "A", "--admin-key-env", "M"],
     "--api-key-env and --admin-key-env share a key"),
    ({"A": API}, ["--api-key-env", "A", "--review"], "give reviewers their own keys with --review-key-env"),
    ({"R": REVIEW}, ["--review-key-env", "R"], "add --review"),
])
def test_serve_refuses_keys_that_open_two_doors(monkeypatch, capsys, env, argv, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", "--store", "sqlite:///unused.db", *argv]) == 2
    assert message in capsys.readouterr().err
