"""Errors raised in the notebook when ranks fail, carrying the remote traceback.

The original exception type is re-raised (``ValueError`` stays ``ValueError``) with its message
prefixed by the rank, and a :class:`RemoteTraceback` attached as ``__cause__`` so the notebook
shows the rank's own frames (launcher internals trimmed, notebook cell lines filled in).

The traceback's text (frames, chain of causes, bounds) is ``nbaccel.launch.wire.tracebacks``'s; here
an exception is pickled so that its own class comes back with its attributes, and given its
rank's label.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import sys
import time
from typing import Any

from nbaccel.launch.wire.labels import LOCAL_LABELS, RankLabels
from nbaccel.launch.wire.tracebacks import (
    bounded_message,
    chain,
    format_frames,
    safe_message,
    user_frames,
)

__all__ = [
    "add_to_message",
    "exit_hint",
    "LaunchTimeout",
    "RankCrashed",
    "RankError",
    "RemoteTraceback",
    "ResultNotLoadable",
    "describe_exception",
    "is_peer_loss",
    "rebuild_exception",
    "result_not_loadable",
    "shown_message",
    "unlabelled",
]

# What a rank's error says when it is only the echo of a peer that died or failed first: its
# collective lost the connection. Such an error never names the root cause of a launch.
_PEER_LOSS_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_PEER_LOSS_TEXT = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "connectFullMesh failed",
    "NCCL communicator was aborted",
)


class RankError(RuntimeError):
    """A rank raised an exception that could not be rebuilt in the notebook."""

    def __init__(
        self, rank: int, type_name: str, message: str, labels: RankLabels = LOCAL_LABELS
    ) -> None:
        super().__init__(f"[{labels.label(rank)}] {type_name}: {bounded_message(message)}")
        self.rank = rank
        self.type_name = type_name
        self.remote_message = message


class RankCrashed(RuntimeError):
    """A rank ended without returning or raising: a non-zero exit code or a signal."""

    def __init__(
        self, rank: int, returncode: int, description: str, labels: RankLabels = LOCAL_LABELS
    ) -> None:
        super().__init__(f"{labels.label(rank)} {description}")
        self.rank = rank
        self.returncode = returncode


class ResultNotLoadable(RuntimeError):
    """A rank's function returned, but the notebook cannot unpickle its value."""


class LaunchTimeout(TimeoutError):
    """The launch ran longer than its ``timeout``; every rank was stopped."""


class RemoteTraceback(Exception):
    """Holds a rank's traceback text; shown as the cause of the re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


def is_peer_loss(info: dict[str, Any]) -> bool:
    """True when a rank's error (``describe_exception``'s dict) is a lost connection to a peer:
    the consequence of another rank's failure, not a cause."""
    if info.get("name") in _PEER_LOSS_TYPES:
        return True
    message = str(info.get("message", ""))
    return any(text in message for text in _PEER_LOSS_TEXT)


# A rank's stdin is empty (no keyboard reaches it): what reading it ends in, and what to do.
_NO_STDIN = {
    ("EOFError", "EOF when reading a line"): " (input() in a rank: ranks have no stdin; ask in "
    "the notebook and pass the answer in args)",
    ("BdbQuit", ""): "pdb stopped: breakpoint()/pdb in a rank has no stdin to read commands "
    "from. Debug the function in the notebook itself (one process), or print from the ranks.",
}


def exit_hint(info: dict[str, Any]) -> str:
    """What to do about a rank's ``sys.exit`` (``describe_exception``'s dict), where it is a
    known stumbling block: argparse rejecting the command line of the notebook's kernel (which
    ranks see as their ``sys.argv``; a script run by ``nbaccel launch`` has its own)."""
    frames = info.get("frames") or ()
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program.startswith("ipykernel") and any(
        os.path.basename(f[0]) == "argparse.py" and f[2] in ("error", "exit") for f in frames
    ):
        return (
            ": argparse's parse_args() read sys.argv, which in a notebook holds the kernel's own "
            "arguments (as it would for the same call in the notebook). Pass the arguments "
            "yourself (parser.parse_args(['--lr', '0.1'])), or parse them in the notebook and "
            "pass the result in args"
        )
    return ""


def _with_hint(exc: BaseException, message: str) -> str:
    """``message``, with what to do when it is a rank reading its empty stdin."""
    return message + _NO_STDIN.get((type(exc).__name__, message), "")


