"""The layers of the tree, checked from the source: nbaccel's import graph, built with ``ast``.

Every import counts, lazy ones inside functions included. The engine (``launch/``) knows nothing
of notebooks or training, ``distributed/`` nothing of training; no module or subpackage imports
itself back through others; no nbaccel import hides behind ``except ImportError``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nbaccel"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement reaches (``from a import b`` may be module a.b)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        return [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return []


def _resolve(name: str) -> str | None:
    """The nbaccel module a dotted name lives in (the longest known prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    guarded = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            for name in _imported(node, module, is_package):
                target = _resolve(name)
                # a module importing its own parent package is Python's import order, not a cycle
                if target and target != module and not module.startswith(target + "."):
                    edges[module].add(target)
            if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers
            ):
                for statement in node.body:
                    for inner in ast.walk(statement):
                        names = _imported(inner, module, is_package)
                        if any(n.split(".")[0] == "nbaccel" for n in names):
                            guarded.append(f"{module}:{inner.lineno}")
    return edges, guarded


EDGES, GUARDED = _graph()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    nodes = set(edges) | {t for targets in edges.values() for t in targets}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def _imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: t for m, t in EDGES.items() if m == prefix or m.startswith(prefix + ".")}


def test_the_graph_sees_lazy_imports() -> None:
    # notebook_launcher's front imports the engine's run module at the top, and the fork
    # server's module imports the worker inside a function: both must be edges
    assert "nbaccel.launch.run" in EDGES["nbaccel.notebook.kernel.launcher"]
    assert "nbaccel.launch.rank.worker" in EDGES["nbaccel.launch.launchers.forkserver.loop"]
    assert len(MODULES) > 50


def test_no_module_cycles() -> None:
    assert _cycles(EDGES) == []


PACKAGES = sorted(m for m, path in MODULES.items() if path.name == "__init__.py")


def _sibling_edges(package: str) -> dict[str, set[str]]:
    """Imports between the direct children (sub-packages and modules) of ``package``, each
    child standing for everything below it."""
    prefix = package + "."

    def child(module: str) -> str:
        return prefix + module[len(prefix) :].split(".")[0]

    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in EDGES.items():
        if not module.startswith(prefix):
            continue
        for target in targets:
            if target.startswith(prefix) and child(module) != child(target):
                edges[child(module)].add(child(target))
    return edges


def test_the_sibling_check_sees_every_depth() -> None:
    # the engine's own sub-packages are checked, not only nbaccel's top-level ones
    assert "nbaccel.launch.wire" in _sibling_edges("nbaccel.launch")["nbaccel.launch.driver"]
    assert "nbaccel.launch.remote" in PACKAGES


@pytest.mark.parametrize("package", PACKAGES)
def test_no_sibling_cycles(package: str) -> None:
    """No two children of a package import each other, directly or around a loop, at any
    depth: the layers of every folder point one way."""
    edges = _sibling_edges(package)
    pairs = sorted(
        {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())}
    )
    assert pairs == []
    assert _cycles(edges) == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("nbaccel.launch", ("nbaccel.notebook", "nbaccel.training")),
        ("nbaccel.distributed", ("nbaccel.training",)),
    ],
)
def test_lower_layers_do_not_import_upper_ones(layer: str, forbidden: tuple[str, ...]) -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _imports_of(layer).items()
        for target in targets
        if target.startswith(forbidden)
    )
    assert upward == []


def test_no_guarded_self_imports() -> None:
    assert sorted(GUARDED) == []


def test_values_sit_at_the_bottom() -> None:
    # nbaccel/values/ (sizes, byte text, booleans) is read by every layer, so it imports none
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _imports_of("nbaccel.values").items()
        for target in targets
        if not target.startswith("nbaccel.values")
    )
    assert upward == []
    assert any("nbaccel.values.sizes" in targets for targets in EDGES.values())
