"""The import hook that materialises the façade paths of :mod:`nbaccel.compat.aliases`."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

from nbaccel.compat.aliases import ALIASES

_ROOT = "nbaccel"


def _public_names(module: types.ModuleType) -> list[str]:
    """``__all__`` when the module has one, else its public non-module attributes."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    ]


def resolve(spec: str) -> dict[str, Any]:
    """``"pkg.mod"`` -> its public names; ``"pkg.mod:a,b"`` -> just those (``b=c`` renames)."""
    module_name, _, listed = spec.partition(":")
    module = importlib.import_module(module_name)
    if not listed:
        return {n: getattr(module, n) for n in _public_names(module)}
    out = {}
    for item in listed.split(","):
        item = item.strip()
        public, _, private = item.partition("=")
        out[public] = getattr(module, private or public)
    return out


def _has_children(fullname: str) -> bool:
    prefix = fullname + "."
    return any(k.startswith(prefix) for k in ALIASES)


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the façade modules listed in ``ALIASES`` (and only those)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == _ROOT or fullname not in ALIASES:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, self, is_package=_has_children(fullname), origin="nbaccel.compat.aliases"
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        sources = ALIASES[spec.name]
        if len(sources) == 1 and sources[0].startswith("="):  # the path IS that module
            module = importlib.import_module(sources[0][1:])
            module.__nbaccel_sources__ = (module.__name__,)
            return module
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ not in ALIASES:  # a real module served under a façade path
            return
        sources = ALIASES[module.__name__]
        names: dict[str, Any] = {}
        for source in sources:
            names.update(resolve(source))
        module.__dict__.update(names)
        module.__all__ = sorted(names)
        module.__nbaccel_sources__ = tuple(s.partition(":")[0] for s in sources)
        module.__doc__ = (
            f"Accelerate's import path, served by nbaccel.compat from: "
            f"{', '.join(module.__nbaccel_sources__)}."
        )


_FINDER = AliasFinder()


def install(package: str = _ROOT) -> Callable[[str], Any]:
    """Register the finder (once) and return the ``__getattr__`` for the package's extra names."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
    extras = ALIASES.get(package, ())

    def __getattr__(name: str) -> Any:
        # A façade subpackage (``nbaccel.utils``) is reached as an attribute once imported.
        sub = f"{package}.{name}"
        if sub in ALIASES:
            return importlib.import_module(sub)
        for source in extras:
            module_name, _, listed = source.partition(":")
            wanted = [i.strip().partition("=") for i in listed.split(",")] if listed else []
            for public, _, private in wanted:
                if public == name:
                    return getattr(importlib.import_module(module_name), private or public)
            if not listed:
                module = importlib.import_module(module_name)
                if name in _public_names(module):
                    return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
