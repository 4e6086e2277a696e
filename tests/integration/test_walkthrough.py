"""The README's "Calibrate on your own traffic" walkthrough, step by step, as a user runs it:
real SmolLM2 behind ``guarduq serve`` with a store and the review page, labels typed in a real
browser, ``guarduq calibrate --dataset reviews``, and a hot reload that later replies name.

With the 28 labels a first session gives, nothing usually certifies at the policy's alpha, and
the loop fails safe: step 5 refuses and leaves the live calibrator untouched; a calibrator written
anyway (``--allow-uncertified``) is refused by the reload with a 422 while the old pair serves;
only an admin's ``?force=true`` puts it live, and then withheld replies say why without quoting a
risk. Without a key, every route refuses a DNS-rebinding Host.

"Usually": at alpha 0.7 as few as three right labels at the lowest risks of the threshold split
can certify (0.3^3 <= delta/2), which a draw of request ids gives now and then (in about one run
of five to ten). The test knows each label and each reply's split, so it asserts what the draw
implies: a refusal whenever the threshold split holds at most two right labels, either outcome
(checked) otherwise. The rest of the walkthrough then goes on down the path the draw took: the
refusals (most runs), or the certified calibrator going live.

Each step below carries the README's step number. Only the labelling is automated (the test
knows each question's answer); everything else is the commands the README gives.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from guarduq.calibration.labels import alias_match
from guarduq.store import Store
from tests.browser_helpers import NEEDS_BROWSER, chrome, press, wait_away
from tests.integration.walkthrough_helpers import ADMIN, GUARDUQ, TRIVIAQA, chat, my_folder, serving
from tests.unit.serve_helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long, NEEDS_BROWSER]

N_TRIVIAQA = 14
# Traffic with known answers: questions SmolLM2 usually gets right, and TriviaQA questions
# (../shared/data) it usually does not, so the labels hold both verdicts.
EASY: list[tuple[str, list[str]]] = [
    ("What is the capital of France?", ["Paris"]),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("What is 2 + 2?", ["4", "four"]),
    ("What colour is the sky on a clear day?", ["blue"]),
    ("What is the largest planet in the solar system?", ["Jupiter"]),
    ("Who wrote Hamlet?", ["Shakespeare"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("Which ocean is the largest?", ["Pacific"]),
    ("What language is spoken in Brazil?", ["Portuguese"]),
    ("How many days are in a week?", ["seven", "7"]),
    ("What is the capital of Italy?", ["Rome"]),
    ("Which planet is known as the Red Planet?", ["Mars"]),
    ("What is the freezing point of water in Celsius?", ["0", "zero"]),
    ("Who painted the Mona Lisa?", ["Leonardo", "da Vinci"]),
]


def questions() -> list[tuple[str, list[str]]]:
    from guarduq.calibration.datasets import load_dataset

    trivia = load_dataset("triviaqa", TRIVIAQA, limit=N_TRIVIAQA)
    return EASY + [(it.prompt, list(it.answers)) for it in trivia.items]


@pytest.fixture
def mine(tmp_path: Path) -> Path:
    """Step 1: a folder with your policy and calibrator (copies of the shipped ones), set to
    sample every reply for review while you start out."""
    return my_folder(tmp_path)


@pytest.fixture
def server(mine: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Step 2: ``guarduq serve`` with a store, the review page and an admin key."""
    with serving(mine / "policy.yaml", tmp_path) as srv:
        yield srv


def _ask(base: str, question: str) -> dict[str, Any]:
    return chat(base, question)["guarduq"]


