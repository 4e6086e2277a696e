"""The review page's security: API keys, loopback only without one (client and Host), CSRF,
escaping, headers."""

from __future__ import annotations

import base64
import html as htmllib

import pytest

from guarduq.review import ReviewPageSettings, create_review_app
from guarduq.review.security import Csrf, csrf_secret_from_keys, host_name
from guarduq.store import Store
from tests.review.conftest import (
    UNIFORM,
    XSS_ANSWER,
    XSS_PROMPT,
    client,
    csrf,
    fill,
    page_client,
    reply,
)

KEY = "k" * 24


def _basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.mark.parametrize("host", ["10.1.2.3", "192.168.0.5", "2001:db8::1", "testclient"])
def test_without_a_key_only_loopback_is_answered(store: Store, host: str) -> None:
    fill(store, 2)
    remote = client(store, host=(host, 4000))
    for path in ("/", "/items/req0000", "/export.jsonl", "/static/review.js"):
        r = remote.get(path)
        assert r.status_code == 403, path
        assert "loopback" in r.json()["error"]["message"]
    assert remote.post("/items/req0000/label", data={"label": "right"}).status_code == 403
    assert store.item("req0000").labels == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1"])
def test_loopback_is_answered_without_a_key(store: Store, host: str) -> None:
    fill(store, 2)
    assert client(store, host=(host, 4000)).get("/").status_code == 200


REBOUND = ["attacker.example", "attacker.example:8100", "127.0.0.1.nip.io:8100", "localhost.attacker.example",
           "localhost:abc", "[2001:db8::1]:8100", "[::1]x", "10.0.0.7", "", "testserver"]


@pytest.mark.parametrize("host", REBOUND)
def test_without_a_key_a_foreign_host_header_is_refused(store: Store, host: str) -> None:
    """DNS rebinding: a page on attacker.example, re-resolved to 127.0.0.1, sends the reviewer's
    own browser here from loopback but with its own name in Host. Nothing may be read or written."""
    ids = fill(store, 2)
    c = client(store)
    token = csrf(c)  # a real token from the real page (the attacker cannot even get this far)
    bad = {"host": host}
    for path in ("/", f"/items/{ids[0]}", "/export.jsonl", "/static/review.js"):
        r = c.get(path, headers=bad)
        assert r.status_code == 403, path
        err = r.json()["error"]
        assert err["code"] == "loopback_host_only" and "Host" in err["message"] and "loopback" in err["message"]
        assert "x-guarduq-rows" not in r.headers and "set-cookie" not in r.headers
    assert "guarduq-labels" not in c.get("/export.jsonl", headers=bad).text
    for label in ("right", "wrong"):
        r = c.post(f"/items/{ids[0]}/label", data={"label": label, "csrf": token}, headers=bad)
        assert r.status_code == 403
    assert c.post("/reviewer", data={"reviewer": "eve", "csrf": token}, headers=bad).status_code == 403
    assert store.item(ids[0]).labels == []
    r = c.get("/", headers={**bad, "accept": "text/html"})  # a browser gets the message as a page
    assert r.status_code == 403 and r.headers["content-type"].startswith("text/html") and "Host" in r.text
    # the same browser under a loopback name is answered
    assert c.get("/").status_code == 200
    assert c.post(f"/items/{ids[0]}/label", data={"label": "right", "csrf": token}).status_code == 200
    assert store.item(ids[0]).current.label == "right"


def test_a_missing_host_header_is_refused(store: Store) -> None:
    import asyncio

    fill(store, 1)
    app = create_review_app(store)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "http_version": "1.0", "method": "GET", "path": "/", "raw_path": b"/",
             "root_path": "", "scheme": "http", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8100)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 403


@pytest.mark.parametrize("host", ["localhost", "localhost:8100", "LOCALHOST.", "127.0.0.1", "127.0.0.1:8100",
                                  "127.9.9.9:1", "[::1]", "[::1]:8100", "::1"])
