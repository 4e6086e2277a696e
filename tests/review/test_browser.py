"""The review page in a real browser (headless Debian chromium through Selenium): labelling by
keyboard only, at a measured pace, with hostile text on the page.

Set ``GUARDUQ_SCREENSHOTS=1`` to (re)write ``docs/review/queue.png`` and ``item.png``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from guarduq.review import ReviewPageSettings, create_review_app
from guarduq.store import Store
from guarduq.store.records import Sample
from tests.browser_helpers import NEEDS_BROWSER, chrome, press, wait_away
from tests.review.conftest import XSS_ANSWER, XSS_PROMPT, reply
from tests.unit.serve_helpers import serving

pytestmark = [pytest.mark.slow, NEEDS_BROWSER]
pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "review"
N_ITEMS = 30
QA = [  # (question, answer tokens, their probabilities, right?)
    ("What is the capital of Australia?", ["The", " capital", " of", " Australia", " is", " Sydney", "."],
     [0.91, 0.97, 0.99, 0.98, 0.95, 0.18, 0.93], False),
    ("How many legs does a spider have?", ["A", " spider", " has", " eight", " legs", "."],
     [0.88, 0.96, 0.97, 0.72, 0.99, 0.97], True),
    ("Who wrote 'Pride and Prejudice'?", ["Jane", " Austen", " wrote", " it", "."],
     [0.64, 0.97, 0.55, 0.61, 0.9], True),
    ("What is the boiling point of water at sea level in Fahrenheit?", ["It", " boils", " at", " 100", "°F", "."],
     [0.7, 0.81, 0.95, 0.07, 0.33, 0.92], False),
    ("Which planet is known as the Red Planet?", ["Mars", "."], [0.97, 0.95], True),
]


def _sample(i: int) -> Sample:
    if i % 5 == 3:
        return Sample(("escalation",), False, 0.05, 1.0, 1.0)
    if i % 5 == 4:
        return Sample(("band", "uniform"), True, 0.05, 0.3, 0.335)
    return Sample(("uniform",), True, 0.05, 0.0, 0.05)


def _fill(store: Store) -> dict[str, str]:
    """``N_ITEMS`` sampled replies; returns request id -> the true label. Item 13 is hostile."""
    truth = {}
    for i in range(N_ITEMS):
        q, toks, probs, right = QA[i % len(QA)]
        mean = sum(probs) / len(probs)
        risk = round(min(0.98, 1.15 - mean + (i % 7) / 50), 3)
        action = "escalate" if i % 5 == 3 else ("allow" if risk < 0.5 else "abstain")
        kw: dict[str, Any] = {"prompt": [{"role": "system", "content": "Answer in one sentence."},
                                         {"role": "user", "content": q}],
                              "response": "".join(toks), "tokens": [*toks, "<|im_end|>"],
                              "token_probs": [*probs, 0.62 if right else 0.21]}
        if i == 13:
            kw = {"prompt": [{"role": "user", "content": XSS_PROMPT}], "response": XSS_ANSWER,
                  "tokens": ["Yes", ' <img src=x onerror="window.__pwned=1">', " it is"],
                  "token_probs": [0.9, 0.2, 0.6]}
        if action == "escalate":
            kw["second_opinion"] = {"mean_prob": round(mean - 0.2, 3), "variance": 0.031,
                                    "mutual_information": 0.0042, "agrees": False}
        r = reply(i, risk=risk, action=action, rule={"allow": "confident", "abstain": "uncertain",
                                                     "escalate": "escalate_risky"}[action], **kw)
        r = replace(r, scores={**r.scores, "mean_token_prob": round(mean, 4),
                               "aleatoric": round(mean * (1 - mean), 4),
                               "epistemic": round(0.004 + (i % 9) * 0.0031, 4), "n_tokens": len(kw["tokens"])})
        store.record(r, _sample(i))
        truth[r.request_id] = "right" if (right and i != 13) else "wrong"
    return truth


@pytest.fixture
def browser() -> Iterator[Any]:
    with chrome() as driver:
        yield driver


def _item_id(url: str) -> str | None:
    path = urlsplit(url).path
    return path.rsplit("/", 1)[1] if path.startswith("/items/") else None


def test_label_by_keyboard(tmp_path: Path, browser: Any) -> None:
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    truth = _fill(store)
    shots = os.environ.get("GUARDUQ_SCREENSHOTS") == "1"
    try:
        with serving(create_review_app(store, ReviewPageSettings(alpha=0.3, reviewer_default="selenium"))) as port:
            base = f"http://127.0.0.1:{port}"
            browser.get(base + "/")
            assert "30 items" in browser.find_element(By.CLASS_NAME, "count").text
            if shots:
                DOCS.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(DOCS / "queue.png"))

            # the keyboard is ignored while typing: "/" focuses the note, letters go into it
            press(browser, "j")  # the queue's j opens its first item
            wait_away(browser, base + "/")
            first = browser.current_url
            press(browser, "/")
            browser.switch_to.active_element.send_keys("wrong unit r w")
            assert browser.current_url == first
            assert browser.find_element(By.ID, "note").get_attribute("value") == "wrong unit r w"
            browser.switch_to.active_element.send_keys(Keys.ESCAPE)  # leave the box: keys work again

            labelled: list[str] = []
            t0 = time.perf_counter()
            while (rid := _item_id(browser.current_url)) is not None:
                if rid == "req0013":
                    text = browser.find_element(By.ID, "conversation").text
                    assert "<script>window.__pwned=1;alert(1)</script>" in text
                    assert '<img src=x onerror="window.__pwned=1">' in text
                    assert browser.execute_script("return window.__pwned") is None
                    assert not browser.find_elements(By.CSS_SELECTOR, "#conversation img, #conversation script")
                url = browser.current_url
                press(browser, "r" if truth[rid] == "right" else "w")
                wait_away(browser, url)
                labelled.append(rid)
            elapsed = time.perf_counter() - t0
            per_minute = len(labelled) / elapsed * 60
            print(f"\nlabelled {len(labelled)} items by keyboard in {elapsed:.1f} s: {per_minute:.0f} labels/minute")
            assert len(labelled) == N_ITEMS and len(set(labelled)) == N_ITEMS
            assert per_minute >= 20
            assert "No unlabelled items left" in browser.find_element(By.TAG_NAME, "main").text
            if shots:
                browser.get(f"{base}/items/req0028")
                browser.save_screenshot(str(DOCS / "item.png"))

            # k goes back to the previous item; j moves on; the history shows the label
            browser.get(f"{base}/items/req0005")
            press(browser, "j")
            wait_away(browser, f"{base}/items/req0005")
            assert _item_id(browser.current_url) != "req0005"
            press(browser, "k")
            WebDriverWait(browser, 10).until(lambda d: _item_id(d.current_url) == "req0005")
            assert truth["req0005"] in browser.find_element(By.ID, "history").text
            assert browser.execute_script("return window.__pwned") is None

        for rid, label in truth.items():
            item = store.item(rid)
            assert item is not None and item.current is not None, rid
            assert item.current.label == label and item.current.reviewer == "selenium", rid
        first_id = _item_id(first)
        assert store.item(first_id).current.note == "wrong unit r w"
        assert sum(len(store.item(r).labels) for r in truth) == N_ITEMS  # no double posts
    finally:
        store.close()
