"""The kernel tells the fork server what it imports, so ranks start with it (free while typing).

Two hooks, installed when nbaccel is imported in a Jupyter kernel:

- an import watcher (first on ``sys.meta_path``, finding nothing itself): when the kernel starts
  importing a library (``import transformers``, ``from transformers import LlamaForCausalLM``),
  the server starts importing it too, on another core, at once; by the time the cell ends both
  are done;
- after each cell (IPython's ``post_run_cell``): the server imports whatever else the kernel
  now holds (submodules reached lazily, ``transformers.models.llama``...), and is replaced by a
  fresh one when one of the kernel's files changed or an import made it unsafe to fork; so do
  the servers of the kernel's warm agents on other hosts (``remote.warm.mirror_to_agents``).

Both are off with ``NBACCEL_PRELOAD=off``; the engine's side is
``nbaccel.launch.launchers.forkserver.kernel_modules`` and ``forkserver.get_forkserver``.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from nbaccel.launch.launchers.forkserver.kernel_modules import is_candidate, preload_setting
from nbaccel.launch.launchers.forkserver.launcher import mirror_kernel_modules, mirror_soon

__all__ = ["ImportWatcher", "install"]


class ImportWatcher:
    """A ``sys.meta_path`` entry that finds nothing: it sees the kernel's main thread begin an
    import and has the fork server import the same module meanwhile."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._main = threading.main_thread()
        self._pid = os.getpid()  # a rank forked from the kernel inherits it: it keeps quiet

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name not in self.seen and os.getpid() == self._pid and _importing():
            self.seen.add(name)
            if threading.current_thread() is self._main and is_candidate(name):
                try:
                    mirror_soon(name)
                except Exception:  # never in the way of the kernel's own import
                    pass
        return None

    def invalidate_caches(self) -> None:
        """Nothing cached (``importlib.invalidate_caches`` calls every finder)."""


def _importing() -> bool:
    """True when the finders are asked because of an import statement, not a probe
    (``importlib.util.find_spec("deepspeed")``, how libraries test what is installed)."""
    try:
        caller = sys._getframe(3).f_code.co_name  # the import system's frames, above _find_spec
    except ValueError:
        return False
    return caller == "_find_and_load_unlocked"


def _after_cell(*_: Any) -> None:
    try:
        mirror_kernel_modules()
        warm = sys.modules.get("nbaccel.launch.remote.warm")  # agents only where it is loaded
        if warm is not None:
            warm.mirror_to_agents()
    except Exception as exc:  # a hook must not break the notebook
        print(f"[nbaccel] could not update the fork server's preload: {exc}", file=sys.stderr)


def install(shell: Any = None) -> bool:
    """Install both hooks in this kernel (once); False where preloading is off or no kernel."""
    if not preload_setting().mirrors():
        return False
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    if shell is None or getattr(shell, "_nbaccel_preload_hook", False):
        return False
    shell._nbaccel_preload_hook = True
    shell.events.register("post_run_cell", _after_cell)
    if not any(isinstance(finder, ImportWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, ImportWatcher())
    return True
