"""API key names as a traffic-group source (issue 35): ``--api-key-env`` entries ``NAME:KEY``, and
a policy's ``groups.from_key``, under which a request belongs to its key's group, whatever its
client's ``metadata.group`` says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from guarduq.cli._keys import api_keys_from_env, door_keys, parse_key_entries
from guarduq.errors import InputError, PolicyError
from guarduq.policy import Policy
from guarduq.policy.context import group_of

LEGAL, SUPPORT, PLAIN = "legal-key-0123456789abcdef", "support-key-0123456789ab:cd", "plain-key-0123456789abcdef"


def test_entries_may_carry_a_name_and_unnamed_keys_stay_valid() -> None:
    got = parse_key_entries(f" legal:{LEGAL} ,support.eu-1:{SUPPORT},, {PLAIN} ", named=True, where="--api-key-env K")
    assert [(e.name, e.key) for e in got] == [("legal", LEGAL), ("support.eu-1", SUPPORT), (None, PLAIN)]
    # the first ':' splits: the support key keeps its own ':'; a repeated entry is one key
    assert len(parse_key_entries(f"a:{LEGAL},a:{LEGAL}", named=True, where="K")) == 2


@pytest.mark.parametrize(("raw", "message"), [
    (f"le gal:{LEGAL}", "not a key name"),
    (f"{'n' * 65}:{LEGAL}", "not a key name"),
    (f":{LEGAL}", "not a key name"),
    ("abc/def:0123456789abcdef0123", "name any key that itself holds a ':'"),  # an unnamed key with ':'
    ("legal:short-key", "at least 16 characters"),
    (f"legal:{LEGAL},support:{LEGAL}", "given two names"),
    (" , ", "holds no key"),
])
def test_a_bad_entry_is_refused_without_repeating_it(raw: str, message: str) -> None:
    with pytest.raises(InputError, match=message) as err:
        parse_key_entries(raw, named=True, where="--api-key-env K")
    assert "0123456789" not in str(err.value) and "--api-key-env K" in str(err.value)


def test_admin_and_review_keys_are_whole_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADMIN_KEYS", "ops:0123456789abcdef0123")
    assert api_keys_from_env("ADMIN_KEYS", "--admin-key-env") == ("ops:0123456789abcdef0123",)


def serve_args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key_env": None, "admin_key_env": None, "review_key_env": None,
                                 "review": False, **kw})


def test_door_keys_give_the_api_keys_names_and_one_door_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_KEYS", f"legal:{LEGAL},{PLAIN}")
    doors = door_keys(serve_args(api_key_env="API_KEYS"))
    assert doors.api == (LEGAL, PLAIN) and doors.api_names == {LEGAL: "legal"}
    monkeypatch.setenv("ADMIN_KEYS", LEGAL)
    with pytest.raises(InputError, match="share a key"):
        door_keys(serve_args(api_key_env="API_KEYS", admin_key_env="ADMIN_KEYS"))


def _policy(**groups: Any) -> Policy:
    return Policy.from_dict({"name": "p", "version": "1", "groups": groups,
                             "rules": [{"name": "all", "action": "allow"}]}, base_dir=Path("."))


def test_a_keys_name_wins_over_metadata_and_default_only_under_from_key() -> None:
    both = _policy(from_key=True, from_metadata=True, default="pooled-users")
    assert group_of(both, "support", key_name="legal") == "legal"  # the operator's assignment
    assert group_of(both, "support") == "support"  # an unnamed key: the client's word, trusted here
    assert group_of(both) == "pooled-users"
    keyed = _policy(from_key=True, default="pooled-users")
    assert group_of(keyed, "support") == "pooled-users"  # metadata not trusted
    off = _policy(from_metadata=True)
    assert group_of(off, "support", key_name="legal") == "support"  # from_key off: the name is ignored
    assert group_of(_policy(), None, key_name="legal") is None
    with pytest.raises(PolicyError):
        Policy.from_dict({"name": "p", "version": "1", "groups": {"from_key": "yes please"},
                          "rules": [{"name": "all", "action": "allow"}]}, base_dir=Path("."))


def test_serve_puts_two_named_keys_in_two_groups_in_reply_audit_and_store(
        tiny_model_dir: Path, tmp_path: Path, served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sqlalchemy")
    from guarduq.cli import main
    from guarduq.store import Store
    from tests.unit.serve_helpers import body, local_client

    policy = tmp_path / "p.yaml"
    policy.write_text(json.dumps({"name": "p", "version": "1", "groups": {"from_key": True, "from_metadata": True},
                                  "rules": [{"name": "all", "action": "allow"}]}))
    monkeypatch.setenv("GUARDUQ_TEST_KEYS", f"legal:{LEGAL},support:{SUPPORT},{PLAIN}")
    db, audit = tmp_path / "s.db", tmp_path / "audit.jsonl"
    assert main(["serve", "--model", str(tiny_model_dir), "--policy", str(policy), "--api-key-env",
                 "GUARDUQ_TEST_KEYS", "--audit", str(audit), "--store", f"sqlite:///{db}",
                 "--model-name", "tiny"]) == 0

    def ask(c: Any, key: str, **kw: Any) -> dict[str, Any]:
        resp = c.post("/v1/chat/completions", json=body(**kw), headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        return resp.json()["guarduq"]

    with local_client(served["app"]) as c:
        legal = ask(c, LEGAL, metadata={"group": "support"})  # the client's word does not move it
        support = ask(c, SUPPORT)
        chosen = ask(c, PLAIN, metadata={"group": "support"})  # an unnamed key: metadata, as trusted here
        plain = ask(c, PLAIN)
        scored = c.post("/v1/guarduq/score", json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "response": "Blue"}, headers={"Authorization": f"Bearer {LEGAL}"})
    assert [g["in_force"]["group"] for g in (legal, support, chosen, plain)] == ["legal", "support", "support", None]
    assert scored.status_code == 200 and scored.json()["guarduq"]["in_force"]["group"] == "legal"
    lines = [json.loads(x) for x in audit.read_text().splitlines()]  # the shutdown flushed the store too
    assert [x["in_force"]["group"] for x in lines] == ["legal", "support", "support", None, "legal"]
    store = Store(f"sqlite:///{db}")
    try:
        assert store.reply(legal["request_id"]).group == "legal"  # type: ignore[union-attr]
        assert store.reply(support["request_id"]).group == "support"  # type: ignore[union-attr]
    finally:
        store.close()

