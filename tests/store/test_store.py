"""The Store's API on SQLite and PostgreSQL: records, labels, the queue, progress, export."""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from guarduq.calibration.datasets import load_dataset
from guarduq.errors import InputError, StoreError, StoreInputError, UnknownItemError
from guarduq.store import Filters, Store
from guarduq.store.records import PREVIEW_CHARS, ReviewItem, Sample
from tests.store.support import (
    BAND,
    ESCALATION,
    ESCALATION_UNIFORM,
    NOT_SAMPLED,
    T0,
    UNIFORM,
    reply,
)


def fill(store: Store) -> None:
    """Twelve items (i = 0..11): every third an escalation (risk 0.9, escalate), every third a
    band item (risk 0.6), the rest uniform (risk 0.1 + i/100); plus two replies not sampled."""
    for i in range(12):
        if i % 3 == 0:
            store.record(reply(i, risk=0.9, action="escalate"), ESCALATION)
        elif i % 3 == 1:
            store.record(reply(i, risk=0.6), BAND)
        else:
            store.record(reply(i, risk=round(0.1 + i / 100, 2)), UNIFORM)
    store.record(reply(900), NOT_SAMPLED)
    store.record(reply(901), None)


# ---------------------------------------------------------------------------- records


def test_record_and_item_round_trip(store: Store) -> None:
    r = reply(1, second_opinion={"risk": 0.4, "members": [0.1, 0.2]}, ended=False)
    store.record(r, ESCALATION_UNIFORM)
    item = store.item(r.request_id)
    assert isinstance(item, ReviewItem)
    assert item.reply == r
    assert item.reply.time.tzinfo is not None and item.reply.time == T0 + timedelta(minutes=1)
    assert item.sample == ESCALATION_UNIFORM
    assert item.labels == [] and item.current is None
    assert store.item("nope") is None


def test_chat_prompt_and_missing_text_round_trip(store: Store) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    store.record(reply(1, prompt=chat), UNIFORM)
    store.record(reply(2, prompt=None, response=None, tokens=None, token_probs=None, risk=None), UNIFORM)
    assert store.item("req0001").reply.prompt == chat  # type: ignore[union-attr]
    bare = store.item("req0002").reply  # type: ignore[union-attr]
    assert (bare.prompt, bare.response, bare.tokens, bare.token_probs, bare.risk) == (None,) * 5


def test_non_finite_floats_and_bad_text_are_stored_safely(store: Store) -> None:
    r = reply(
        1, risk=float("nan"), scores={"epistemic": float("nan"), "aleatoric": float("inf"), "n": 2},
        token_probs=[0.5, float("-inf")], response="nul\x00 and \ud800 lone", prompt="p\x00",
    )
    store.record(r, UNIFORM)
    got = store.item("req0001").reply  # type: ignore[union-attr]
    assert got.risk is None
    assert got.scores == {"epistemic": None, "aleatoric": None, "n": 2}
    assert got.token_probs == [0.5, None]
    assert got.response == "nul\ufffd and \ufffd lone" and got.prompt == "p\ufffd"


def test_record_is_idempotent_and_keeps_the_first(store: Store) -> None:
    store.record(reply(1, response="first"), UNIFORM)
    store.record(reply(1, response="second"), ESCALATION)  # a retry: no error, nothing changes
    store.record(reply(2), None)
    store.record(reply(2), UNIFORM)  # the first record did not sample it: it stays unsampled
    item = store.item("req0001")
    assert item is not None and item.reply.response == "first" and item.sample == UNIFORM
    assert store.item("req0002") is None and store.reply("req0002") is not None
    assert store.progress()["replies"] == 2 and store.count() == 1


def test_unsampled_replies_are_kept_but_not_queued(store: Store) -> None:
    store.record(reply(1), NOT_SAMPLED)
    store.record(reply(2), None)
    assert store.reply("req0001") is not None and store.reply("req0002") is not None
    assert store.queue() == [] and store.count() == 0


def test_record_many(store: Store) -> None:
    assert store.record_many([(reply(i), UNIFORM) for i in range(5)] + [(reply(0), UNIFORM)]) == 5
    assert store.record_many([]) == 0
    assert store.count() == 5


def test_threads_share_one_store(store: Store) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(25):
                rid = t * 100 + i
                store.record(reply(rid), UNIFORM)
                store.add_label(f"req{rid:04d}", reviewer=f"t{t}", label="right")
                store.queue(limit=5)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    p = store.progress()
    assert p["items"] == 150 and p["labelled"] == 150


# ---------------------------------------------------------------------------- labels


