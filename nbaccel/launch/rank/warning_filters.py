"""The notebook's warning filters, rebuilt in a rank without importing anything.

A filter holds its warning category, a class; unpickling it in a rank imports the class's
module. A kernel's filters name IPython's own (``IPython.core.completer``'s provisional
completer warning), so every rank of every launch imported IPython, traitlets and pygments as it
started, several times the cost of a no-op launch (``benchmarks/bench_launcher.py``).
Filters travel as names instead. A category whose module the rank has already imported is the
class itself; any other stands in as a placeholder that matches once its module is imported,
never importing it: a warning of that category cannot be raised before its module is imported.
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import Any

__all__ = ["capture", "install"]

#: one filter as it travels: action, message pattern, category (module, qualified name),
#: module pattern, line number
Filter = tuple[str, Any, str, str, Any, int]


def capture() -> list[Filter]:
    """This process's filters, most recent first; a category the notebook defined (in
    ``__main__`` or inside a function) cannot exist in a rank and its filters stay here."""
    kept = []
    for action, message, category, module, lineno in warnings.filters:
        owner = getattr(category, "__module__", "__main__")
        name = getattr(category, "__qualname__", "<locals>")
        if owner == "__main__" or "<locals>" in name:
            continue
        if not all(p is None or isinstance(p, (re.Pattern, str)) for p in (message, module)):
            continue  # patterns are compiled, or plain text (Python's own default filters)
        kept.append((action, message, owner, name, module, lineno))
    return kept


def install(filters: list[Filter]) -> None:
    """Make ``filters`` (what :func:`capture` read) this process's warning filters."""
    rebuilt = [
        (action, message, _category(owner, name), module, lineno)
        for action, message, owner, name, module, lineno in filters
    ]
    if rebuilt:
        warnings.filters[:] = rebuilt
        warnings._filters_mutated()  # type: ignore[attr-defined]  # what filterwarnings calls


def _loaded(owner: str, name: str) -> type | None:
    """The class ``owner.name`` when its module is already imported here, else None."""
    found: Any = sys.modules.get(owner)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def _category(owner: str, name: str) -> type:
    found = _loaded(owner, name)
    if found is not None:
        return found
    return _NotYetImported(
        name.rpartition(".")[2], (Warning,), {"_owner": owner, "_name": name, "__module__": owner}
    )


class _NotYetImported(type):
    """The metaclass of a placeholder category: ``issubclass(raised, placeholder)`` (how the
    warnings machinery, C or Python, matches a filter) asks the real class once its module
    is imported, and is False before."""

    _owner: str
    _name: str
    _real: type | None = None  # found once its module is imported

    def __subclasscheck__(cls, subclass: type) -> bool:
        if cls._real is None:
            cls._real = _loaded(cls._owner, cls._name)
        return cls._real is not None and issubclass(subclass, cls._real)
