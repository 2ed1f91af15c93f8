"""Worker side: tqdm bars on a rank become coalesced progress events for the notebook.

:func:`install_progress_bridge` (run in each worker before the user's code) swaps tqdm's classes
(``tqdm.tqdm``, ``tqdm.std``, ``tqdm.auto``, ``tqdm.notebook``, ``tqdm.asyncio``, and ``trange``
through them) for :class:`RankTqdm`, and the name ``tqdm`` in modules imported earlier (a fork
server preloads the notebook's libraries before the bridge exists) that bound tqdm's own class
(``from tqdm.auto import tqdm``: transformers' Trainer progress bar). A ``RankTqdm`` writes
nothing to the worker's streams (no ``\\r`` text reaches the notebook); instead it sends
``ProgressUpdate`` events, at most one per ``MIN_INTERVAL`` per bar. An update skipped by that
limit is sent later by a small flusher thread, and the final state (exact n, total, elapsed,
rate) is always sent when the bar closes. Disabled bars send nothing.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any

from tqdm.asyncio import tqdm_asyncio

from nbaccel.launch.rank.worker import emit
from nbaccel.notebook.events import PROGRESS, ProgressUpdate
from nbaccel.notebook.rank.on_import import when_imported

__all__ = ["MIN_INTERVAL", "RankTqdm", "install_progress_bridge"]

MIN_INTERVAL = 0.1  # seconds between two updates of one bar (10/s at most)
TEXT_INTERVAL = 10.0  # seconds between two states printed by text renderers
_FILE_ARG, _DISABLE_ARG = 4, 10  # positions of ``file`` and ``disable`` in tqdm's signature
_ids = itertools.count(1)


class _NullFile:
    """Where a bridged bar "prints": nowhere."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


_NULL = _NullFile()