def test_two_reviewers_history_and_the_later_counts(store: Store) -> None:
    store.record(reply(1), UNIFORM)
    a = store.add_label("req0001", reviewer="alice", label="right", note="looks fine")
    b = store.add_label("req0001", reviewer="bob", label="wrong", corrected="answer 2")
    assert b.id > a.id and a.time.tzinfo is not None
    item = store.item("req0001")
    assert item is not None
    assert item.labels == [a, b] and item.current == b
    (row,) = store.queue()
    assert (row.label, row.n_labels) == ("wrong", 2)
    assert store.progress()["wrong"] == 1 and store.progress()["right"] == 0


def test_label_is_committed_on_return(store: Store, store_url: str) -> None:
    store.record(reply(1), UNIFORM)
    rec = store.add_label("req0001", reviewer=" carol ", label="unsure", note="")
    assert rec.reviewer == "carol" and rec.note is None  # trimmed; an empty note is no note
    with Store(store_url) as other:  # another connection pool sees it at once
        item = other.item("req0001")
        assert item is not None and item.labels == [rec]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"label": "maybe"}, StoreInputError, r"unknown label 'maybe'; choose one of \['right', 'wrong', 'unsure'\]"),
        ({"reviewer": "  "}, StoreInputError, "needs a reviewer"),
        ({"reviewer": "x" * 201}, StoreInputError, "at most 200"),
        ({"note": "n" * 10_001}, StoreInputError, "note is 10,001 characters; at most 10,000"),
        ({"corrected": "c" * 10_001}, StoreInputError, "corrected is 10,001 characters"),
        ({"request_id": "req0099"}, UnknownItemError, "no review item 'req0099'"),
        ({"request_id": "req0002"}, UnknownItemError, "no review item 'req0002'"),  # recorded, not sampled
    ],
)
def test_bad_labels_are_refused(store: Store, kwargs: dict, error: type, match: str) -> None:
    store.record(reply(1), UNIFORM)
    store.record(reply(2), None)
    args = {"request_id": "req0001", "reviewer": "alice", "label": "right", **kwargs}
    with pytest.raises(error, match=match) as info:
        store.add_label(args.pop("request_id"), **args)
    assert isinstance(info.value, InputError) and isinstance(info.value, StoreError)
    assert store.item("req0001").labels == []  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- queue


def ids(rows: list) -> list[str]:
    return [r.request_id for r in rows]


def test_queue_order_unlabelled_first_then_newest(store: Store) -> None:
    fill(store)
    assert ids(store.queue()) == [f"req{i:04d}" for i in range(11, -1, -1)]
    store.add_label("req0011", reviewer="a", label="right")
    store.add_label("req0005", reviewer="a", label="wrong")
    order = ids(store.queue())
    assert order[-2:] == ["req0011", "req0005"] and order[0] == "req0010"
    assert ids(store.queue(unlabelled_first=False))[:2] == ["req0011", "req0010"]
    assert ids(store.queue(limit=3, offset=2)) == order[2:5]
    assert store.queue(limit=0) == []


def test_queue_rows(store: Store) -> None:
    long = "word " * 100 + "\n\nend"
    store.record(reply(1, response=long), ESCALATION_UNIFORM)
    store.record(reply(2, response=None), BAND)
    store.add_label("req0001", reviewer="a", label="unsure")
    rows = {r.request_id: r for r in store.queue()}
    r1, r2 = rows["req0001"], rows["req0002"]
    assert r1.reasons == ("escalation", "uniform") and r1.inclusion_probability == 1.0
    assert r1.label == "unsure" and r1.n_labels == 1 and r1.risk == 0.5 and r1.action == "allow"
    assert r1.preview is not None and len(r1.preview) == PREVIEW_CHARS and r1.preview.endswith("…")
    assert "\n" not in r1.preview
    assert r2.preview is None and r2.label is None and r2.n_labels == 0
    assert r1.time == T0 + timedelta(minutes=1)


def test_queue_filters_and_count(store: Store) -> None:
    fill(store)
    store.add_label("req0002", reviewer="a", label="wrong")
    store.add_label("req0003", reviewer="a", label="right")
    cases = [
        ({"reason": "escalation"}, {0, 3, 6, 9}),
        ({"reason": "band"}, {1, 4, 7, 10}),
        ({"reason": "uniform"}, {2, 5, 8, 11}),
        ({"action": "escalate"}, {0, 3, 6, 9}),
        ({"risk_min": 0.6}, {0, 1, 3, 4, 6, 7, 9, 10}),
        ({"risk_min": 0.15, "risk_max": 0.6}, {5, 8, 11, 1, 4, 7, 10}),
        ({"labelled": True}, {2, 3}),
        ({"labelled": False}, set(range(12)) - {2, 3}),
        ({"label": "wrong"}, {2}),
        ({"reason": "uniform", "labelled": False}, {5, 8, 11}),
    ]
    for filters, expected in cases:
        want = {f"req{i:04d}" for i in expected}
        assert set(ids(store.queue(**filters))) == want, filters
        assert store.count(**filters) == len(want), filters
        assert set(ids(store.queue(Filters(**filters)))) == want and store.count(Filters(**filters)) == len(want)
    assert store.count() == 12


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reason": "random"}, "unknown review reason 'random'"),
        ({"label": "maybe"}, "unknown label 'maybe'"),
        ({"risk_min": "high"}, "risk_min must be a number"),
        ({"limit": -1}, "limit must be a non-negative integer"),
        ({"offset": 1.5}, "offset must be a non-negative integer"),
        ({"limit": 10_001}, "limit must be at most 10000"),
        ({"labelled": "yes"}, "labelled must be True, False or None"),
        ({"risk": 0.5}, r"unknown queue filter\(s\) \['risk'\]"),
        ({"filters": Filters(reason="band"), "reason": "uniform"}, "not both"),
    ],
)
def test_bad_queue_filters(store: Store, kwargs: dict, match: str) -> None:
    with pytest.raises(StoreInputError, match=match):
        store.queue(**kwargs)


