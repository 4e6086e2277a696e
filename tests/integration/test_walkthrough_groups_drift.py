"""The README walkthrough goes on (issue 35): a certificate per kind of traffic, and drift that acts.

The same commands as ``test_walkthrough.py`` (real SmolLM2 behind ``guarduq serve`` with a
sqlite store, ``--review`` and an admin key; ``guarduq calibrate --dataset reviews``; ``POST
/admin/reload``), with a policy that also says

    groups: {from_metadata: true, fallback: escalate}
    on_drift: {unseen: {action: escalate}}

and clients that name their kind of traffic in the OpenAI body's ``metadata.group``.

(A) Two groups labelled enough get a certificate each, a third with one label gets none: after
the reload a reply in a certified group is decided with its own group's threshold, one in the
third group is escalated (the fallback), and ungrouped traffic keeps the pooled threshold.
(B) The reloaded calibrator's drift reference is the labelled uniform sample, per group. With
``--drift-window 10`` the labelled kinds of traffic read ``ok`` (or a certified group's slice);
requests to translate into French, a kind nobody labelled, read ``unseen``, and from the first
reply that says so every reply is escalated.

Labels go through the review page's own form (its CSRF cookie and token), as its ``r``/``w``
keys post them; ``test_walkthrough.py`` types them in a browser.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from guarduq.calibration.labels import alias_match
from guarduq.calibration.splits import split_of
from guarduq.policy import Policy
from guarduq.store import Store
from tests.integration.walkthrough_helpers import ADMIN, GUARDUQ, TRIVIAQA, chat, my_folder, serving

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long]

POLICY_EXTRA = """\
groups:
  from_metadata: true
  fallback: escalate
on_drift:
  unseen: {action: escalate}
