"""The package's floors, read from its source: no module imports a higher floor, no circles, and the
light faces (policy, store, review) reach no torch, counting what parent packages' ``__init__`` run."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "guarduq"
# Each top-level part of the package on its floor; a module imports only its own floor or lower ones.
FLOORS: dict[str, int] = {
    **dict.fromkeys(["<root>", "errors", "_logging", "_version", "_lazy", "_storage", "_http", "answers", "sampling"], 0),
    **dict.fromkeys(["models", "aliases", "model_parts", "layout", "batching", "streaming", "scoring", "sve", "calibration"], 1),
    **dict.fromkeys(["policy", "store"], 2),  # the decisions, side by side
    **dict.fromkeys(["decider", "traffic", "response", "guard", "distributed"], 3),  # what orchestrates
    **dict.fromkeys(["cli", "integrations", "serve", "review", "__main__"], 4),  # what faces users
}
FACES = 4  # `from guarduq import Guard` reads the package's public names: only faces may
HEAVY = {"torch", "numpy", "transformers", "sklearn", "scipy", "safetensors"}
ML = {"torch", "transformers", "sklearn", "scipy", "safetensors"}


@dataclass
class Module:
    """What one module imports when it is imported (``top``) and inside its functions (``lazy``).

    Type-only imports (under ``if TYPE_CHECKING:``) never run: they are kept apart (``typed``)."""

    top: set[str] = field(default_factory=set)
    lazy: set[str] = field(default_factory=set)
    typed: set[str] = field(default_factory=set)
    private: set[str] = field(default_factory=set)  # `module._name` it imports from another module
    root_names: bool = False  # `from guarduq import <a public name>`

    @property
    def edges(self) -> set[str]:
        return self.top | self.lazy


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


class _Reader(ast.NodeVisitor):
    def __init__(self, into: Module) -> None:
        self.into, self.depth, self.typing = into, 0, False

    def _add(self, names: set[str]) -> None:
        (self.into.typed if self.typing else self.into.lazy if self.depth else self.into.top).update(names)

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self.typing = True
            for child in node.body:
                self.visit(child)
            self.typing = False
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self._add({a.name for a in node.names})

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.module or node.level:
            return
        found = set()
        self.into.private |= {
            f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
        }
        for a in node.names:  # `from guarduq.x import y` imports the submodule y where there is one
            sub = f"{node.module}.{a.name}"
            found.add(sub if node.module.startswith("guarduq") and _is_module(sub) else node.module)
            if node.module == "guarduq" and not _is_module(sub):
                self.into.root_names = True
        self._add(found)


def _read() -> dict[str, Module]:
    out: dict[str, Module] = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = module = Module()
        _Reader(module).visit(ast.parse(f.read_text()))
    return out


MODULES = _read()


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (to run, in its functions, or for its types), with
    the ``__init__`` of every package entered on the way (its own packages aside: those run first).

    Type-only imports count: a module that needs another's types to be read sits above it."""
    graph: dict[str, set[str]] = {}
    for name, m in MODULES.items():
        mine = set(_parents(name))
        targets = {t for t in m.edges | m.typed if t in MODULES}
        graph[name] = (targets | {p for t in targets for p in _parents(t)}) - mine - {name}
    return graph


def _loads(name: str) -> set[str]:
    """Every module that ``import name`` executes: itself, its parents, what their top levels import."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        m = todo.pop()
        for x in [m, *_parents(m)]:
            if x in MODULES and x not in seen:
                seen.add(x)
                todo += [t for t in MODULES[x].top if t.startswith("guarduq")]
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_part_of_the_package_has_a_floor() -> None:
    parts = {_part(m) for m in MODULES}
    assert {"review", "batching", "streaming", "_storage", "_http", "distributed"} <= parts
    assert parts - set(FLOORS) == set(), "place the new part on a floor in FLOORS"


def test_no_module_imports_a_higher_floor() -> None:
    bad = [
        f"{m} -> {t}"
        for m, found in MODULES.items()
        for t in found.edges
        if t.startswith("guarduq") and t in MODULES and FLOORS[_part(t)] > FLOORS[_part(m)]
    ]
    assert bad == []


def test_only_faces_read_the_package_s_public_names() -> None:
    """``from guarduq import Guard`` resolves to whichever module holds Guard: below the faces, name it."""
    assert [m for m, found in MODULES.items() if found.root_names and FLOORS[_part(m)] < FACES] == []


def test_the_package_root_loads_only_the_ground_floor() -> None:
    assert {_part(m) for m in _loads("guarduq")} <= {p for p, f in FLOORS.items() if f == 0}


@pytest.mark.parametrize("level", ["module", "part"])
def test_no_circles(level: str) -> None:
    graph = _graph()
    if level == "part":
        parts: dict[str, set[str]] = {}
        for m, targets in graph.items():
            parts.setdefault(_part(m), set()).update(_part(t) for t in targets if _part(t) != _part(m))
        graph = parts
    assert _cycles(graph) == []


def test_the_circle_finder_finds_circles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("part,heavy", [("policy", HEAVY), ("store", ML), ("review", ML)])
def test_light_faces_load_no_torch(part: str, heavy: set[str]) -> None:
    """Everything importing them runs, parent ``__init__`` included; the policy not even numpy."""
    assert any(_part(m) == part for m in MODULES)
    for m in (m for m in MODULES if _part(m) == part):
        loaded = _loads(m)
        found = {i for r in loaded for i in MODULES[r].top if i.split(".")[0] in heavy}
        assert not found, f"{m} loads {sorted(found)} through {sorted(loaded)}"


# Private names that still cross into another module (a ratchet: the list only shrinks). The
# scorers and SVE training share public names only (#34).
CROSSING = {
    "guarduq.cli._cascade": {"_check_outputs", "_json_default", "_score_all", "_splitter", "_sve_plan", "_xy"},
    "guarduq.cli.calibrate": {"_cmd_cascade", "_check_outputs", "_json_default", "_score_all", "_splitter",
                              "_sve_plan", "_sve_shape", "_xy"},
    "guarduq.calibration.calibrator": {"_labels"},
    "guarduq.calibration.datasets": {"_content_id", "_require", "_RowError"},
    "guarduq.integrations.langchain.callback": {"_ended", "_payload_of"},
    "guarduq.integrations.langchain.runnable": {"_ended", "_payload_of"},
    "guarduq.policy.engine": {"_evaluate", "_fmt", "_signals_in", "_raise_issues"},
    "guarduq.policy.second_opinion": {"_fmt"},
    "guarduq.sve.ensemble": {"_atomic_save", "_read_artifact", "_svds", "_block_indices", "_block_of",
                             "_hidden_size", "_PrefixSharing", "_same_logits", "_select_modules"},
    "guarduq.sve.io": {"_weight_as_linear"},
}


def test_private_names_cross_only_where_known() -> None:
    crossing = {m: {p.rpartition(".")[2] for p in found.private} for m, found in MODULES.items() if found.private}
    new = {m: names - CROSSING.get(m, set()) for m, names in crossing.items()}
    assert {m: n for m, n in new.items() if n} == {}
    assert not any(_part(m) == "scoring" or m == "guarduq.sve.training" for m in crossing)
