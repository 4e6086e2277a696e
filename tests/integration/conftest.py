"""Integration tests run the real default model (SmolLM2-135M-Instruct), loaded once per session."""

from __future__ import annotations

from functools import cache

import pytest

from guarduq import Guard

pytestmark = pytest.mark.integration


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@cache
def load_real_guard() -> Guard:
    """The default model, loaded once per session through the user's cache (the first load
    dequantizes the GGUF); also used where a fixture cannot reach (LangChain's standard suite)."""
    return Guard("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def real_guard() -> Guard:
    return load_real_guard()
