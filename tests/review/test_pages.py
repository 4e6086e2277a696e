"""The review page's queue, item page, labelling, progress line and export, on real stores."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from typing import Any

import pytest

from guarduq.calibration.datasets import load_dataset
from guarduq.calibration.sizing import accepted_needed
from guarduq.calibration.thresholds import start_size
from guarduq.errors import StoreInputError
from guarduq.review import progress
from guarduq.store import Filters, Store
from tests.review.conftest import UNIFORM, client, csrf, fill, page_client, reply


def _ids(html: str) -> list[str]:
    """Request ids in the queue table's row links, in order."""
    body = html.split('id="queue"', 1)[1]
    return list(dict.fromkeys(re.findall(r'/items/(req\d{4})', body)))


def test_queue_filters(store: Store) -> None:
    fill(store, 12)
    c = client(store)
    html = c.get("/").text
    assert _ids(html) == [f"req{i:04d}" for i in range(11, -1, -1)]  # newest first, sampled only
    assert "12 items" in html
    esc = _ids(c.get("/?reason=escalation").text)
    assert esc == ["req0009", "req0006", "req0003", "req0000"]
    assert _ids(c.get("/?action=abstain").text) == esc
    assert _ids(c.get("/?reason=uniform&risk_min=0.15&risk_max=0.2").text) == ["req0008", "req0005"]
    assert _ids(c.get("/?risk_min=0.6&risk_max=0.6").text) == ["req0010", "req0007", "req0004", "req0001"]
    # blank fields (an untouched form) mean no filter
    assert len(_ids(c.get("/?reason=&action=&risk_min=&risk_max=&labelled=&current=").text)) == 12


def test_queue_unlabelled_first_and_label_filters(store: Store) -> None:
    ids = fill(store, 6)
    store.add_label(ids[5], reviewer="ann", label="wrong")
    store.add_label(ids[4], reviewer="ann", label="right")
    c = client(store)
    order = _ids(c.get("/").text)
    assert order[-2:] == [ids[5], ids[4]] and order[0] == ids[3]
    assert _ids(c.get("/?unlabelled_first=false").text)[0] == ids[5]
    assert _ids(c.get("/?labelled=true").text) == [ids[5], ids[4]]
    assert _ids(c.get("/?labelled=false").text) == [ids[3], ids[2], ids[1], ids[0]]
    assert _ids(c.get("/?current=wrong").text) == [ids[5]]


def test_queue_pages(store: Store) -> None:
    fill(store, 12)
    c = client(store, page_size=5)
    first, third = c.get("/").text, c.get("/?page=3&reason=").text
    assert len(_ids(first)) == 5 and "page 1 of 3" in first and 'rel="next"' in first
    assert _ids(third) == ["req0001", "req0000"] and 'rel="next"' not in third


def test_item_page_content(store: Store) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    r = reply(1, prompt=messages, response="Paris.", tokens=["Par", "is", "."], token_probs=[0.95, 0.42, 0.05],
              risk=0.8, action="escalate", rule="escalate_risky",
              second_opinion={"mean_prob": 0.31, "variance": 0.02, "mutual_information": 0.004, "agrees": False})
    store.record(r, UNIFORM)
    store.add_label(r.request_id, reviewer="ann", label="unsure", note="check the atlas")
    store.add_label(r.request_id, reviewer="bob", label="right", corrected="Paris")
    html = client(store).get(f"/items/{r.request_id}").text
    assert 'class="msg role-system"' in html and "Be brief." in html and "Capital of France?" in html
    # the answer as shaded tokens with the probability in the tooltip
    assert '<span class="t t0" title="p = 0.95">Par</span>' in html
    assert '<span class="t t3" title="p = 0.42">is</span>' in html
    assert '<span class="t t5" title="p = 0.05">.</span>' in html
    for text in ("0.8", "escalate", "escalate_risky", "uniform", "epistemic", "0.012", "aleatoric",
                 "mean_prob", "0.31", "mutual_information", "check the atlas", "ann", "bob"):
        assert text in html, text
    history = html.split('id="history"', 1)[1]
    assert history.index("bob") < history.index("ann")  # newest first; the current one marked
    assert 'class="current"' in history
    assert 'name="csrf"' in html and 'value="right"' in html and 'value="wrong"' in html
    assert "as plain text" not in html  # the pieces spell the answer


