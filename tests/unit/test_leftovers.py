"""No leftovers: every module-level function of nbaccel is referenced somewhere (called,
exported in ``__all__``, named by the compat alias table, a test, a benchmark, a script or the
docs). A function nothing names is dead code, checked from the source with ``ast``."""

from __future__ import annotations

import ast
import re
import textwrap
from collections import Counter
from pathlib import Path

from nbaccel.compat.aliases import ALIASES

REPO = Path(__file__).resolve().parents[2]
_TEXT = {".py", ".md", ".ipynb", ".toml", ".yml", ".cfg", ".txt", ""}
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_WHERE = ("nbaccel", "tests", "benchmarks", "scripts", "docs", "notebooks", "binder")


def _tracked() -> list[Path]:
    """The project's text files (the package, tests, benchmarks, scripts, docs, notebooks and
    the configuration), recorded results left out."""
    found = [REPO / "pyproject.toml", REPO / "mkdocs.yml"]
    for folder in _WHERE:
        found += [
            path
            for path in sorted((REPO / folder).rglob("*"))
            if path.is_file()
            and path.suffix in _TEXT
            and "__pycache__" not in path.parts
            and (REPO / "benchmarks" / "results") not in path.parents
        ]
    return found


def _whole_modules() -> set[str]:
    """Modules the alias table serves whole (all their public names are Accelerate's API)."""
    return {
        source.lstrip("=")
        for sources in ALIASES.values()
        for source in sources
        if ":" not in source
    }


def unreferenced(sources: dict[str, str], whole: set[str]) -> list[str]:
    """``module:line name`` of the module-level functions of ``sources`` (dotted module ->
    text; other texts may be given under any key) whose name appears nowhere but in their own
    ``def``: no call, no ``__all__`` entry, no mention. Public functions of ``whole`` modules
    count as referenced."""
    words: Counter[str] = Counter()
    defined: Counter[str] = Counter()
    functions = []
    for module, text in sources.items():
        words.update(_WORD.findall(text))
        if not module.startswith("nbaccel"):
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                defined[node.name] += 1
                functions.append((module, node.lineno, node.name))
    return [
        f"{module}:{line} {name}"
        for module, line, name in functions
        if not (name.startswith("__") and name.endswith("__"))
        and not (module in whole and not name.startswith("_"))
        and words[name] <= defined[name]
    ]


def _sources() -> dict[str, str]:
    sources = {}
    for path in _tracked():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        relative = path.relative_to(REPO)
        if relative.parts[0] == "nbaccel" and path.suffix == ".py":
            parts = list(relative.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            sources[".".join(parts)] = text
        else:
            sources[str(relative)] = text
    return sources


def test_every_module_level_function_is_referenced():
    assert unreferenced(_sources(), _whole_modules()) == []


def test_the_check_finds_a_function_nothing_names():
    module = textwrap.dedent(
        """
        __all__ = ["exported"]

        def exported():
            return _used()

        def _used():
            return 1

        def forgotten():
            return 2

        def is_served_whole():
            return 3
        """
    )
    sources = {"nbaccel.m": module, "nbaccel.w": "def is_thing_available():\n    return 1\n"}
    assert unreferenced(sources, {"nbaccel.w"}) == [
        "nbaccel.m:10 forgotten",
        "nbaccel.m:13 is_served_whole",
    ]
    assert unreferenced({**sources, "tests/t.py": "forgotten()"}, {"nbaccel.w"}) == [
        "nbaccel.m:13 is_served_whole"
    ]


_FIGURE = re.compile(
    r"\d[\d.,]*\s?(ms|µs|ns)\b|\d[\d.,]*\s?x (faster|slower)|\d+% (sooner|faster|slower)"
    r"|\btook \d|\d[\d.,]*\s?[KMG]i?B measured",
    re.IGNORECASE,
)


def measured_figures(text: str, where: str) -> list[str]:
    """``where:line`` of the docstring lines of ``text`` that quote a measured figure (a time
    in ms, µs or ns, "N x faster", "N% sooner", "took N"): figures go stale in docstrings and
    belong to the benchmarks' results, dated, with their commit and machine."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is None:
            continue
        first = node.body[0].lineno
        found += [
            f"{where}:{first + i}"
            for i, line in enumerate(doc.splitlines())
            if _FIGURE.search(line)
        ]
    return found


def test_no_docstring_quotes_a_measured_figure():
    package = REPO / "nbaccel"
    found = [
        hit
        for path in sorted(package.rglob("*.py"))
        for hit in measured_figures(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert found == []


def test_the_figure_check_sees_timings():
    text = (
        '"""Forks cost about 3 ms here; 10x faster than before."""\n\n\n'
        'def f():\n    """Waits at most 0.2 s, keeps 10% free."""\n'
    )
    assert measured_figures(text, "m.py") == ["m.py:1"]