"""
WINDOW = 10  # --drift-window: the case is first read after 10 replies, then every 10
# One torch thread per process (unless OMP_NUM_THREADS says otherwise): the server and calibrate
# never compute at once, and beside other jobs on 2 cores two threads per process ran several times slower.
THREADS = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
Question = tuple[str, list[str]]
# Two kinds of traffic SmolLM2-135M answers right at 16 tokens, every one of these checked (greedy
# decoding: the same text each time, so a question may repeat; each request has its own id).
GEOGRAPHY: list[Question] = [
    ("What is the capital of France?", ["Paris"]), ("What is the capital of Japan?", ["Tokyo"]),
    ("What is the capital of Germany?", ["Berlin"]), ("What is the capital of England?", ["London"]),
    ("What is the capital of Russia?", ["Moscow"]), ("What is the capital of Egypt?", ["Cairo"]),
    ("What is the capital of China?", ["Beijing"]), ("Which ocean is the largest?", ["Pacific"]),
    ("What language is spoken in Brazil?", ["Portuguese"]), ("What language is spoken in Mexico?", ["Spanish"]),
]
SCIENCE: list[Question] = [
    ("What is 2 + 2?", ["4", "four"]), ("How many days are in a week?", ["seven", "7"]),
    ("Which planet is known as the Red Planet?", ["Mars"]), ("What is the chemical symbol for water?", ["H2O"]),
    ("How many sides does a triangle have?", ["three", "3"]),
    ("What gas do plants absorb from the air?", ["carbon dioxide", "CO2"]),
]
CERTIFIED = {"geography": GEOGRAPHY, "science": SCIENCE}
# 30 labels per group: the drift case needs two reference groups of drift_groups.MIN_GROUP = 30.
PER_GROUP = 30
# Each uniform label lands in the threshold split with probability 0.2 (by its random id's hash).
# A group's certificate at alpha 0.7 rests on its own threshold-split labels: with every answer
# right it needs at least 2 accepted ones, and a few more where the threshold rule leaves some
# out; 4 gave a certificate in every trial while writing this test. Label on until then.
MIN_THRESHOLD = 4
N_TRIVIAQA = 14  # mostly wrong: the pooled risk model needs wrong answers to fit
# Sentences to translate: none of the labelled traffic asks for this. In trials while writing
# this test, windows of 10 of their replies read `unseen` against such a reference every time,
# well past every threshold (SST-2 sentiment prompts only about half the time, else
# slice:science; BoolQ passages mostly ok), so they are the unlabelled kind here.
TRANSLATE = [
    "The weather is nice today.", "I would like a cup of tea.", "Where is the train station?",
    "My brother lives in London.", "We are going to the beach tomorrow.", "The book is on the table.",
    "She plays the piano every evening.", "How much does this cost?", "I have two cats and a dog.",
    "The museum opens at nine.", "Please close the door.", "They ate dinner at a small restaurant.",
    "It is raining again.", "Can you help me?", "The children are playing outside.", "I forgot my umbrella.",
    "This is my favourite song.", "The shop is closed on Sundays.", "He works in a hospital.",
    "We watched a film last night.", "The garden is full of flowers.", "I am learning to cook.",
    "The bus is late.", "My phone is broken.", "The sky is very blue.", "She wrote a letter to her friend.",
    "The coffee is too hot.", "I need a new pair of shoes.", "The river flows to the sea.",
    "Our teacher is very kind.", "The train leaves at noon.", "I like to read in bed.",
    "The soup needs more salt.", "We planted a tree in the park.", "My sister speaks three languages.",
    "The cat is sleeping on the sofa.", "It is cold in the winter.", "He lost his keys again.",
    "The baker opens early.", "We walked along the river.", "The window is open.",
    "I will call you tomorrow.", "The market is busy on Saturdays.", "She bought a red coat.",
]
# The loop below sends at most 3 * WINDOW sentences before the first `unseen` (it fails past
# 4 * WINDOW replies since the reload, WINDOW + 1 of which are labelled kinds), then WINDOW more.
assert len(TRANSLATE) >= 4 * WINDOW


def trivia(n: int) -> list[Question]:
    """TriviaQA questions (../shared/data), which SmolLM2 mostly gets wrong."""
    from guarduq.calibration.datasets import load_dataset

    return [(it.prompt, list(it.answers)) for it in load_dataset("triviaqa", TRIVIAQA, limit=n).items]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Steps 1 and 2, with the groups and on_drift sections and a small drift window."""
    mine = my_folder(tmp_path, POLICY_EXTRA)
    with serving(mine / "policy.yaml", tmp_path, "--drift-window", str(WINDOW), env=THREADS) as srv:
        yield {**srv, "mine": mine}


class Reviewer:
    """Step 4 without a browser: the review page's label form over HTTP (a CSRF cookie from
    the page, the same token in the form), as the page's keys post it."""

    def __init__(self, base: str, store: Store) -> None:
        self.page = httpx.Client(base_url=base + "/review", timeout=60)
        assert self.page.get("/").status_code == 200  # sets the CSRF cookie
        self.store = store

    def label(self, request_id: str, answers: list[str]) -> bool:
        """Right or wrong by the known answers; returns the verdict."""
        deadline = time.monotonic() + 30
        while (item := self.store.item(request_id)) is None:  # the store's writer is a background thread
            assert time.monotonic() < deadline, f"reply {request_id} never reached the review queue"
            time.sleep(0.1)
        assert item.reply.response is not None
        right = alias_match(item.reply.response, answers)
        r = self.page.post(f"/items/{request_id}/label", data={
            "label": "right" if right else "wrong", "csrf": self.page.cookies["guarduq_review_csrf"]})
        assert r.status_code == 303, (r.status_code, r.text[:300])
        return right

    def close(self) -> None:
        self.page.close()


def _ask(base: str, question: str, group: str | None = None) -> dict[str, Any]:
    return chat(base, question, **({"metadata": {"group": group}} if group else {}))


def _row(store: Store, request_id: str) -> Any:
    """A reply's store row, once the background writer has put it there."""
    deadline = time.monotonic() + 30
    while (row := store.reply(request_id)) is None:
        assert time.monotonic() < deadline, f"reply {request_id} never reached the store"
        time.sleep(0.1)
    return row


