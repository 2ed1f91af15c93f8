"""Errors raised in the notebook when ranks fail, carrying the remote traceback.

The original exception type is re-raised (``ValueError`` stays ``ValueError``) with ``str(e)``
exactly as the rank saw it; the rank is named beside the message, not in it: a note (``raised on
rank 1``, or ``raised on rank 5 @ node2`` across hosts, shown under the message by Python and
IPython) and the attributes ``e.rank`` and ``e.host`` (None for a rank on this machine; an
exception's own attribute of either name is left as it is). A :class:`RemoteTraceback` is attached
as the cause of the oldest exception of its chain, so the notebook shows the rank's own frames
(launcher internals trimmed, notebook cell lines filled in).

The traceback's text (frames, chain of causes, bounds) is ``nbaccel.launch.wire.tracebacks``'s;
how an exception travels whole (type, args, attributes, notes, chain) is
``nbaccel.launch.wire.exception_state``'s; here it is given its rank's label.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

from nbaccel.launch.wire.exception_state import (
    exception_state,
    oldest,
    plain_class,
    rebuilt_exception,
)
from nbaccel.launch.wire.labels import LOCAL_LABELS, RankLabels
from nbaccel.launch.wire.tracebacks import (
    bounded_message,
    chain,
    format_frames,
    safe_message,
    user_frames,
)

__all__ = [
    "add_note",
    "exit_hint",
    "LaunchTimeout",
    "RankCrashed",
    "RankError",
    "RemoteTraceback",
    "ResultNotLoadable",
    "describe_exception",
    "is_peer_loss",
    "rebuild_exception",
    "remote_traceback",
    "result_not_loadable",
    "shown_message",
    "unlabelled",
    "where_raised",
    "failure_text",
]

_RAISED_ON = "_nbaccel_raised_on"  # the label of the rank that raised, in a rebuilt __dict__

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
    """A rank raised an exception that could not be rebuilt in the notebook: its type's name
    and message (``ValueError: ...``), the rank in ``rank``/``host`` and a note."""

    def __init__(
        self, rank: int, type_name: str, message: str, labels: RankLabels = LOCAL_LABELS
    ) -> None:
        super().__init__(f"{type_name}: {bounded_message(message)}")
        self.rank = rank
        self.host = labels.hosts.get(rank)
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


def _hint(exc: BaseException, message: str) -> str | None:
    """What to do when ``exc`` is a rank reading its empty stdin, else None."""
    hint = _NO_STDIN.get((type(exc).__name__, message))
    return None if hint is None else hint.strip().removeprefix("(").removesuffix(")")


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What a worker sends about an exception: type, message (exactly its ``str``), a hint
    where one helps, frames, and the exception itself as data."""
    message = safe_message(exc)
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "name": type(exc).__name__,
        "message": message,
        "hint": _hint(exc, message),
        "frames": user_frames(exc.__traceback__),
        "chain": chain(exc),
        "exception": exception_state(exc),
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


def shown_message(exc: BaseException, own_str: Any) -> str:
    """What ``exc`` shows: the text :func:`rebuild_exception` gave it (the rank's), else
    ``own_str(exc)`` (its class's own ``__str__``)."""
    text = getattr(exc, "__dict__", {}).get("_nbaccel_text")
    return text if text is not None else own_str(exc)


def rebuild_exception(
    info: dict[str, Any], rank: int, labels: RankLabels = LOCAL_LABELS
) -> BaseException:
    """The exception to raise in the notebook for a rank's error (``describe_exception``'s
    dict): the rank's exception rebuilt whole (``exception_state``: its type or a stand-in of
    the same name, args, attributes, notes, group members, chain) whose ``str`` is the rank's
    own (cut with a notice past ``MESSAGE_SHOWN_CHARS``); the rank named by a note
    (``raised on rank 1``, ``raised on rank 5 @ node2`` as ``labels``, its worker group's, name
    it) and by ``rank``/``host`` (where the exception has no attribute of that name of its own);
    the rank's traceback as the cause of the oldest exception of
    its chain. The one place a rank's exception becomes the notebook's."""
    message = str(info.get("message", ""))
    exc: BaseException | None = None
    state = info.get("exception")
    if state is not None:
        try:
            exc = rebuilt_exception(state, bounded_message(state["text"]))
            str(exc)  # the report must never fail on the way to the notebook
        except Exception:
            exc = None
    if exc is None:
        exc = RankError(rank, info["name"], message, labels)
    own = vars(exc)  # an attribute the rank's exception has of its own is kept as it is
    own.setdefault("rank", rank)
    own.setdefault("host", labels.hosts.get(rank))
    own[_RAISED_ON] = labels.label(rank)
    add_note(exc, f"raised on {own[_RAISED_ON]}")
    if info.get("hint"):
        add_note(exc, info["hint"])
    remote = format_frames(info, rank)
    dropped = (state or {}).get("dropped") or ()
    if dropped:
        remote += f"\n(not carried to the notebook: {', '.join(dropped)})"
    oldest(exc).__cause__ = RemoteTraceback(remote)
    return exc


def where_raised(exc: BaseException) -> str | None:
    """The rank that raised ``exc`` (one :func:`rebuild_exception` made), as output labels name
    it: ``rank 1``, ``rank 5 @ node2``; None for any other exception."""
    return getattr(exc, "__dict__", {}).get(_RAISED_ON)


def failure_text(exc: BaseException) -> str:
    """One line for a failure in a log or a terminal: ``ValueError: bad shard (raised on rank
    1)``, the rank's name where :func:`where_raised` finds one."""
    where = where_raised(exc)
    return f"{type(exc).__name__}: {exc}" + (f" (raised on {where})" if where else "")


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


def remote_traceback(exc: BaseException) -> str | None:
    """The rank's traceback text that :func:`rebuild_exception` attached to ``exc`` (as the
    cause of the oldest exception of its chain), or None."""
    end = oldest(exc)
    return end.text if isinstance(end, RemoteTraceback) else None


def unlabelled(cls: type) -> type:
    """The exception class a rebuilt exception's class stands for (``cls`` for any other)."""
    return plain_class(cls)


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc``'s notes (``BaseException.add_note``; the same list on Python
    3.10, where notes are kept but not shown), leaving its message as it is."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        try:
            exc.__notes__ = notes  # type: ignore[attr-defined]
        except Exception:
            return
    notes.append(note)