def test_without_a_key_loopback_host_headers_are_answered(store: Store, host: str) -> None:
    fill(store, 1)
    c = client(store)
    r = c.get("/", headers={"host": host})
    assert r.status_code == 200 and "set-cookie" in r.headers
    assert c.get("/export.jsonl", headers={"host": host}).status_code == 200


def test_host_header_is_not_checked_with_keys_or_when_told(store: Store) -> None:
    fill(store, 1)
    # with keys, the key is the guard (a rebinding page has none); any name may front the page
    keyed = client(store, api_keys=(KEY,))
    assert keyed.get("/", headers={"host": "attacker.example"}).status_code == 401
    assert keyed.get("/", headers={"host": "reviews.example.com", "authorization": f"Bearer {KEY}"}).status_code == 200
    # --allow-unauthenticated-remote opens the page to every client, under every name
    open_ = client(store, host=("10.0.0.7", 1), allow_unauthenticated_remote=True)
    assert open_.get("/", headers={"host": "reviews.example.com"}).status_code == 200


@pytest.mark.parametrize("header, name", [
    ("localhost", "localhost"), ("LocalHost:8100", "localhost"), ("localhost.", "localhost"),
    ("127.0.0.1:80", "127.0.0.1"), ("[::1]", "::1"), ("[::1]:8100", "::1"), ("::1", "::1"),
    (" example.com ", "example.com"), (None, None), ("", None), (":8100", None), ("a:b", None),
    ("[::1", None), ("[::1]x", None), ("[::1]:", None), ("[::1]:p", None),
])
def test_host_name(header: str | None, name: str | None) -> None:
    assert host_name(header) == name


def test_remote_allowed_when_told(store: Store) -> None:
    fill(store, 2)
    c = client(store, host=("10.0.0.7", 4000), allow_unauthenticated_remote=True)
    assert c.get("/").status_code == 200


