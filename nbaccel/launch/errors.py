"""Errors raised in the notebook when ranks fail, carrying the remote traceback.

The original exception type is re-raised (``ValueError`` stays ``ValueError``) with its message
prefixed by the rank, and a :class:`RemoteTraceback` attached as ``__cause__`` so the notebook
shows the rank's own frames (launcher internals trimmed, notebook cell lines filled in).
"""

from __future__ import annotations

import linecache
import os
import pickle
import time
from typing import Any

from nbaccel.launch.labels import LOCAL_LABELS, RankLabels

__all__ = [
    "LaunchTimeout",
    "RankCrashed",
    "RankError",
    "RemoteTraceback",
    "describe_exception",
    "hide_frames_of",
    "is_peer_loss",
    "rebuild_exception",
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

_INTERNAL: list[str] = [os.path.dirname(os.path.abspath(__file__))]


def hide_frames_of(path: str) -> None:
    """Trim the frames of ``path`` (a file or folder) from remote tracebacks, like the
    launcher's own (used by the pool's worker functions)."""
    _INTERNAL.append(os.path.abspath(path))


class RankError(RuntimeError):
    """A rank raised an exception that could not be rebuilt in the notebook."""

    def __init__(
        self, rank: int, type_name: str, message: str, labels: RankLabels = LOCAL_LABELS
    ) -> None:
        super().__init__(f"[{labels.label(rank)}] {type_name}: {message}")
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


def _user_frames(tb: Any) -> list[tuple[str, int, str, str | None]]:
    import traceback

    frames = []
    for frame in traceback.extract_tb(tb):
        if os.path.abspath(frame.filename).startswith(tuple(_INTERNAL)):
            continue
        frames.append((frame.filename, frame.lineno or 0, frame.name, frame.line))
    return frames


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What a worker sends about an exception: type, message, frames, and the pickled object."""
    import cloudpickle

    try:
        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "name": type(exc).__name__,
        "message": str(exc),
        "frames": _user_frames(exc.__traceback__),
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


def format_frames(info: dict[str, Any], rank: int | None) -> str:
    """Render the remote traceback; lines missing remotely come from this process's linecache
    (that is where IPython keeps the source of notebook cells). ``rank=None`` gives Python's
    own header."""
    origin = "" if rank is None else f" from rank {rank}"
    lines = [f"Traceback{origin} (most recent call last):"]
    for filename, lineno, name, line in info["frames"]:
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        text = line or linecache.getline(filename, lineno).strip()
        if text:
            lines.append(f"    {text}")
    lines.append(f"{info['name']}: {info['message']}")
    return "\n".join(lines)


def _same_type(info: dict[str, Any], rank: int, labels: RankLabels) -> BaseException | None:
    """An instance of the rank's exception class when it is importable here, built without its
    constructor (which may need keyword arguments the message cannot give back): same type, so
    ``except``/``isinstance`` work, with the rank's message."""
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
        BaseException.__init__(exc, f"[{labels.label(rank)}] {info['message']}")
        str(exc)  # a __str__ that needs its missing attributes must not break the report
    except Exception:
        return None
    return exc


def rebuild_exception(
    info: dict[str, Any], rank: int, labels: RankLabels = LOCAL_LABELS
) -> BaseException:
    """The exception to raise in the notebook: original type when possible, naming the rank
    as ``labels`` (its worker group's) do."""
    exc: BaseException | None = None
    if info.get("pickled") is not None:
        try:
            exc = pickle.loads(info["pickled"])
        except Exception:
            exc = None
    if exc is None:
        exc = _same_type(info, rank, labels)
        if exc is not None:
            exc.rank = rank  # type: ignore[attr-defined]
            exc.__cause__ = RemoteTraceback(format_frames(info, rank))
            return exc
    if exc is None:
        exc = RankError(rank, info["name"], info["message"], labels)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[{labels.label(rank)}] {exc.args[0]}", *exc.args[1:])
    elif not isinstance(exc, KeyboardInterrupt):
        exc.args = (f"[{labels.label(rank)}]", *exc.args)
    exc.rank = rank  # type: ignore[attr-defined]
    exc.__cause__ = RemoteTraceback(format_frames(info, rank))
    return exc
