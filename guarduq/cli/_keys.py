"""The keys ``guarduq serve`` and ``guarduq review`` read from environment variables.

A variable holds comma-separated entries. An API key entry (``--api-key-env``) may carry a name,
``NAME:KEY``: the text before the first ``:`` is the name, ``[A-Za-z0-9_.-]``, 1 to 64 characters,
and a policy with ``groups.from_key: true`` puts every request that key authenticates in the
traffic group of that name (the operator's assignment: a client's ``metadata.group`` cannot
override it). An entry without ``:`` is an unnamed key, so a key that itself holds a ``:`` must be
given a name. Admin and review keys carry no names: their entries are whole keys, ``:`` included.
A key is at least 16 characters. No message ever repeats an entry (it may be a secret).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from guarduq.errors import InputError

KEY_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MIN_KEY_CHARS = 16


class KeyEntry(BaseModel):
    """One entry of a key variable, validated where it enters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, pattern=KEY_NAME_PATTERN)
    key: str = Field(min_length=MIN_KEY_CHARS)


@dataclass(frozen=True)
class Doors:
    """The keys of each door (a key opens one only), and the API keys' names (key -> name)."""

    api: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    review: tuple[str, ...] = ()
    api_names: dict[str, str] = field(default_factory=dict)


def parse_key_entries(raw: str, *, named: bool, where: str) -> tuple[KeyEntry, ...]:
    """The entries of ``raw`` (comma-separated; ``NAME:KEY`` entries where ``named``)."""
    out: list[KeyEntry] = []
    for i, entry in enumerate((e.strip() for e in raw.split(",")), start=1):
        if not entry:
            continue
        name, sep, key = entry.partition(":") if named else ("", "", entry)
        try:
            out.append(KeyEntry(name=name.strip() if sep else None, key=key.strip() if sep else entry))
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors()}
            if "name" in bad:
                raise InputError(
                    f"{where}: entry {i}: the text before ':' is not a key name ([A-Za-z0-9_.-], 1 to 64 "
                    "characters); write NAME:KEY, and name any key that itself holds a ':'") from None
            raise InputError(f"{where}: keys must be at least {MIN_KEY_CHARS} characters (entry {i})") from None
    if not out:
        raise InputError(f"{where}: the variable holds no key")
    names: dict[str, str | None] = {}
    for e in out:
        if names.setdefault(e.key, e.name) != e.name:
            raise InputError(f"{where}: one key is given two names: a key names one traffic group only")
    return tuple(out)


def key_entries_from_env(var: str | None, flag: str = "--api-key-env", *,
                         named: bool = False) -> tuple[KeyEntry, ...]:
    """The entries of environment variable ``var`` (None: no keys)."""
    if var is None:
        return ()
    bad = InputError(f"{flag} {var!r}: not a valid environment variable name")
    if not var or "=" in var or "\0" in var:
        raise bad
    try:
        raw = os.environ.get(var)
    except UnicodeError as exc:  # a lone surrogate: no environment can hold that name
        raise bad from exc
    if raw is None:
        raise InputError(f"{flag} {var}: the environment variable {var} is not set")
    return parse_key_entries(raw, named=named, where=f"{flag} {var}")


def api_keys_from_env(var: str | None, flag: str = "--api-key-env") -> tuple[str, ...]:
    """The keys of ``var``, entries as whole keys (admin and review keys; ``guarduq review``)."""
    return tuple(e.key for e in key_entries_from_env(var, flag))


def door_keys(args: argparse.Namespace) -> Doors:
    """The keys of ``guarduq serve``'s doors. A key opens one door only, and reviewers of a server
    whose API has keys get keys of their own (else /review would answer this machine only)."""
    entries = key_entries_from_env(args.api_key_env, named=True)
    keys = tuple(e.key for e in entries)
    admin_keys = api_keys_from_env(args.admin_key_env, "--admin-key-env")
    review_keys = api_keys_from_env(args.review_key_env, "--review-key-env")
    if review_keys and not args.review:
        raise InputError("--review-key-env opens the review page: add --review")
    if args.review and keys and not review_keys:
        raise InputError("--review with --api-key-env: give reviewers their own keys with --review-key-env VAR "
                         "(API keys do not open /review)")
    doors = {"--api-key-env": set(keys), "--admin-key-env": set(admin_keys), "--review-key-env": set(review_keys)}
    flags = list(doors)
    for i, a in enumerate(flags):
        for b in flags[i + 1:]:
            if doors[a] & doors[b]:
                raise InputError(f"{a} and {b} share a key: each key opens one door only")
    return Doors(keys, admin_keys, review_keys, {e.key: e.name for e in entries if e.name is not None})
