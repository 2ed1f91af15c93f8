"""Every import of nbaccel is of a package the install brings where it runs.

Walked with ``ast`` (lazy imports inside functions count): a third-party package is imported
only where ``pyproject.toml`` declares it. A package that the core dependencies bring (directly
or through their own requirements, as installed) anywhere; a package of an extra only in that
extra's modules (``[tool.nbaccel.optional-imports]``); a library the user brings only as one of
``user-libraries``; the contributor tools only where listed; anything else only under
``except ImportError`` with a fallback. ``launcher="ray"`` once failed under ``pip install ray``
because the address check imported grpc, which only ``ray[default]`` brings: this finds that.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same reader, as the dev extra installs it
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomli before 3.11")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DECLARED = PYPROJECT["tool"]["nbaccel"]["optional-imports"]
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str], extra: str = "") -> set[str]:
    """The distributions ``requirements`` bring, through the installed ones' own requirements."""
    seen: set[str] = set()
    todo = [(r, extra) for r in requirements]
    while todo:
        text, wanted = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": wanted}):
            continue
        name = _norm(req.name)
        if name == "nbaccel":
            for inner in req.extras:
                todo += [(r, "") for r in PYPROJECT["project"]["optional-dependencies"][inner]]
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            own = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for inner in [""] + sorted(req.extras):
            todo += [(r, inner) for r in own if inner or "extra ==" not in r]
    return seen


CORE = _closure(PYPROJECT["project"]["dependencies"])
EXTRAS = {
    extra: _closure(PYPROJECT["project"]["optional-dependencies"][extra])
    for extra in DECLARED
    if extra in PYPROJECT["project"]["optional-dependencies"]
}
_DISTRIBUTIONS = metadata.packages_distributions()


def _dists(module: str) -> set[str]:
    """The distributions that provide top-level ``module`` (its own name where not installed)."""
    return {_norm(d) for d in _DISTRIBUTIONS.get(module, [])} or {_norm(module)}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """``node`` sits in the body of a ``try`` that catches ImportError."""
    child, current = node, parents.get(node)
    while current is not None:
        if isinstance(current, ast.Try) and child in current.body:
            for handler in current.handlers:
                kinds = handler.type
                names = [kinds] if not isinstance(kinds, ast.Tuple) else list(kinds.elts)
                if kinds is None or any(getattr(n, "id", "") in _IMPORT_ERRORS for n in names):
                    return True
        child, current = current, parents.get(current)
    return False


def _under(path: str, places: list[str]) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in places)


def _sources() -> list[tuple[str, str]]:
    files = sorted((ROOT / "nbaccel").rglob("*.py"))
    return [(file.relative_to(ROOT).as_posix(), file.read_text()) for file in files]


def _problems(sources: list[tuple[str, str]]) -> list[str]:
    """Each import of ``sources`` ((path, text) pairs) made where nothing declares it."""
    problems = []
    for path, text in sources:
        tree = ast.parse(text, path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top in sys.stdlib_module_names or top == "nbaccel":
                    continue
                dists = _dists(top)
                if dists & CORE or _guarded(node, parents):
                    continue
                extras = [e for e, brought in EXTRAS.items() if dists & brought]
                if any(_under(path, DECLARED[e]) for e in extras):
                    continue
                if dists & {_norm(n) for n in DECLARED["user-libraries"]}:
                    continue
                tools = DECLARED["contributor-tools"]
                if any(_under(path, tools[t]) for t in tools if _norm(t) in dists):
                    continue
                where = f"the {', '.join(extras)} extra's modules only" if extras else "nowhere"
                problems.append(f"{path}:{node.lineno} imports {name}, declared for {where}")
    return problems


def test_the_core_and_the_extras_are_read():
    assert {"torch", "psutil", "pyzmq", "numpy"} <= CORE  # numpy through matplotlib
    assert "ray" in EXTRAS["ray"] and "grpcio" not in EXTRAS["ray"]  # pip install ray: no grpc
    assert "deepspeed" in EXTRAS["deepspeed"]


def test_optional_packages_are_imported_only_where_declared():
    assert _problems(_sources()) == []


def test_the_check_sees_an_undeclared_import():
    """The grpc import of the Ray address check, as it was: unguarded in launch/remote/; and a
    package of an extra outside that extra's modules."""
    sample = "nbaccel/launch/remote/_probe_check_sample.py"
    found = _problems([(sample, "def probe():\n    import grpc\n    import ray\n")])
    assert found == [
        f"{sample}:2 imports grpc, declared for nowhere",
        f"{sample}:3 imports ray, declared for the ray extra's modules only",
    ]
    guarded = "try:\n    import grpc\nexcept ImportError:\n    grpc = None\n"
    assert _problems([(sample, guarded)]) == []


def test_every_declared_place_exists():
    """A module moved without its declaration would pass the check by declaring nothing."""
    places = [p for extra in EXTRAS for p in DECLARED[extra]]
    places += [p for tool in DECLARED["contributor-tools"].values() for p in tool]
    assert [p for p in places if not (ROOT / p).exists()] == []