class _Flusher:
    """Sends the update a bar held back (rate limit) once its interval has passed."""

    def __init__(self) -> None:
        self._due: dict[RankTqdm, float] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def schedule(self, bar: RankTqdm, due: float) -> None:
        with self._cond:
            self._due.setdefault(bar, due)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="nbaccel-tqdm")
                self._thread.start()
            self._cond.notify()

    def discard(self, bar: RankTqdm) -> None:
        with self._cond:
            self._due.pop(bar, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                now = time.monotonic()
                first = min(self._due.values())
                if first > now:
                    self._cond.wait(first - now)
                    continue
                ready = [bar for bar, due in self._due.items() if due <= now]
                for bar in ready:
                    del self._due[bar]
            for bar in ready:
                bar._nb_flush()


_flusher = _Flusher()


class RankTqdm(tqdm_asyncio):
    """A tqdm bar whose display is a stream of progress events to the notebook."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("display", None)  # tqdm.notebook's own argument
        args = list(args)
        if len(args) > _FILE_ARG:
            args[_FILE_ARG] = _NULL
        else:
            kwargs["file"] = _NULL
        if len(args) > _DISABLE_ARG:
            args[_DISABLE_ARG] = bool(args[_DISABLE_ARG])
        elif kwargs.get("disable") is None:  # "off when not a TTY": the notebook is our TTY
            kwargs["disable"] = False
        self._nb_id = next(_ids)
        self._nb_lock = threading.Lock()
        self._nb_last = float("-inf")
        self._nb_last_text = time.monotonic()
        self._nb_final = False
        self._nb_held = False
        self._nb_sent = False
        super().__init__(*args, **kwargs)

    # tqdm calls display() from refresh(), at most every ``mininterval`` by default.
    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self._nb_final or msg == "":
            return True
        now = time.monotonic()
        if now - self._nb_last >= MIN_INTERVAL:
            with self._nb_lock:
                if not self._nb_final:
                    self._nb_send(now)
        elif not self._nb_held:
            self._nb_held = True
            _flusher.schedule(self, self._nb_last + MIN_INTERVAL)
        return True

    def _nb_flush(self) -> None:
        """The flusher's turn: send the held-back state if nothing was sent meanwhile."""
        with self._nb_lock:
            if self._nb_final or not self._nb_held:
                return
            now = time.monotonic()
            if now - self._nb_last >= MIN_INTERVAL:
                self._nb_send(now)
                return
        _flusher.schedule(self, self._nb_last + MIN_INTERVAL)

    def _nb_send(self, now: float, final: bool = False, leave: bool = True) -> None:
        self._nb_held = False  # first: a display() racing with us holds its state again
        d = self.format_dict
        elapsed = d["elapsed"]
        rate = d["rate"]
        if final:
            done = self.n - self.initial
            rate = done / elapsed if elapsed > 0 else None
        text = final or now - self._nb_last_text >= TEXT_INTERVAL
        if text:
            self._nb_last_text = now
        self._nb_last = now
        self._nb_sent = True
        emit(
            PROGRESS,
            ProgressUpdate(
                bar=self._nb_id,
                desc=d["prefix"] or "",
                n=self.n,
                total=d["total"],
                elapsed=elapsed,
                rate=rate,
                unit=d["unit"],
                unit_scale=d["unit_scale"],
                unit_divisor=d["unit_divisor"],
                postfix=d["postfix"],
                leave=leave,
                final=final,
                text=text,
            ),
        )

    def close(self) -> None:
        if getattr(self, "disable", True):
            return
        leave = abs(self.pos) == 0 if self.leave is None else bool(self.leave)
        _flusher.discard(self)
        with self._nb_lock:
            if not self._nb_final:
                self._nb_final = True
                if self._nb_sent or self.delay <= 0:
                    self._nb_send(time.monotonic(), final=True, leave=leave)
        super().close()

    def __hash__(self) -> int:
        return id(self)


def _trange(*args: Any, **kwargs: Any) -> RankTqdm:
    """``trange`` of every tqdm front end, bridged."""
    return RankTqdm(range(*args), **kwargs)


# module -> attributes to replace by the bridged class / trange
_CLASSES = {
    "tqdm": ("tqdm",),
    "tqdm.std": ("tqdm",),
    "tqdm.asyncio": ("tqdm", "tqdm_asyncio"),
    "tqdm.auto": ("tqdm",),
    "tqdm.autonotebook": ("tqdm",),
    "tqdm.notebook": ("tqdm", "tqdm_notebook"),
}
_TRANGES = {
    "tqdm": ("trange",),
    "tqdm.std": ("trange",),
    "tqdm.asyncio": ("trange", "tarange"),
    "tqdm.auto": ("trange",),
    "tqdm.autonotebook": ("trange",),
    "tqdm.notebook": ("trange", "tnrange"),
}


def _patch(module: ModuleType) -> None:
    for name in _CLASSES.get(module.__name__, ()):
        setattr(module, name, RankTqdm)
    for name in _TRANGES.get(module.__name__, ()):
        if hasattr(module, name):
            setattr(module, name, _trange)


class _Bridge:
    """Whether this process's tqdm bars are routed already."""

    installed = False


_bridge = _Bridge()


def _originals() -> set[type]:
    """tqdm's own classes as imported here (nothing is imported to find them)."""
    return {
        cls
        for name in _CLASSES
        if (module := sys.modules.get(name)) is not None
        for attr in _CLASSES[name]
        if isinstance(cls := getattr(module, attr, None), type)
    }


def _tqdm_bindings(originals: set[type]) -> list[tuple[str, str]]:
    """Where modules outside tqdm bound its names: ``(module, "tqdm" | "trange")`` pairs."""
    found = []
    for name, module in list(sys.modules.items()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or name == "tqdm" or name.startswith("tqdm."):
            continue
        if names.get("tqdm") in originals:
            found.append((name, "tqdm"))
        bound = names.get("trange")
        if callable(bound) and str(getattr(bound, "__module__", "")).split(".")[0] == "tqdm":
            found.append((name, "trange"))
    return found


class _ForkedBindings:
    """The bindings, found in the parent just before it forks (again only when its modules
    changed), so that a forked rank rebinds those few names instead of walking every module:
    that walk writes reference counts into thousands of pages the rank shares copy-on-write with
    its parent (the fork server or the kernel), a cost paid again by every rank of every launch."""

    def __init__(self) -> None:
        self.modules = -1
        self.found: list[tuple[str, str]] | None = None

    def before_fork(self) -> None:
        if len(sys.modules) != self.modules:
            originals = _originals()
            self.found = _tqdm_bindings(originals) if originals else []
            self.modules = len(sys.modules)


_forked = _ForkedBindings()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_forked.before_fork)


def _rebind_imported(originals: set[type]) -> None:
    """Modules imported before the bridge (preloaded by the fork server: transformers'
    ``trainer_callback``, peft, datasets...) that bound tqdm's class with ``from tqdm.auto import
    tqdm`` get the bridged one under that name; a forked rank takes the places its parent found
    before the fork, any other process looks for them."""
    found = _forked.found if _forked.found is not None else _tqdm_bindings(originals)
    for name, attr in found:
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, attr, RankTqdm if attr == "tqdm" else _trange)


def install_progress_bridge() -> None:
    """Route every tqdm bar of this process to the notebook (idempotent)."""
    if _bridge.installed:
        return
    _bridge.installed = True
    import tqdm.std  # noqa: F401  (imported: patch the package and its modules now)

    originals = _originals()
    when_imported(dict.fromkeys(_CLASSES, _patch))
    _rebind_imported(originals)