def test_next_unlabelled_walks_the_queue(store: Store) -> None:
    fill(store)
    assert store.next_unlabelled() == "req0011"
    store.add_label("req0011", reviewer="a", label="right")
    assert store.next_unlabelled("req0011") == "req0010"  # after the item just labelled
    assert store.next_unlabelled("req0010") == "req0009"  # skipping 10 without labelling it
    assert store.next_unlabelled("req0006", reason="band") == "req0004"
    assert store.next_unlabelled("req0001", reason="band") == "req0010"  # wraps to the top
    assert store.next_unlabelled("req0000") == "req0010"  # the newest left unlabelled
    for i in range(12):
        if i != 10:
            store.add_label(f"req{i:04d}", reviewer="a", label="right")
    assert store.next_unlabelled("req0010") is None  # only itself left
    assert store.next_unlabelled() == "req0010"
    store.add_label("req0010", reviewer="a", label="wrong")
    assert store.next_unlabelled() is None
    with pytest.raises(UnknownItemError, match="no review item 'zzz'"):
        store.next_unlabelled("zzz")
    with pytest.raises(StoreInputError, match="looks for unlabelled items"):
        store.next_unlabelled(filters=Filters(label="right"))


def test_next_unlabelled_takes_the_queue_s_filters(store: Store) -> None:
    fill(store)
    assert store.next_unlabelled("req0006", Filters(reason="band")) == store.next_unlabelled("req0006", reason="band")
    assert store.next_unlabelled(filters=Filters(reason="band", labelled=False)) == "req0010"


def test_progress(store: Store) -> None:
    assert store.progress() == {
        "replies": 0, "items": 0, "unlabelled": 0, "labelled": 0, "right": 0, "wrong": 0, "unsure": 0,
        "labelled_uniform": 0, "wrong_uniform": 0, "by_reason": {"escalation": 0, "uniform": 0, "band": 0, "drift": 0},
    }
    fill(store)
    store.record(reply(20), ESCALATION_UNIFORM)
    store.add_label("req0002", reviewer="a", label="wrong")  # uniform
    store.add_label("req0005", reviewer="a", label="right")  # uniform
    store.add_label("req0008", reviewer="a", label="wrong")  # uniform, then changed to unsure
    store.add_label("req0008", reviewer="b", label="unsure")
    store.add_label("req0020", reviewer="a", label="wrong")  # escalation + uniform
    store.add_label("req0001", reviewer="a", label="right")  # band
    p = store.progress()
    assert p == {
        "replies": 15, "items": 13, "unlabelled": 8, "labelled": 4, "right": 2, "wrong": 2, "unsure": 1,
        "labelled_uniform": 3, "wrong_uniform": 2, "by_reason": {"escalation": 5, "uniform": 5, "band": 4, "drift": 0},
    }


# ---------------------------------------------------------------------------- calibration


def test_labelled_for_calibration(store: Store) -> None:
    fill(store)
    store.record(reply(30, prompt=None, response=None), UNIFORM)  # no text: cannot be used
    store.record(reply(31, model_fingerprint="other"), UNIFORM)
    for rid, lab in [("req0002", "wrong"), ("req0001", "right"), ("req0004", "unsure"),
                     ("req0030", "right"), ("req0031", "wrong"), ("req0007", "wrong")]:
        store.add_label(rid, reviewer="a", label=lab)
    store.add_label("req0007", reviewer="b", label="right")  # the later label counts
    got = store.labelled()
    assert [(r.request_id, r.correct) for r in got] == [
        ("req0001", 1), ("req0002", 0), ("req0007", 1), ("req0031", 0)]
    assert got[0].sample == BAND and got[0].prompt == "question 1?" and got[0].response == "answer 1"
    assert got[0].scores["epistemic"] == 0.012 and got[0].ended is True and got[0].time.tzinfo is not None
    assert [r.request_id for r in store.labelled(since=T0 + timedelta(minutes=2))] == ["req0002", "req0007", "req0031"]
    assert [r.request_id for r in store.labelled(model_fingerprint="other")] == ["req0031"]
    naive = (T0 + timedelta(minutes=7)).replace(tzinfo=None)  # naive times are UTC
    assert [r.request_id for r in store.labelled(since=naive)] == ["req0007", "req0031"]


