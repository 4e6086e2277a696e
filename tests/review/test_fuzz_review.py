"""Property test of the review page's inputs: generated query strings, paths and form bodies
never get a 5xx, and a refused form writes no label."""

from __future__ import annotations

import tempfile
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guarduq.review import create_review_app
from guarduq.store import Store
from tests.review.conftest import fill, page_client
from tests.unit.fuzz_support import COUNTS, examples

pytestmark = pytest.mark.fuzz

_DIR = tempfile.TemporaryDirectory(prefix="guarduq-review-fuzz-")
STORE = Store(f"sqlite:///{Path(_DIR.name) / 'store.db'}")
IDS = fill(STORE, 6)


def _client():  # noqa: ANN202 - TestClient
    c = page_client(create_review_app(STORE))
    c.get("/")
    return c


CLIENT = _client()
TOKEN = CLIENT.cookies.get("guarduq_review_csrf")
FIELDS = ["reason", "action", "risk_min", "risk_max", "labelled", "current", "unlabelled_first", "page",
          "done", "prev", "since", "label", "note", "corrected", "csrf", "reviewer", "x"]
values = (st.sampled_from(["", "uniform", "band", "escalation", "allow", "abstain", "true", "false", "0",
                           "1", "0.5", "-1", "1e308", "nan", "inf", "2025-01-01", "right", "wrong", "unsure",
                           "10000000000000000000000", TOKEN or "t"])
          | st.text(max_size=40))
params = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), values, max_size=6)
paths = st.sampled_from(["/", "/export.jsonl", *(f"/items/{i}" for i in IDS)]) \
    | st.text(max_size=30).map(lambda s: "/items/" + quote(s, safe=""))


@examples(300)
@given(paths, params)
def test_no_generated_page_request_gets_a_5xx(path: str, query: dict[str, str]) -> None:
    r = CLIENT.get(path + ("?" + urlencode(query) if query else ""))
    assert r.status_code < 500, (path, query, r.text[:300])
    COUNTS["review: GET page"] += 1


@examples(300)
@given(st.sampled_from(IDS), params, st.booleans(), st.sampled_from(["/label", ""]))
def test_no_generated_form_gets_a_5xx(rid: str, form: dict[str, str], with_token: bool, kind: str) -> None:
    if with_token:
        form = {**form, "csrf": TOKEN}
    before = len(STORE.item(rid).labels)
    url = f"/items/{rid}/label" if kind else "/reviewer"
    r = CLIENT.post(url, data=form, follow_redirects=False)
    assert r.status_code < 500, (form, r.text[:300])
    if r.status_code != 303 or not kind:
        assert len(STORE.item(rid).labels) == before
    COUNTS["review: POST form"] += 1