@pytest.mark.skipif(not TRIVIAQA.is_file(), reason=f"TriviaQA not found at {TRIVIAQA} (set GUARDUQ_DATA)")
def test_groups_get_their_own_certificates_and_an_unseen_window_escalates(
    server: dict[str, Any], tmp_path: Path
) -> None:
    base, mine = server["base"], server["mine"]
    review = Policy.from_yaml(mine / "policy.yaml").config.review
    fractions = {"test_fraction": review.test_fraction, "threshold_fraction": review.threshold_fraction}
    more_trivia = trivia(N_TRIVIAQA + 20)

    # Step 3: traffic of three named kinds and some without a name, eight clients at a time (the
    # server batches them: about twice as fast here as one at a time).
    plan: list[tuple[Question, str | None]] = [
        *((q, "geography") for q in (GEOGRAPHY * 3)[:PER_GROUP]),
        *((q, "science") for q in (SCIENCE * 5)[:PER_GROUP]),
        *((q, None) for q in more_trivia[:N_TRIVIAQA]),
        (GEOGRAPHY[0], "rare"),  # one label: a certificate needs 2 accepted even without errors
    ]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda item: _ask(base, item[0][0], item[1]), plan))
    for (_, group), reply in zip(plan, replies, strict=True):
        g = reply["guarduq"]
        assert g["in_force"]["group"] == group
        if group is not None:  # the shipped calibrator certifies no group: each falls back (escalate)
            assert g["in_force"]["certificate"] == "override" and g["decision"]["action"] == "escalate", g

    # Step 4: label every reply; on, as a reviewer would, until each certified group's threshold
    # split holds MIN_THRESHOLD labels and the fit split two wrong answers.
    store = Store(server["store"])
    reviewer = Reviewer(base, store)
    try:
        asked: dict[str, tuple[str | None, bool]] = {}  # request id -> (group, right)
        for ((_, answers), group), reply in zip(plan, replies, strict=True):
            rid = reply["guarduq"]["request_id"]
            asked[rid] = (group, reviewer.label(rid, answers))

        def split(rid: str) -> str:
            return split_of(f"reviews:{rid}", **fractions)

        def in_threshold(group: str) -> int:
            return sum(g == group and split(rid) == "threshold" for rid, (g, _) in asked.items())

        extra = {name: iter(qs * 3) for name, qs in CERTIFIED.items()}
        spare = iter(more_trivia[N_TRIVIAQA:])
        for _ in range(40):
            short = [name for name in CERTIFIED if in_threshold(name) < MIN_THRESHOLD]
            if not short and sum(not right and split(rid) == "fit" for rid, (_, right) in asked.items()) >= 2:
                break
            group = short[0] if short else None
            nxt = next(extra[group], None) if group else next(spare, None)
            if nxt is None:
                pytest.fail(f"ran out of {group or 'TriviaQA'} questions before each split held its labels")
            (question, answers) = nxt
            rid = _ask(base, question, group)["guarduq"]["request_id"]
            asked[rid] = (group, reviewer.label(rid, answers))
        else:
            pytest.fail("40 more labels left a split short")
        for name in CERTIFIED:  # the list holds only questions SmolLM2 answers right
            assert all(right for g, right in asked.values() if g == name), f"a {name} question was answered wrong"
        assert store.progress()["labelled"] == len(asked)

        # Step 5: recalibrate from the labels. Two certificates, none for the group with one label.
        step5 = [GUARDUQ, "calibrate", "--dataset", "reviews", "--store", server["store"], "--policy",
                 str(mine / "policy.yaml"), "--out", str(mine / "calibrator.json"), "--work", str(tmp_path / "runs"),
                 "--no-progress", "--json"]
        out = subprocess.run(step5, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env={**os.environ, **THREADS})
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout)
        assert report["reviews"]["uniform"] == len(asked)
        pooled = report["thresholds"][0]["threshold"]
        assert pooled is not None
        groups = {name: ts[0] for name, ts in report["reviews"]["groups"].items()}
        for name in CERTIFIED:  # each certified on its own threshold-split labels only
            assert groups[name]["threshold"] is not None, groups[name]
            assert groups[name]["n"] == in_threshold(name) and groups[name]["errors"] == 0
        assert groups.get("rare") is None or groups["rare"]["threshold"] is None  # absent: its label is not in the split

        # Step 6: hot reload; replies now name the new calibrator and the certificate that decided them.
        r = httpx.post(base + "/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
        assert r.status_code == 200 and r.json()["new"]["calibrator_sha256"] == report["sha256"], r.text
        seen: list[dict[str, Any]] = []  # every reply from the reload on, in order

        def ask(question: str, group: str | None = None) -> dict[str, Any]:
            reply = _ask(base, question, group)
            seen.append(reply["guarduq"])
            assert reply["guarduq"]["calibrator_sha256"] == report["sha256"]
            return reply

        for name, qs in CERTIFIED.items():  # (A) its own threshold
            g = ask(qs[0][0], name)["guarduq"]
            assert g["in_force"]["group"] == name and g["in_force"]["certificate"] == "group", g["in_force"]
            assert g["in_force"]["override"] is None
            assert g["decision"]["threshold"] == groups[name]["threshold"]
            assert g["decision"]["action"] == ("allow" if g["risk"] <= groups[name]["threshold"] else "abstain")
        rare = ask(GEOGRAPHY[1][0], "rare")  # (A) no certificate of its own: the fallback
        g = rare["guarduq"]
        assert (g["in_force"]["certificate"], g["in_force"]["override"]) == ("override", "group_fallback")
        assert "'rare' has no certificate of its own" in g["in_force"]["reason"]
        assert g["decision"]["action"] == "escalate" and not g["decision"]["shown"]
        assert rare["choices"][0]["finish_reason"] == "content_filter"
        row = _row(store, g["request_id"])
        assert (row.group, row.action, row.shown) == ("rare", "escalate", False)
        g = ask(more_trivia[0][0])["guarduq"]  # no group: the pooled threshold
        assert (g["in_force"]["group"], g["in_force"]["certificate"]) == (None, "pooled")
        assert g["decision"]["threshold"] == pooled

        # (B) The labelled kinds fill the window and read ok, or a certified group's slice.
        for i in range(WINDOW + 1 - len(seen)):
            name = list(CERTIFIED)[i % 2]
            ask(CERTIFIED[name][1 + i // 2][0], name)
        assert len(seen) == WINDOW + 1
        assert [g["in_force"]["drift"] for g in seen[:WINDOW]] == [None] * WINDOW  # still filling
        labelled_reads = seen[WINDOW]["in_force"]["drift"]
        assert labelled_reads in ("ok", "slice:geography", "slice:science"), labelled_reads
        # Traffic nobody labelled, until a reply reads unseen: the rules decided every one before.
        sentences = iter(TRANSLATE)
        while seen[-1]["in_force"]["drift"] != "unseen":
            assert len(seen) <= 4 * WINDOW, [g["in_force"]["drift"] for g in seen]
            ask(f"Translate into French: {next(sentences)}")  # the budget above is checked at import
        first = len(seen) - 1
        for g in seen[WINDOW:first]:
            assert g["in_force"]["drift"] in ("ok", "slice:geography", "slice:science"), g["in_force"]
            assert g["in_force"]["override"] is None and g["decision"]["action"] != "escalate"
        # From then on every reply is escalated, past the next reading of the window too, and a
        # certified group's own threshold gives way: the traffic itself is unmeasured.
        for sentence in list(sentences)[:WINDOW]:
            ask(f"Translate into French: {sentence}")
        ask(GEOGRAPHY[2][0], "geography")
        assert len(seen) - first > WINDOW
        for g in seen[first:]:
            assert g["in_force"]["drift"] == "unseen" and g["in_force"]["override"] == "on_drift_unseen", g["in_force"]
            assert g["decision"]["action"] == "escalate" and not g["decision"]["shown"]
            row = _row(store, g["request_id"])
            assert (row.drift, row.action) == ("unseen", "escalate")
        assert seen[-1]["in_force"]["group"] == "geography"
        assert httpx.get(base + "/readyz").json()["drift_case"] == "unseen"
    finally:
        reviewer.close()
        store.close()
