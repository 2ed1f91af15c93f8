"""Worker side: run a hook on a module as soon as it is imported, or at once if it already is.

The rank's bridges adapt libraries the user's code imports (tqdm's front ends, transformers'
Trainer) without importing them first: :func:`when_imported` calls ``hook(module)`` right after
the module's own code ran, in whichever way the import happens (``import x``, a lazy package's
``importlib.import_module``), or immediately when the module is already loaded (preloaded by the
fork server, imported by an earlier call on a pool rank).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

Hook = Callable[[ModuleType], None]


class _ThenHook(importlib.abc.Loader):
    """A module's own loader, then the hook on the executed module."""

    def __init__(self, loader: importlib.abc.Loader, hook: Hook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package...: the real loader's
        return getattr(self._loader, name)


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Finds the listed modules through the other finders and hooks their loaders."""

    def __init__(self, hooks: Mapping[str, Hook]) -> None:
        self._hooks = dict(hooks)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hook = self._hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenHook(spec.loader, hook)
                return spec
        return None


def when_imported(hooks: Mapping[str, Hook]) -> None:
    """Run ``hooks[name](module)`` for each named module: now for those already imported, and
    right after its import for the others (every hook runs once per module load)."""
    later = {}
    for name, hook in hooks.items():
        module = sys.modules.get(name)
        if module is not None:
            hook(module)
        else:
            later[name] = hook
    if later:
        sys.meta_path.insert(0, _HookOnImport(later))