def test_end_of_turn_token_is_a_marker(store: Store) -> None:
    store.record(reply(1, response="Paris.", tokens=["Paris", ".", "<|im_end|>"], token_probs=[0.9, 0.8, 0.3]),
                 UNIFORM)
    store.record(reply(2, response="Caf\u00e9", tokens=["Caf", "\ufffd", "\ufffd"], token_probs=[0.9, 0.5, 0.5]),
                 UNIFORM)
    c = client(store)
    html = c.get("/items/req0001").text
    assert '<span class="t eot t3" title="end of turn: p = 0.3">end</span>' in html
    assert "im_end" not in html and "as plain text" not in html
    html = c.get("/items/req0002").text  # byte pieces that do not spell the text: it is shown too
    assert "as plain text" in html and "Café" in html


def test_item_without_tokens_or_text(store: Store) -> None:
    store.record(reply(1, response="Plain answer."), UNIFORM)
    store.record(replace(reply(2), prompt=None, response=None), UNIFORM)
    c = client(store)
    html = c.get("/items/req0001").text
    assert '<div class="text answer" id="answer">Plain answer.</div>' in html
    html = c.get("/items/req0002").text
    assert "was not kept" in html and c.get("/").status_code == 200


def test_item_without_text_cannot_be_labelled(store: Store) -> None:
    """A reply whose text was not kept (review.keep_text off) shows a note, not the label form,
    and a label posted for it is refused with 409: calibration could never use it."""
    import html as htmllib

    store.record(reply(1), UNIFORM)  # text kept: labelled as usual
    gone = {"req0002": {"prompt": None, "response": None, "tokens": None, "token_probs": None},
            "req0003": {"prompt": None}, "req0004": {"response": None, "tokens": None, "token_probs": None}}
    for rid, missing in gone.items():
        store.record(replace(reply(int(rid[3:])), **missing), UNIFORM)
    c = client(store)
    token = csrf(c)
    kept = c.get("/items/req0001").text
    assert 'id="label-form"' in kept and 'id="not-labellable"' not in kept
    for rid in gone:
        page = c.get(f"/items/{rid}")
        assert page.status_code == 200
        text = htmllib.unescape(page.text)
        assert 'id="label-form"' not in text and 'value="right"' not in text, rid
        assert 'id="not-labellable"' in text and "text was not kept (the policy's review.keep_text is off)" \
            in text and "cannot be labelled for calibration" in text, rid
        for label in ("right", "wrong", "unsure"):
            r = c.post(f"/items/{rid}/label", data={"label": label, "csrf": token}, follow_redirects=False)
            assert r.status_code == 409, (rid, label)
            err = r.json()["error"]
            assert err["code"] == "text_not_kept" and "review.keep_text" in err["message"]
        r = c.post(f"/items/{rid}/label", data={"label": "wrong", "csrf": token},
                   headers={"accept": "text/html"})
        assert r.status_code == 409 and "cannot be labelled for calibration" in htmllib.unescape(r.text)
        assert store.item(rid).labels == [], rid
    # the CSRF check still comes first, and an unknown item is still a 404
    assert c.post("/items/req0002/label", data={"label": "right"}).status_code == 403
    assert c.post("/items/req9999/label", data={"label": "right", "csrf": token}).status_code == 404
    r = c.post("/items/req0001/label", data={"label": "right", "csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and store.item("req0001").current.label == "right"


def test_unknown_item_is_404(store: Store) -> None:
    fill(store, 3)
    c = client(store)
    r = c.get("/items/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    html = c.get("/items/req0900", headers={"accept": "text/html"})  # recorded, not sampled
    assert html.status_code == 404 and "no review item" in html.text
    token = csrf(c)
    assert c.post("/items/nope/label", data={"label": "right", "csrf": token}).status_code == 404


def test_label_round_trip_and_redirect(any_store: Store) -> None:
    ids = fill(any_store, 6)  # queue order (newest first): 5, 4, 3, 2, 1, 0
    c = client(any_store)
    token = csrf(c, f"/items/{ids[5]}")
    r = c.post(f"/items/{ids[5]}/label", data={"label": "wrong", "note": "made up", "corrected": "42",
                                               "csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/items/{ids[4]}?prev={ids[5]}"
    item = any_store.item(ids[5])
    assert item is not None and item.current is not None
    assert (item.current.label, item.current.note, item.current.corrected, item.current.reviewer) == \
        ("wrong", "made up", "42", "reviewer")
    # relabelling keeps the history; the newest label counts
    c.post(f"/items/{ids[5]}/label", data={"label": "right", "note": "", "csrf": token}, follow_redirects=False)
    item = any_store.item(ids[5])
    assert [x.label for x in item.labels] == ["wrong", "right"] and item.current.note is None
    # filters are carried: the next item is the next unlabelled one inside the filter
    r = c.post(f"/items/{ids[3]}/label", data={"label": "right", "csrf": token, "reason": "escalation"},
               follow_redirects=False)
    assert r.headers["location"] == f"/items/{ids[0]}?reason=escalation&prev={ids[3]}"
    r = c.post(f"/items/{ids[0]}/label", data={"label": "right", "csrf": token, "reason": "escalation"},
               follow_redirects=False)
    assert r.headers["location"] == "/?reason=escalation&done=true"  # none left there
    assert "No unlabelled items left" in c.get(r.headers["location"]).text
    # the item page links to the next unlabelled item, and back to where the reviewer came from
    html = c.get(f"/items/{ids[4]}?prev={ids[5]}").text
    assert f'rel="prev" id="prev" href="/items/{ids[5]}"' in html
    assert f'rel="next" id="next" href="/items/{ids[2]}?prev={ids[4]}"' in html


def test_reviewer_name_cookie(store: Store) -> None:
    ids = fill(store, 3)
    c = client(store)
    token = csrf(c)
    r = c.post("/reviewer", data={"reviewer": "  Zoë Li ", "csrf": token}, follow_redirects=False)
    assert r.status_code == 303
    assert "Zoë Li" in c.get("/").text
    c.post(f"/items/{ids[0]}/label", data={"label": "right", "csrf": token})
    assert store.item(ids[0]).current.reviewer == "Zoë Li"
    bad = c.post("/reviewer", data={"reviewer": "a\nb", "csrf": token})
    assert bad.status_code == 400 and "reviewer" in bad.json()["error"]["message"]


def test_progress_line(store: Store) -> None:
    ids = fill(store, 12)  # uniform items: 2, 5, 8, 11
    for i, lab in ((2, "right"), (5, "wrong"), (8, "right"), (11, "right"), (0, "wrong"), (1, "unsure")):
        store.add_label(ids[i], reviewer="ann", label=lab)
    html = client(store, alpha=0.3, delta=0.1).get("/").text
    line = re.search(r'id="progress">(.*?)</p>', html).group(1)
    rate = 1 / 4
    total = math.ceil(max(accepted_needed(0.3, 0.1, rate), start_size(0.3, 0.1)) / 0.3)
    assert line.startswith("5 of 12 labelled (4 from the uniform sample, 1 of them wrong; 1 unsure)")
    assert f"about {total - 4} more uniform labels" in line and "25%" in line
    assert "no α given" in client(store).get("/").text
    high = progress(store.progress(), alpha=0.2, delta=0.1)  # error rate 0.25 >= alpha
    assert high.needed_more is None and "no number of labels" in high.text


def test_progress_counts() -> None:
    p = progress({"items": 500, "labelled": 400, "labelled_uniform": 300, "wrong_uniform": 0},
                 alpha=0.3, delta=0.1)
    assert p.needed_more == 0 and "enough uniform labels" in p.text
    p = progress({}, alpha=0.1, delta=0.05, threshold_fraction=0.5)
    assert p.needed_total == math.ceil(start_size(0.1, 0.05) / 0.5) and p.needed_more == p.needed_total


def test_export_round_trips(store: Store, tmp_path: Any) -> None:
    ids = fill(store, 6)
    store.record(reply(50, prompt=[{"role": "user", "content": "chat?"}]), UNIFORM)
    for i, lab in ((0, "right"), (1, "wrong"), (2, "unsure"), (3, "wrong")):
        store.add_label(ids[i], reviewer="ann", label=lab)
    store.add_label("req0050", reviewer="ann", label="right")
    c = client(store)
    r = c.get("/export.jsonl")
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    assert r.headers["x-guarduq-rows"] == "4"
    path = tmp_path / "labels.jsonl"
    path.write_bytes(r.content)
    ds = load_dataset("jsonl", path)
    got = {(json.dumps(it.prompt), it.response, it.label) for it in ds}
    assert got == {('"question 0?"', "answer 0", 1), ('"question 1?"', "answer 1", 0), ('"question 3?"', "answer 3", 0),
                   ('[{"role": "user", "content": "chat?"}]', "answer 50", 1)}
    assert c.get("/export.jsonl?since=2099-01-01T00:00:00Z").headers["x-guarduq-rows"] == "0"


def test_bad_input_is_a_clear_4xx(store: Store) -> None:
    ids = fill(store, 3)
    c = client(store)
    cases = {
        "/?risk_min=abc": "risk_min",
        "/?risk_min=1.5": "risk_min",
        "/?risk_min=0.8&risk_max=0.2": "risk_min 0.8 is above risk_max 0.2",
        "/?reason=random": "reason: must be one of escalation, uniform, band",
        "/?action=delete": "action: must be one of",
        "/?page=0": "page",
        "/?labelled=maybe": "labelled",
        "/?risk_min=nan": "risk_min",
        "/export.jsonl?since=yesterday": "since",
        f"/items/{ids[0]}?risk_max=x": "risk_max",
    }
    for url, words in cases.items():
        r = c.get(url)
        assert r.status_code == 400, url
        assert words in r.json()["error"]["message"], (url, r.json())
    token = csrf(c)
    for data, words in (({"label": "maybe"}, "label: must be one of right, wrong, unsure"),
                        ({}, "label: Field required"),
                        ({"label": "right", "extra": "1"}, "extra: is not a field of this form"),
                        ({"label": "right", "note": "x" * 5000}, "note"),
                        ({"label": "right", "risk_min": "high"}, "risk_min")):
        r = c.post(f"/items/{ids[0]}/label", data={**data, "csrf": token})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (data, r.json())
    r = c.post(f"/items/{ids[0]}/label", content=b'{"label": "right"}', headers={"content-type": "application/json"})
    assert r.status_code == 415
    r = c.post(f"/items/{ids[0]}/label", content=f"label=right&label=wrong&csrf={token}",
               headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "more than once" in r.json()["error"]["message"]
    r = c.post(f"/items/{ids[0]}/label", content=b"label=right&csrf=" + token.encode() + b"&note=\xff",
               headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    r = c.post(f"/items/{ids[0]}/label", content="x" * 300_000,
               headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 413
    assert store.item(ids[0]).labels == []
    # a browser gets the message as a page
    r = c.get("/?risk_min=abc", headers={"accept": "text/html"})
    assert r.status_code == 400 and "risk_min" in r.text and r.headers["content-type"].startswith("text/html")


def test_mounted_under_a_prefix(store: Store) -> None:
    from fastapi import FastAPI

    from guarduq.review import ReviewPageSettings, mount_review

    ids = fill(store, 3)
    outer = FastAPI()

    @outer.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    mount_review(outer, store, ReviewPageSettings(), prefix="/review")
    c = page_client(outer, ("127.0.0.1", 1))
    html = c.get("/review/").text
    assert f'href="/review/items/{ids[2]}"' in html and 'href="/review/static/review.css"' in html
    assert c.cookies.get("guarduq_review_csrf")
    assert c.get("/review/static/review.js").status_code == 200
    token = c.cookies.get("guarduq_review_csrf")
    r = c.post(f"/review/items/{ids[2]}/label", data={"label": "right", "csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/review/items/{ids[1]}?prev={ids[2]}"
    assert c.get("/healthz").json() == {"status": "ok"}
    fresh = page_client(outer, ("127.0.0.1", 1)).get("/review/")
    assert "Path=/review;" in fresh.headers["set-cookie"]  # the cookies stay inside the prefix


def test_inside_the_serve_app(store: Store, tokenizer: Any) -> None:
    """``guarduq serve --review``: the page under /review next to the OpenAI endpoints, each with
    its own auth (serve: Bearer; review: Basic or Bearer with the same keys)."""
    from guarduq.review import ReviewPageSettings, mount_review
    from tests.unit.serve_helpers import fake_app

    ids = fill(store, 3)
    key = "s" * 20
    app, _ = fake_app(tokenizer, api_keys=(key,))
    policy_alpha = [0.3]
    mount_review(app, store, ReviewPageSettings(api_keys=(key,)), alpha_of=lambda: policy_alpha[0])
    c = page_client(app, ("10.0.0.9", 1))
    assert c.get("/review/").status_code == 401
    bearer = {"authorization": f"Bearer {key}"}
    html = c.get("/review/", headers=bearer).text
    assert f'href="/review/items/{ids[2]}"' in html and "α = 0.3" in html
    policy_alpha[0] = 0.25  # a reloaded policy: the page follows
    assert "α = 0.25" in c.get("/review/", headers=bearer).text
    token = c.cookies.get("guarduq_review_csrf")
    r = c.post(f"/review/items/{ids[2]}/label", data={"label": "wrong", "csrf": token}, headers=bearer,
               follow_redirects=False)
    assert r.status_code == 303 and store.item(ids[2]).current.label == "wrong"
    assert c.get("/v1/models", headers=bearer).status_code == 200
    assert c.get("/healthz").json() == {"status": "ok"}
    assert "content-security-policy" not in c.get("/healthz").headers  # the review's headers stay inside


def test_filter_choices_follow_the_policy_and_store() -> None:
    """The forms spell out the choices; they must stay those of the policy and the store."""
    from typing import get_args

    from guarduq.policy.schema import ACTIONS
    from guarduq.review.forms import Filters, LabelForm
    from guarduq.store.records import LABELS, REASONS

    def choices(model: Any, name: str) -> tuple[str, ...]:
        return tuple(a for a in get_args(get_args(model.model_fields[name].annotation)[0]))

    assert choices(Filters, "reason") == REASONS and choices(Filters, "action") == ACTIONS
    assert choices(Filters, "current") == LABELS
    assert get_args(LabelForm.model_fields["label"].annotation) == LABELS


def test_queue_and_progress_per_traffic_group(store: Store) -> None:
    """Each group's certificate counts its own uniform labels: the page filters and counts by group."""
    for i in range(6):
        store.record(reply(i, group="legal" if i % 2 else "support"), UNIFORM)
    store.record(reply(6), UNIFORM)  # no group
    for i, lab in ((1, "wrong"), (3, "right"), (0, "right")):
        store.add_label(f"req{i:04d}", reviewer="ann", label=lab)
    c = client(store, alpha=0.3, delta=0.1)
    html = c.get("/").text
    assert 'name="group"' in html and "legal (3)" in html and "support (3)" in html
    legal = c.get("/?group=legal").text
    assert _ids(legal) == ["req0005", "req0003", "req0001"]
    line = re.search(r'id="progress">(.*?)</p>', legal).group(1)
    assert line.startswith("2 of 3 labelled (2 from the uniform sample, 1 of them wrong")
    everything = re.search(r'id="progress">(.*?)</p>', html).group(1)
    assert everything.startswith("3 of 7 labelled")
    # the next unlabelled item stays inside the group (req0005 is legal's only unlabelled one)
    assert store.next_unlabelled(after="req0005", group="legal") is None
    assert store.next_unlabelled(after="req0005") == "req0004"  # without the group: the next older one
    assert c.get("/?group=" + "x" * 65).status_code == 400
    # the group is one field of the store's one Filters object: form -> selection -> store
    from guarduq.review.forms import QueuePage
    q = QueuePage(group="legal", labelled=False)
    assert q.selection() == Filters(group="legal", labelled=False)
    assert _ids_of(store.queue(q.selection())) == ["req0005"]
    assert store.count(Filters(group="support")) == 3
    with pytest.raises(StoreInputError, match="group must be a non-empty string"):
        Filters(group="")


def _ids_of(rows: list) -> list[str]:
    return [r.request_id for r in rows]
