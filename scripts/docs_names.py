"""The reference entries of the names nbaccel serves under Accelerate's import paths, and the
check that every name the docs import from nbaccel has an entry.

- :func:`alias_names`: each public class and function of ``nbaccel/compat/aliases.py`` (what
  ``from nbaccel.utils import X`` gives, where Accelerate has ``from accelerate.utils import X``)
  that ``nbaccel.__all__`` does not hold, with the import paths that serve it.
- :func:`render`: the page of those names, one mkdocstrings entry each.
- :func:`imports`: every ``from nbaccel... import name`` of the docs' pages and notebooks; the
  names among them that no other page documents get an entry too (:func:`module_names`).
- :func:`check_documented`: raises naming each imported name that does not exist.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ``from nbaccel import a, b`` / ``from nbaccel.utils import (a, b as c)``, one or many lines
_IMPORT = re.compile(r"from\s+(nbaccel(?:\.[\w.]+)?)\s+import\s+(\([^)]*\)|[^\n]*)")


def alias_names() -> dict[str, tuple[object, list[str]]]:
    """name -> (object, the façade modules that serve it), for names outside ``__all__``."""
    import nbaccel
    from nbaccel.compat.aliases import ALIASES
    from nbaccel.compat.finder import resolve

    found: dict[str, tuple[object, list[str]]] = {}
    for module, sources in sorted(ALIASES.items()):
        for source in sources:
            if source.startswith("="):  # a real module served whole under that path
                continue
            for name, obj in resolve(source).items():
                if name.startswith("_") or name in nbaccel.__all__:
                    continue
                if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                    continue
                entry = found.setdefault(name, (obj, []))
                if module not in entry[1]:
                    entry[1].append(module)
    return dict(sorted(found.items(), key=lambda item: item[0].lower()))


def _static(obj: object) -> bool:
    """Whether ``obj`` is written in its module's source (mkdocstrings reads the source)."""
    if "<locals>" in obj.__qualname__:
        return False
    module = importlib.import_module(obj.__module__)
    try:
        source = Path(inspect.getsourcefile(module) or "").read_text()
    except (OSError, TypeError):
        return False
    top = obj.__qualname__.split(".")[0]
    return re.search(rf"^(?:class|def|async def) {re.escape(top)}\b", source, re.M) is not None


def _identifier(obj: object) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def render() -> str:
    lines = [
        "# Accelerate's other names",
        "",
        "Accelerate's guides import many names from its submodules (`accelerate.utils`, "
        "`accelerate.big_modeling`, ...). nbaccel serves the same names under the same paths "
        "(`from nbaccel.utils import BnbQuantizationConfig`), besides the names of "
        "`from nbaccel import ...` listed on the other reference pages. Each entry says where "
        "it can be imported from.",
        "",
    ]
    lines += _entries(alias_names())
    used = module_names()
    if used:
        lines += [
            "## Names the guides import from nbaccel's modules",
            "",
            "A few guides and example notebooks import a helper from the module that defines it.",
            "",
            *_entries(used),
        ]
    return "\n".join(lines) + "\n"


def _entries(names: dict[str, tuple[object, list[str]]]) -> list[str]:
    lines = []
    for name, (obj, modules) in names.items():
        paths = ", ".join(f"`{m}`" for m in modules[:4])
        more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
        heading = f"## {name} {{ #{obj.__module__}.{name} }}"
        if getattr(obj, "__name__", name) != name:  # served under another name
            served = f"`{obj.__name__}`, served as `{name}`."
            lines += [heading, "", served, "", f"Import from {paths}{more}.", ""]
            continue
        if not _static(obj):  # made at import time (a placeholder): its own heading
            doc = (inspect.getdoc(obj) or "").split("\n\n")[0]
            lines += [heading, "", doc, "", f"Import from {paths}{more}.", ""]
            continue
        lines += [
            f"::: {_identifier(obj)}",
            "    options:",
            "      heading_level: 2",
            "      show_root_full_path: false",
            "",
            f"Import from {paths}{more}.",
            "",
        ]
    return lines


def _sources(root: Path) -> list[tuple[str, str]]:
    """(where, text) of every docs page and of every example notebook's code."""
    out = [(str(p.relative_to(root)), p.read_text()) for p in sorted((root / "docs").rglob("*.md"))]
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        out.append((str(path.relative_to(root)), code))
    return out


def imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(where, module, name) of every ``from nbaccel... import name`` in the docs' pages and
    the example notebooks' code."""
    out = []
    for where, text in _sources(root):
        for module, names in _IMPORT.findall(text):
            for part in names.strip("()").split(","):
                name = part.split("#")[0].strip().split(" as ")[0].strip()
                if re.fullmatch(r"[A-Za-z_]\w*", name):
                    out.append((where, module, name))
    return out


def _resolve(module: str, name: str) -> object:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise LookupError(f"{module}.{name}: {err}") from None


def module_names(root: Path = ROOT) -> dict[str, tuple[object, list[str]]]:
    """The names the docs import from nbaccel's own modules that neither ``nbaccel.__all__``
    nor Accelerate's paths hold: name -> (object, the modules it is imported from)."""
    import nbaccel

    documented = set(nbaccel.__all__) | set(alias_names())
    found: dict[str, tuple[object, list[str]]] = {}
    for _where, module, name in imports(root):
        if name in documented:
            continue
        obj = _resolve(module, name)
        if inspect.ismodule(obj):
            continue
        entry = found.setdefault(name, (obj, []))
        if module not in entry[1]:
            entry[1].append(module)
    return dict(sorted(found.items(), key=lambda item: item[0].lower()))


def check_documented(root: Path = ROOT) -> None:
    """Raise naming each ``from nbaccel... import name`` of the docs that does not resolve
    (every name that resolves has an entry: the reference pages are generated from them)."""
    broken = []
    for where, module, name in imports(root):
        try:
            _resolve(module, name)
        except LookupError as err:
            broken.append(f"{where}: {err}")
    if broken:
        raise RuntimeError(
            "the docs import names nbaccel does not have, so the reference cannot document "
            "them: " + "; ".join(broken) + ". Fix the import, or export the name."
        )