def _foreign_host_refused(base: str) -> None:
    """A DNS-rebinding page: this server's address under the name attacker.example."""
    host = {"Host": "attacker.example:8000"}
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("GET", "/readyz"), ("GET", "/healthz"), ("POST", "/admin/reload"), ("GET", "/review/")):
        r = httpx.request(method, base + path, headers={**host, "Authorization": f"Bearer {ADMIN}"}, timeout=30,
                          json={"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}
                          if path.startswith("/v1/chat") else None)
        assert r.status_code == 403 and "attacker.example" in r.text, (path, r.status_code, r.text[:300])


def _label_in_browser(base: str, store: Store, asked: dict[str, list[str]]) -> int:
    """Step 4's keyboard loop: open the first unlabelled item, press r or w (the test knows each
    answer), and go on until the queue is empty. Returns how many items were labelled."""
    labelled = 0
    with chrome() as browser:
        browser.get(base + "/review/")
        press(browser, "j")  # open the first unlabelled item
        wait_away(browser, base + "/review/")
        while (path := urlsplit(browser.current_url).path).startswith("/review/items/"):
            rid = path.rsplit("/", 1)[1]
            item = store.item(rid)
            assert item is not None and item.reply.response is not None
            url = browser.current_url
            press(browser, "r" if alias_match(item.reply.response, asked[rid]) else "w")
            wait_away(browser, url)
            labelled += 1
    return labelled


def _splits(asked: dict[str, list[str]], policy: Path) -> dict[str, str]:
    """Each labelled reply's split, by its id hash at the policy's review fractions (every reply
    is in the uniform sample at rate 1.0)."""
    from guarduq.calibration.splits import split_of
    from guarduq.policy import Policy

    review = Policy.from_yaml(policy).config.review
    fractions = {"test_fraction": review.test_fraction, "threshold_fraction": review.threshold_fraction}
    return {rid: split_of(f"reviews:{rid}", **fractions) for rid in asked}


def _empty_splits(asked: dict[str, list[str]], policy: Path) -> set[str]:
    """The threshold and test splits that none of the labelled replies fall in."""
    return {"threshold", "test"} - set(_splits(asked, policy).values())


def _may_certify(threshold_right: int, alpha: float, delta: float) -> bool:
    """Whether any accepted set of the threshold split could certify ``alpha``: each of the README's
    two fixed sequences tests at delta/2, and the most a set with r right labels can show is r
    right of r (more wrong ones only raise the bound), which passes when (1 - alpha)^r <= delta/2."""
    return (1 - alpha) ** threshold_right <= delta / 2


@pytest.mark.skipif(not TRIVIAQA.is_file(), reason=f"TriviaQA not found at {TRIVIAQA} (set GUARDUQ_DATA)")
def test_readme_walkthrough(server: dict[str, Any], mine: Path, tmp_path: Path) -> None:
    base = server["base"]
    traffic = questions()
    shipped = hashlib.sha256((mine / "calibrator.json").read_bytes()).hexdigest()

    _foreign_host_refused(base)

    # Step 3: traffic. Every reply names the calibrator that decided it.
    asked: dict[str, list[str]] = {}
    for question, answers in traffic:
        g = _ask(base, question)
        assert g["calibrator_sha256"] == shipped
        asked[g["request_id"]] = answers
    assert httpx.get(base + "/readyz").json()["calibrator_sha256"] == shipped

    # Step 4: label in the browser at /review, by keyboard: r right, w wrong.
    store = Store(server["store"])
    try:
        assert _label_in_browser(base, store, asked) == len(traffic)
        # Request ids are random, so a few uniform labels leave a split empty about once in 250
        # runs (calibrate then asks for more labels: test_review_calibration). Label on, as a
        # reviewer would, until each split holds one.
        extra = iter(EASY)
        while missing := _empty_splits(asked, mine / "policy.yaml"):
            question, answers = next(extra, (None, None))
            assert question is not None, f"{len(EASY)} more labels left the {missing} split empty"
            asked[_ask(base, question)["request_id"]] = answers
            assert _label_in_browser(base, store, asked) == 1, missing
        progress = store.progress()
        assert progress["labelled"] == len(asked)
        assert 0 < progress["wrong_uniform"] < len(asked)  # both verdicts, or nothing to fit
    finally:
        store.close()

    # Step 5: recalibrate from the reviews, into the file the policy names. 28-odd labels usually
    # certify nothing at the policy's alpha: refused, the live file untouched, how many more it needs.
    live = mine / "calibrator.json"
    step5 = [GUARDUQ, "calibrate", "--dataset", "reviews", "--store", server["store"], "--policy",
             str(mine / "policy.yaml"), "--out", str(live), "--report", str(mine / "report"),
             "--work", str(tmp_path / "runs"), "--no-progress", "--json"]
    in_threshold = [rid for rid, split in _splits(asked, mine / "policy.yaml").items() if split == "threshold"]
    right = sum(alias_match(_reply_text(server["store"], rid), asked[rid]) for rid in in_threshold)
    out = subprocess.run(step5, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    export = next((tmp_path / "runs" / "reviews").glob("reviews-*.jsonl"))
    assert export.stat().st_mode & 0o777 == 0o600  # prompt and reply text: owner only
    if out.returncode == 0:  # the draw put enough right labels at the lowest risks: it certified
        assert _may_certify(right, 0.7, 0.1), (right, out.stdout[-2000:])
        _certified_goes_live(base, json.loads(out.stdout), live, shipped)
        return
    _refused(out, live, shipped)

    # Written anyway, it is refused by the reload (step 6), and the shipped pair keeps serving.
    out = subprocess.run([*step5, "--allow-uncertified"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    new = report["sha256"]
    assert new != shipped and report["reviews"]["uniform"] == len(asked)
    assert sum(report["split_sizes"].values()) == len(asked)
    assert (mine / "report" / "report.html").is_file()
    r = httpx.post(base + "/admin/reload", headers=_ADMIN_HEADERS, timeout=120)
    assert r.status_code == 422 and r.json()["error"]["code"] == "uncertified_pair", r.text
    assert "can never match" in r.json()["error"]["message"]
    assert httpx.get(base + "/readyz").json()["calibrator_sha256"] == shipped
    assert _ask(base, "What is the capital of France?")["calibrator_sha256"] == shipped

    # Step 6 forced by an admin: the new calibrator is live, and a withheld reply says why.
    r = httpx.post(base + "/admin/reload?force=true", headers=_ADMIN_HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] and r.json()["new"]["calibrator_sha256"] == new
    assert httpx.get(base + "/readyz").json()["calibrator_sha256"] == new
    reply = chat(base, "What is the capital of France?")
    text = reply["choices"][0]["message"]["content"]
    assert reply["guarduq"]["calibrator_sha256"] == new and reply["choices"][0]["finish_reason"] == "content_filter"
    assert "no certified risk threshold" in text and "estimated chance" not in text and "%" not in text

    # A restart on that pair (the same README command as step 2) is refused too: exit 2, saying why.
    port = str(free_port())
    out = subprocess.run([GUARDUQ, "serve", "--policy", str(mine / "policy.yaml"), "--port", port],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "--allow-uncertified" in out.stderr and "can never match" in out.stderr, out.stderr[-3000:]


_ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def _certified_goes_live(base: str, report: dict[str, Any], live: Path, shipped: str) -> None:
    """The other outcome of step 5's draw: alpha 0.7 certified, so the file is replaced and step 6
    puts it live with a 200 (the refusals are then left to tests/unit/test_reload.py and
    test_uncertified_live.py, which fix their labels)."""
    fitted = {t["alpha"]: t["threshold"] for t in report["thresholds"]}
    new = hashlib.sha256(live.read_bytes()).hexdigest()
    assert fitted[0.7] is not None and new == report["sha256"] != shipped
    r = httpx.post(base + "/admin/reload", headers=_ADMIN_HEADERS, timeout=120)
    assert r.status_code == 200 and r.json()["new"]["calibrator_sha256"] == new, r.text
    assert _ask(base, "What is the capital of France?")["calibrator_sha256"] == new


def _reply_text(store_url: str, rid: str) -> str:
    store = Store(store_url)
    try:
        item = store.item(rid)
        assert item is not None and item.reply.response is not None
        return item.reply.response
    finally:
        store.close()


def _refused(out: subprocess.CompletedProcess[str], live: Path, shipped: str) -> None:
    """Step 5's refusal: exit 2, saying why and what would do, the live calibrator untouched."""
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-3000:])
    assert "no alpha asked for (0.7) has a certified threshold" in out.stderr and "is left unchanged" in out.stderr
    assert "more labels of the uniform sample needed" in out.stderr or "no number of labels" in out.stderr
    assert hashlib.sha256(live.read_bytes()).hexdigest() == shipped