def test_api_key(store: Store) -> None:
    ids = fill(store, 3)
    c = client(store, host=("10.0.0.7", 4000), api_keys=("x" * 20, KEY))
    r = c.get("/")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic realm=")
    assert c.get("/", headers=_basic("ann", "wrong-key-wrong-key")).status_code == 401
    assert c.get("/", headers={"authorization": "Bearer nope"}).status_code == 401
    assert c.get("/", headers={"authorization": "Basic !!!"}).status_code == 401
    assert c.get("/", headers={"authorization": f"Token {KEY}"}).status_code == 401
    assert c.get("/", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    ok = c.get("/", headers=_basic("ann", KEY))
    assert ok.status_code == 200 and '<strong id="reviewer">ann</strong>' in ok.text
    assert 'action="/reviewer"' not in ok.text  # the login names the reviewer
    # the Basic user name is the reviewer stored with the label
    token = c.cookies.get("guarduq_review_csrf")
    r = c.post(f"/items/{ids[0]}/label", data={"label": "wrong", "csrf": token}, headers=_basic("ann", KEY),
               follow_redirects=False)
    assert r.status_code == 303 and store.item(ids[0]).current.reviewer == "ann"
    # without a key, no label, even with a valid token
    r = c.post(f"/items/{ids[1]}/label", data={"label": "wrong", "csrf": token})
    assert r.status_code == 401 and store.item(ids[1]).labels == []
    # with keys, loopback clients need one too
    assert client(store, api_keys=(KEY,)).get("/").status_code == 401


def test_csrf_refusals(store: Store) -> None:
    ids = fill(store, 2)
    app = create_review_app(store)
    c = page_client(app)
    token = csrf(c)
    other = Csrf().mint()  # well-formed, signed by another secret
    forged = token.split(".")[0] + "." + "0" * 64
    # (the form's csrf field, the csrf cookie): the field is left out when None
    cases = [
        (None, token), ("", token), ("abc", token), (other, token), (forged, token),
        (token, None),  # no cookie
        (other, other),  # cookie and field agree, but signed by another secret
        (token, Csrf().mint()),  # a cookie from elsewhere
    ]
    for field, cookie in cases:
        fresh = page_client(app)  # the same app (the same secret), another browser
        if cookie is not None:
            fresh.cookies.set("guarduq_review_csrf", cookie)
        data = {"label": "right"} | ({"csrf": field} if field is not None else {})
        r = fresh.post(f"/items/{ids[0]}/label", data=data, follow_redirects=False)
        assert r.status_code == 403, (field, cookie)
        assert r.json()["error"]["code"] in ("csrf_missing", "csrf_invalid")
        assert fresh.post("/reviewer", data={**data, "reviewer": "eve"}).status_code == 403
    assert store.item(ids[0]).labels == []
    # a cross-site form is refused even with the token
    r = c.post(f"/items/{ids[0]}/label", data={"label": "right", "csrf": token},
               headers={"sec-fetch-site": "cross-site"})
    assert r.status_code == 403 and store.item(ids[0]).labels == []
    # a token from another app instance (another secret) does not verify here
    app2 = client(store)
    app2.cookies.set("guarduq_review_csrf", token)
    assert app2.post(f"/items/{ids[0]}/label", data={"label": "right", "csrf": token}).status_code == 403
    # the real thing works
    assert c.post(f"/items/{ids[0]}/label", data={"label": "right", "csrf": token}).status_code == 200
    assert store.item(ids[0]).current.label == "right"


def test_csrf_cookie_flags(store: Store) -> None:
    fill(store, 1)
    r = client(store).get("/")
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    token = cookie.split(";")[0].split("=", 1)[1]
    assert f'name="csrf" value="{token}"' in r.text  # the form carries the cookie's token


def test_a_fixed_secret_survives_a_restart(store: Store) -> None:
    fill(store, 1)
    secret = b"s" * 32
    c = client(store, csrf_secret=secret)
    token = csrf(c)
    again = client(store, csrf_secret=secret)
    again.cookies.set("guarduq_review_csrf", token)
    assert again.post("/items/req0000/label", data={"label": "right", "csrf": token}).status_code == 200


def test_replicas_sharing_keys_accept_each_others_tokens(store: Store) -> None:
    """Behind a load balancer, ``serve --review`` replicas share keys, not a process: the CSRF
    secret is derived from the keys, so a token minted by one verifies on the others."""
    ids = fill(store, 3)
    bearer = {"authorization": f"Bearer {KEY}"}
    one = client(store, api_keys=(KEY, "x" * 20))
    token = one.get("/", headers=bearer).cookies.get("guarduq_review_csrf")
    assert token
    # another instance with the same keys (in another order, one repeated): the token verifies
    two = client(store, api_keys=("x" * 20, KEY, KEY))
    two.cookies.set("guarduq_review_csrf", token)
    r = two.post(f"/items/{ids[0]}/label", data={"label": "wrong", "csrf": token}, headers=bearer,
                 follow_redirects=False)
    assert r.status_code == 303 and store.item(ids[0]).current.label == "wrong"
    assert two.get("/", headers=bearer).cookies.get("guarduq_review_csrf") is None  # kept, not re-minted
    # an instance with other keys does not accept it
    other = client(store, api_keys=(KEY, "y" * 20))
    other.cookies.set("guarduq_review_csrf", token)
    r = other.post(f"/items/{ids[1]}/label", data={"label": "wrong", "csrf": token}, headers=bearer)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_invalid"
    assert store.item(ids[1]).labels == []
    # an explicit secret wins over the keys
    fixed = client(store, api_keys=(KEY, "x" * 20), csrf_secret=b"s" * 32)
    fixed.cookies.set("guarduq_review_csrf", token)
    assert fixed.post(f"/items/{ids[1]}/label", data={"label": "right", "csrf": token},
                      headers=bearer).status_code == 403
    # without keys (loopback, one process) each instance keeps its own random secret
    a, b = client(store), client(store)
    t = csrf(a)
    b.cookies.set("guarduq_review_csrf", t)
    assert b.post(f"/items/{ids[1]}/label", data={"label": "right", "csrf": t}).status_code == 403
    assert store.item(ids[1]).labels == []


def test_csrf_secret_from_keys() -> None:
    s = csrf_secret_from_keys((KEY, "x" * 20))
    assert len(s) == 32 and s == csrf_secret_from_keys(("x" * 20, KEY)) == csrf_secret_from_keys((KEY, KEY, "x" * 20))
    assert s != csrf_secret_from_keys((KEY,)) and s != csrf_secret_from_keys((KEY, "x" * 21))
    assert csrf_secret_from_keys(("ab", "c")) != csrf_secret_from_keys(("a", "bc"))  # unambiguous input
    assert KEY.encode() not in s
    with pytest.raises(ValueError):
        csrf_secret_from_keys(())
    with pytest.raises(Exception, match="at least 16 bytes"):
        ReviewPageSettings(csrf_secret=b"short")


def test_text_is_escaped(store: Store) -> None:
    r = reply(7, prompt=[{"role": "user", "content": XSS_PROMPT}, {"role": "<b>x</b>", "content": "hi"}],
              response=XSS_ANSWER, tokens=["Yes", ' <img src=x onerror="window.__pwned=1">', " it is"],
              token_probs=[0.9, 0.1, 0.8])
    store.record(r, UNIFORM)
    store.record(reply(8, prompt=XSS_PROMPT, response=XSS_ANSWER), UNIFORM)
    store.add_label(r.request_id, reviewer="<script>x</script>", label="wrong",
                    note="<img src=x onerror=alert(1)>", corrected="</textarea><script>alert(2)</script>")
    c = client(store)
    for path in ("/", f"/items/{r.request_id}", "/items/req0008"):
        page = c.get(path).text
        assert "<script>window" not in page and "<img src=x" not in page and "<script>alert" not in page
        assert "<script>x" not in page
        assert htmllib.escape("<script>window.__pwned=1;alert(1)</script>", quote=False) in page or path == "/"
    item = c.get(f"/items/{r.request_id}").text
    assert "&lt;script&gt;window.__pwned=1;alert(1)&lt;/script&gt;" in item
    assert "&lt;img src=x onerror=&#34;window.__pwned=1&#34;&gt;" in item
    assert "&lt;/textarea&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in item
    assert "&lt;b&gt;x&lt;/b&gt;" in item
    queue = c.get("/").text
    assert "Yes &lt;img src=x onerror=&#34;window.__pwned=1&#34;&gt; it is" in queue
    # the only scripts are the page's own file
    assert item.count("<script") == 1 and '<script src="/static/review.js" defer></script>' in item


def test_security_headers(store: Store) -> None:
    fill(store, 1)
    c = client(store)
    for r in (c.get("/"), c.get("/items/req0000"), c.get("/items/none"), c.get("/?page=x"),
              c.get("/static/review.css"), client(store, host=("10.0.0.1", 1)).get("/")):
        h = r.headers
        assert h["content-security-policy"].startswith("default-src 'self'; script-src 'self'")
        assert "unsafe-inline" not in h["content-security-policy"]
        assert h["x-content-type-options"] == "nosniff" and h["x-frame-options"] == "DENY"
        assert h["referrer-policy"] == "no-referrer"
        assert h["cache-control"] == ("private, max-age=3600" if r.url.path.startswith("/static/") else "no-store")


def test_settings_are_checked() -> None:
    from guarduq.errors import InputError

    for bad in ({"alpha": 1.5}, {"delta": 0}, {"page_size": 0}, {"reviewer_default": ""},
                {"threshold_fraction": 0}):
        with pytest.raises(InputError):
            ReviewPageSettings(**bad)


def test_store_failure_is_a_503_not_a_traceback(store: Store) -> None:
    fill(store, 1)
    app = create_review_app(store)
    store.close()
    r = page_client(app, ("127.0.0.1", 1)).get("/")
    assert r.status_code == 503 and "store" in r.json()["error"]["message"]
