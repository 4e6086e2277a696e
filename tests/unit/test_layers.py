"""The package's layers, read from its source: lower layers never import upper ones, policy no torch."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "guarduq"
LOWER = {"models", "layout", "scoring", "sve", "calibration", "errors", "_logging", "_version", "sampling"}
UPPER = {"policy", "store", "decider", "traffic", "guard", "cli", "integrations", "serve", "review", "__main__"}
# The decisions layer: policy and store sit side by side, below what orchestrates and what faces.
ABOVE_DECISIONS = {"decider", "traffic", "guard", "cli", "integrations", "serve", "review", "__main__"}
HEAVY = {"torch", "numpy", "transformers", "sklearn", "scipy", "safetensors"}


def _imports() -> dict[str, set[str]]:
    """Module name -> every module it imports, at top level or inside functions."""
    out: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module == "guarduq":
                for a in node.names:  # `from guarduq import layout` is the submodule, not the root
                    sub = (ROOT / f"{a.name}.py").exists() or (ROOT / a.name).is_dir()
                    found.add(f"guarduq.{a.name}" if sub else "guarduq")
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
        out[".".join(parts)] = found
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_lower_layers_import_neither_upper_layers_nor_the_package_root() -> None:
    imports = _imports()
    assert {"guarduq.policy.engine", "guarduq.calibration.calibrator", "guarduq.sve.ensemble"} <= set(imports)
    bad = [
        f"{m} -> {i}"
        for m, found in imports.items()
        if _layer(m) in LOWER
        for i in found
        if i.startswith("guarduq") and (_layer(i) in UPPER or i == "guarduq")
    ]
    assert bad == []


def test_policy_reaches_no_torch_or_numpy() -> None:
    imports = _imports()

    def reach(module: str, seen: set[str]) -> set[str]:
        for i in imports.get(module, ()):
            if i in imports and i != "guarduq" and i not in seen:
                seen.add(i)
                reach(i, seen)
        return seen

    for m in (m for m in imports if _layer(m) == "policy"):
        reached = reach(m, {m})
        heavy = {i for r in reached for i in imports[r] if i.split(".")[0] in HEAVY}
        assert not heavy, f"{m} reaches {sorted(heavy)} through {sorted(reached)}"


def test_decision_layers_import_no_orchestration_or_faces() -> None:
    imports = _imports()
    assert {"guarduq.store.database", "guarduq.store.sampling"} <= set(imports)
    bad = [
        f"{m} -> {i}"
        for m, found in imports.items()
        if _layer(m) in {"policy", "store"}
        for i in found
        if i.startswith("guarduq") and (_layer(i) in ABOVE_DECISIONS or i == "guarduq")
    ]
    assert bad == []
