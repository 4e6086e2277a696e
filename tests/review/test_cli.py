"""``guarduq review``: flags, the bind check, α from a policy, and the app it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from guarduq.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``uvicorn.run`` was called with (nothing is served)."""
    import uvicorn

    got: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.update(app=app, **kw))
    return got


def test_review_is_registered() -> None:
    args = build_parser().parse_args(["review", "--store", "x.db"])
    assert (args.host, args.port, args.delta, args.alpha) == ("127.0.0.1", 8100, 0.1, None)


def test_serves_the_page_on_the_store(tmp_path: Path, served: dict[str, Any]) -> None:
    from guarduq.store import Store
    from tests.review.conftest import fill, page_client

    db = tmp_path / "s.db"
    with Store(f"sqlite:///{db}") as s:
        fill(s, 3)
    assert main(["review", "--store", f"sqlite:///{db}", "--policy", str(ROOT / "policies/default.yaml"),
                 "--port", "8123"]) == 0
    assert served["host"] == "127.0.0.1" and served["port"] == 8123
    settings = served["app"].state.settings
    assert settings.alpha == 0.7 and settings.api_keys == ()  # α from the policy
    assert main(["review", "--store", str(db), "--policy", str(ROOT / "policies/default.yaml"),
                 "--alpha", "0.25"]) == 0
    assert served["app"].state.settings.alpha == 0.25  # --alpha wins
    assert served["app"].state.settings.threshold_fraction == 0.3  # default.yaml has no review section
    # the CLI closed its store when uvicorn returned
    with pytest.raises(Exception, match="closed"):
        served["app"].state.store.progress()
    with Store(str(db)) as s:  # the app works on an open store
        from guarduq.review import create_review_app

        html = page_client(create_review_app(s, served["app"].state.settings), ("127.0.0.1", 1)).get("/").text
        assert "α = 0.25" in html
    assert main(["review", "--store", str(db), "--policy", str(ROOT / "policies/review.yaml")]) == 0
    review = yaml.safe_load((ROOT / "policies/review.yaml").read_text())["review"]
    assert served["app"].state.settings.threshold_fraction == review["threshold_fraction"]  # calibrate's too


def test_refuses_remote_bind_without_a_key(tmp_path: Path, served: dict[str, Any],
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    db = str(tmp_path / "s.db")
    assert main(["review", "--store", db, "--host", "0.0.0.0"]) == 2
    assert "without an API key" in capsys.readouterr().err and not served
    monkeypatch.setenv("REVIEW_KEYS", "r" * 20)
    assert main(["review", "--store", db, "--host", "0.0.0.0", "--api-key-env", "REVIEW_KEYS"]) == 0
    assert served["app"].state.settings.api_keys == ("r" * 20,)
    served.clear()
    assert main(["review", "--store", db, "--host", "0.0.0.0", "--allow-unauthenticated-remote"]) == 0
    assert served["app"].state.settings.allow_unauthenticated_remote


def test_csrf_secret_from_env(tmp_path: Path, served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    db = str(tmp_path / "s.db")
    assert main(["review", "--store", db]) == 0
    assert served["app"].state.settings.csrf_secret is None  # default: from the keys, else random
    monkeypatch.setenv("REVIEW_CSRF", " " + "c" * 40 + "\n")
    assert main(["review", "--store", db, "--csrf-secret-env", "REVIEW_CSRF"]) == 0
    assert served["app"].state.settings.csrf_secret == b"c" * 40
    # two processes given the same secret accept each other's forms
    from guarduq.review import create_review_app
    from guarduq.store import Store
    from tests.review.conftest import csrf, fill, page_client

    with Store(db) as s:
        ids = fill(s, 2)
        one = page_client(create_review_app(s, served["app"].state.settings))
        token = csrf(one)
        two = page_client(create_review_app(s, served["app"].state.settings))
        two.cookies.set("guarduq_review_csrf", token)
        assert two.post(f"/items/{ids[0]}/label", data={"label": "right", "csrf": token}).status_code == 200


@pytest.mark.parametrize("argv, words", [
    (["--alpha", "1.5"], "alpha must be in (0, 1)"),
    (["--delta", "0"], "delta must be in (0, 1)"),
    (["--port", "0"], "--port"),
    (["--policy", "missing.yaml"], "cannot read policy file"),
    (["--reviewer", ""], "reviewer_default"),
    (["--api-key-env", "NO_SUCH_VAR_FOR_REVIEW"], "is not set"),
    (["--csrf-secret-env", "NO_SUCH_VAR_FOR_REVIEW"], "--csrf-secret-env NO_SUCH_VAR_FOR_REVIEW: the environment"),
    (["--csrf-secret-env", "SHORT_REVIEW_SECRET"], "at least 16 characters"),
    (["--csrf-secret-env", "A=B"], "not a valid environment variable name"),
])
def test_bad_flags_are_one_line_errors(tmp_path: Path, served: dict[str, Any], argv: list[str], words: str,
                                       capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHORT_REVIEW_SECRET", "too short")
    assert main(["review", "--store", str(tmp_path / "s.db"), *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and not served