def test_export_jsonl_loads_as_a_dataset(store: Store, tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    store.record(reply(1, ended=False), ESCALATION)
    store.record(reply(2), UNIFORM)
    store.record(reply(3, prompt=chat), UNIFORM)
    store.record(reply(4), UNIFORM)
    for rid, lab in [("req0001", "wrong"), ("req0002", "right"), ("req0003", "right"), ("req0004", "unsure")]:
        store.add_label(rid, reviewer="a", label=lab)
    path = tmp_path / "labelled.jsonl"
    with path.open("w", encoding="utf-8") as out:
        assert store.export_jsonl(out) == 3  # unsure is left out
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {
        "id": "req0001", "prompt": "question 1?", "response": "answer 1", "label": 0, "ended": False,
        "guarduq_sample": {"uniform": False, "rate": 0.1, "extra_probability": 1.0,
                           "inclusion_probability": 1.0, "reasons": ["escalation"]},
    }
    for name in ("jsonl", "reviews"):
        items = {it.id: it for it in load_dataset(name, path)}
        assert set(items) == {f"{name}:req0001", f"{name}:req0002", f"{name}:req0003"}
        one, two, three = (items[f"{name}:req000{i}"] for i in (1, 2, 3))
        assert (one.label, two.label, three.label) == (0, 1, 1)
        assert one.prompt == "question 1?" and one.response == "answer 1"
        assert three.prompt == chat
        # the loader keeps the sampling record and ended
        assert one.meta["ended"] is False and two.meta["ended"] is True
        assert one.meta["sample"] == Sample(("escalation",), False, 0.1, 1.0, 1.0)
    assert store.export_jsonl(io.StringIO(), since=T0 + timedelta(minutes=2)) == 2


# ---------------------------------------------------------------------------- opening


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("mysql://root@localhost/db", "has scheme 'mysql', which the store does not support; use sqlite:///"),
        ("postgresql+psycopg2://u@h/db", "has scheme 'postgresql\\+psycopg2'"),
        ("", "empty store URL"),
        ("postgresql://u:secret@localhost", "names no database"),
        ("sqlite:///no\x00pe.db", "NUL"),
    ],
)
def test_bad_urls_are_refused(url: str, match: str) -> None:
    with pytest.raises(StoreError, match=match) as info:
        Store(url)
    assert "secret" not in str(info.value)


def test_a_directory_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="it is a directory"):
        Store(f"sqlite:///{tmp_path}")


def test_unreachable_postgres_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="store postgresql\\+psycopg://u:\\*\\*\\*@127.0.0.1:1/db: open failed"):
        Store("postgresql://u:secret@127.0.0.1:1/db")


def test_sqlite_file_path_memory_and_closing(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "store.db"  # folders are made
    with Store(str(path)) as s:
        s.record(reply(1), UNIFORM)
        assert s.where == f"sqlite:///{path}" and s.backend == "sqlite"
    assert path.exists()
    with Store(f"sqlite:///{path}") as s:
        assert s.count() == 1
        with s._engine.connect() as conn:  # WAL, and every commit fsynced (FULL = 2)
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    with pytest.raises(StoreError, match="is closed"):
        s.queue()
    mem = Store("sqlite://")
    mem.record(reply(1), UNIFORM)
    assert mem.count() == 1 and mem.where == "sqlite (in memory)"
    mem.close()


def test_time_is_utc_whatever_the_input_zone(store: Store) -> None:
    tz = datetime(2025, 3, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    store.record(dataclasses.replace(reply(1), time=tz), UNIFORM)
    got = store.item("req0001").reply.time  # type: ignore[union-attr]
    assert got == datetime(2025, 3, 1, 12, 0, tzinfo=UTC) and got.utcoffset() == timedelta(0)


def test_bad_request_ids_are_refused(store: Store) -> None:
    with pytest.raises(StoreInputError, match="at most 64 characters"):
        store.record(dataclasses.replace(reply(1), request_id="x" * 65), UNIFORM)
    with pytest.raises(StoreInputError, match="at most 64 characters"):
        store.record(dataclasses.replace(reply(1), request_id=""), UNIFORM)
    with pytest.raises(StoreInputError, match="cannot store a object"):
        store.record(dataclasses.replace(reply(1), scores={"x": object()}), UNIFORM)
    assert store.progress()["replies"] == 0
