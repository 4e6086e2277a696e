"""Public names that a package resolves on first use, so importing it loads only what is used.

``guarduq`` and ``guarduq.calibration`` name torch- and sklearn-backed classes; importing them
eagerly made ``import guarduq.policy`` or ``import guarduq.review`` (which import the package
first) load torch and sklearn. With :func:`attach`, ``from guarduq import Guard`` still works: the
module that defines ``Guard`` is imported when the name is first read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def attach(package: str, names: Mapping[str, Sequence[str]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, from {module: [the public names it defines]}."""
    where = {name: module for module, listed in names.items() for name in listed}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        vars(sys.modules[package])[name] = value  # later reads find it without this call
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