_BY_STATE = "nbaccel-exception-by-state"  # marks an exception pickled as (class, args, dict)


def _pickled(exc: BaseException) -> bytes | None:
    """``exc`` pickled so that the notebook can load it, or None.

    Pickle rebuilds an exception by calling its class with ``args``, which fails for the many
    classes whose ``__init__`` takes other arguments (``ShardError(shard, reason)`` passing a
    formatted message up). Those travel as their class, args and attributes instead, and are
    rebuilt without calling ``__init__`` (:func:`_loaded`): same class, same attributes, less
    any attribute that cannot be pickled (a lock, a socket)."""
    from nbaccel.launch.wire.pickling import dumps

    def travels(value: Any) -> bool:
        try:
            dumps(value)
        except Exception:
            return False
        return True

    def by_state() -> tuple:
        state = {name: value for name, value in vars(exc).items() if travels(value)}
        return (_BY_STATE, type(exc), exc.args, state)

    for attempt in (lambda: exc, by_state):
        try:
            pickled = dumps(attempt())
            _loaded(pickle.loads(pickled))
            return pickled
        except Exception:
            continue
    return None


def _loaded(value: Any) -> Any:
    """What :func:`_pickled` sent, as the exception (an object of another kind as it is)."""
    if isinstance(value, tuple) and len(value) == 4 and value[0] == _BY_STATE:
        _, cls, args, state = value
        exc = cls.__new__(cls, *args)
        exc.args = args
        exc.__dict__.update(state)
        return exc
    return value


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What a worker sends about an exception: type, message, frames, and the pickled object."""
    pickled = _pickled(exc)
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "name": type(exc).__name__,
        "message": _with_hint(exc, safe_message(exc)),
        "frames": user_frames(exc.__traceback__),
        "chain": chain(exc),
        "pickled": pickled,
        "time": time.time(),
        # the rank to name, when the worker knows better than the driver (an XLA device thread)
        "rank": getattr(exc, "_nbaccel_rank", None),
        "exit_code": _exit_code(exc) if isinstance(exc, SystemExit) else None,
    }


def _exit_code(exc: SystemExit) -> int:
    """The process exit code ``sys.exit(code)`` asks for (Python's own rules)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _same_type(info: dict[str, Any]) -> BaseException | None:
    """An instance of the rank's exception class when it is importable here, built without its
    constructor (which may need keyword arguments the message cannot give back): same type, so
    ``except``/``isinstance`` work, carrying the rank's message."""
    import importlib

    module, _, qualname = str(info.get("type", "")).rpartition(".")
    if not module or "<" in qualname:
        return None
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        if not (isinstance(target, type) and issubclass(target, BaseException)):
            return None
        exc = target.__new__(target)
        BaseException.__init__(exc, info["message"])
    except Exception:
        return None
    return exc


@functools.cache
def _labelled_class(base: type) -> type:
    """A subclass of ``base`` that shows a fixed text (``_nbaccel_text``) as its message, for
    exceptions whose own ``__str__`` cannot carry the rank (``OSError``'s errno form, a custom
    ``__str__``, non-string args such as ``ValueError(42)``). Same name, so the notebook shows
    the original type; ``isinstance`` and ``except`` work; it pickles as ``base``."""

    def __str__(self: BaseException) -> str:
        return self.__dict__.get("_nbaccel_text", "")

    def __reduce__(self: BaseException) -> Any:
        reduced = base.__reduce__(self)
        state = {k: v for k, v in (reduced[2] or {}).items() if k != "_nbaccel_text"}
        return (base, *reduced[1:2], state or None, *reduced[3:])

    return type(
        base.__name__,
        (base,),
        {
            "__str__": __str__,
            "__reduce__": __reduce__,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "_nbaccel_labelled_base": base,
        },
    )


def unlabelled(cls: type) -> type:
    """The exception class a labelled copy (:func:`_labelled_class`) stands for; ``cls``
    itself for every other class."""
    return cls.__dict__.get("_nbaccel_labelled_base", cls)


def shown_message(exc: BaseException, own_str: Any) -> str:
    """What ``exc`` shows: its rank label text when :func:`rebuild_exception` gave it one,
    else ``own_str(exc)`` (its class's own ``__str__``)."""
    text = getattr(exc, "__dict__", {}).get("_nbaccel_text")
    return text if text is not None else own_str(exc)


def _labelled_copy(exc: BaseException, text: str) -> BaseException:
    """``exc`` as an instance of :func:`_labelled_class`, its args and attributes kept."""
    cls = _labelled_class(type(exc))
    try:
        copy = cls.__new__(cls, *exc.args)
    except Exception:
        copy = cls.__new__(cls)
    copy.args = exc.args
    copy.__dict__.update(vars(exc))
    if isinstance(exc, OSError):
        for name in ("errno", "strerror", "filename", "filename2"):
            try:
                setattr(copy, name, getattr(exc, name))
            except (AttributeError, TypeError):
                pass
    copy.__dict__["_nbaccel_text"] = text
    copy.__traceback__ = exc.__traceback__
    return copy


def _label(exc: BaseException, text: str) -> BaseException:
    """``exc`` showing ``text`` (``[rank N] <the rank's message>``), of the same type.

    The common case (a single string argument that ``__str__`` shows as it is) gets the label
    in front of its argument; every other shape of args or ``__str__`` (``ValueError(42)``,
    ``OSError(errno, text)``, ``KeyError``, a custom ``__str__``, even one that raises) gets a
    labelled subclass of the same name, so no shape loses the label or the type.
    """
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        original = exc.args
        exc.args = (text,)
        try:
            if str(exc) == text:  # its __str__ shows its argument (NameError, ValueError...)
                return exc
        except Exception:
            pass
        exc.args = original
    return _labelled_copy(exc, text)


def rebuild_exception(
    info: dict[str, Any], rank: int, labels: RankLabels = LOCAL_LABELS
) -> BaseException:
    """The exception to raise in the notebook for a rank's error (``describe_exception``'s
    dict): the original type when it can be rebuilt here, its message prefixed with the rank
    as ``labels`` (its worker group's) name it, and the rank's traceback as its cause. The one
    place a rank's exception becomes the notebook's."""
    exc: BaseException | None = None
    if info.get("pickled") is not None:
        try:
            exc = _loaded(pickle.loads(info["pickled"]))
        except Exception:
            exc = None
        if exc is not None and not isinstance(exc, BaseException):
            exc = None
    if exc is None:
        exc = _same_type(info)
    labelled: BaseException | None = None
    if exc is not None:
        try:
            message = str(info.get("message", ""))
            shown = bounded_message(message)
            text = f"[{labels.label(rank)}] {shown}".rstrip()
            # a cut message must stay whole in args: only a labelled copy shows other text
            labelled = _label(exc, text) if shown is message else _labelled_copy(exc, text)
            str(labelled)  # the report must never fail on the way to the notebook
        except Exception:
            labelled = None
    if labelled is None:
        labelled = RankError(rank, info["name"], info["message"], labels)
    labelled.rank = rank  # type: ignore[attr-defined]
    labelled.__cause__ = RemoteTraceback(format_frames(info, rank))
    return labelled


def result_not_loadable(rank: int, exc: BaseException) -> dict[str, Any]:
    """The error of a rank whose function returned, but whose value cannot be unpickled in the
    notebook (its class lives in a module only the rank can import): ``describe_exception``'s
    dict of a :class:`ResultNotLoadable` naming the missing module or class and the fix."""
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if missing:
        what = f"module {missing!r}, which the notebook cannot import"
    else:
        found = re.search(r"Can't get attribute '([^']+)' on <module '([^']+)'", str(exc))
        what = (
            f"class {found.group(2)}.{found.group(1)}, which the notebook does not define"
            if found
            else f"an object the notebook cannot rebuild ({type(exc).__name__}: {exc})"
        )
    error = ResultNotLoadable(
        "the function succeeded, but its return value cannot be loaded "
        f"in the notebook: it needs {what}. Return plain data (numbers, tensors, dicts, a "
        "state_dict), or make that module importable in the notebook (same sys.path / package "
        "installed)."
    )
    info = describe_exception(error)
    info["frames"] = []
    return info


def add_to_message(exc: BaseException, extra: str) -> None:
    """Append ``extra`` to the message ``exc`` shows, whatever shape :func:`_label` gave it."""
    if "_nbaccel_text" in getattr(exc, "__dict__", {}):
        exc.__dict__["_nbaccel_text"] += extra
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}{extra}", *exc.args[1:])
