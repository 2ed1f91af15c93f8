"""A rank's exception as text: described on the rank, rendered in the notebook as Python renders
it, bounded like a rank's output.

On the rank, :func:`user_frames` keeps the frames of the user's code (nbaccel's own are trimmed)
and :func:`chain` describes the exceptions behind the raised one (``raise ... from err``, an
error while handling another), so the root cause of a failure reaches the notebook, not only
the wrapper that reported it. In the notebook, :func:`format_frames` renders them oldest first
with Python's words between them, filling missing source lines from the notebook's linecache
(where IPython keeps the cells). A message longer than ``MESSAGE_SHOWN_CHARS`` is cut with a
notice (the exception's ``args`` keep all of it), and runs of one repeated frame (a runaway
recursion) collapse as Python's own tracebacks collapse them.
"""

from __future__ import annotations

import linecache
import os
import threading
from typing import Any

__all__ = [
    "MESSAGE_SHOWN_CHARS",
    "bounded_message",
    "chain",
    "format_frames",
    "hide_frames_of",
    "internal_frame",
    "safe_message",
    "user_frames",
]

_PACKAGE = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # .../nbaccel


#: nbaccel's own files as path pieces that match any host's copy of the package: trimmed from
#: a rank's tracebacks (here, on the rank) and its stack dumps (``stack_dumps``, in the notebook)
class _InternalPaths:
    """Path pieces of the frames trimmed from a rank's tracebacks: the engine's, and those
    :func:`hide_frames_of` adds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pieces: tuple[str, ...] = ("/nbaccel/launch/",)

    def add(self, piece: str) -> None:
        with self._lock:
            self._pieces = (*self._pieces, piece)

    def match(self, path: str) -> bool:
        return any(piece in path for piece in self._pieces)


_INTERNAL = _InternalPaths()

# Characters of a rank's exception message the notebook shows (as many as of one output line).
MESSAGE_SHOWN_CHARS = 10_000
_REPEATS_SHOWN = 3  # identical frames in a row shown before "[Previous line repeated ...]"
_CHAIN_LINKS = 16  # causes described behind a rank's exception (a cycle or a deeper chain stops)
_LINK_TEXT = {  # Python's words between an exception and the one it led to
    "cause": "The above exception was the direct cause of the following exception:",
    "context": "During handling of the above exception, another exception occurred:",
}


def bounded_message(message: str) -> str:
    """``message`` as the notebook shows it: whole up to ``MESSAGE_SHOWN_CHARS``, else cut there
    with a notice of what was held back and where all of it is."""
    if len(message) <= MESSAGE_SHOWN_CHARS:
        return message
    held = len(message) - MESSAGE_SHOWN_CHARS
    return (
        f"{message[:MESSAGE_SHOWN_CHARS]}... [{held:,} more characters not shown: the whole "
        "message is in the exception's args]"
    )


def hide_frames_of(path: str) -> None:
    """Trim the frames of ``path`` (a file or folder) from remote tracebacks, like the
    launcher's own (used by the pool's worker functions)."""
    full = os.path.abspath(path)
    inside = os.path.relpath(full, _PACKAGE)
    if inside.startswith(".."):  # not nbaccel's: this host's path
        _INTERNAL.add(full.replace(os.sep, "/"))
    else:
        folder = "/" if os.path.isdir(full) else ""
        _INTERNAL.add("/nbaccel/" + inside.replace(os.sep, "/") + folder)


def internal_frame(filename: str) -> bool:
    """``filename`` (a frame's, on any host) is one of nbaccel's own files."""
    path = filename.replace("\\", "/")
    return _INTERNAL.match(path)


def user_frames(tb: Any) -> list[tuple[str, int, str, str | None]]:
    import traceback

    frames = []
    for frame in traceback.extract_tb(tb):
        if internal_frame(os.path.abspath(frame.filename)):
            continue
        frames.append((frame.filename, frame.lineno or 0, frame.name, frame.line))
    return frames


def safe_message(exc: BaseException) -> str:
    """``str(exc)``, or what went wrong when its ``__str__`` raises (the type still counts)."""
    try:
        return str(exc)
    except Exception as err:
        try:
            return f"<{type(exc).__name__}.__str__ failed: {type(err).__name__}: {err}>"
        except Exception:
            return f"<{type(exc).__name__}.__str__ failed>"


def chain(exc: BaseException) -> list[dict[str, Any]]:
    """The exceptions behind ``exc``, nearest first, as Python's traceback follows them
    (``__cause__``, else ``__context__`` unless suppressed): name, message, frames, and ``link``,
    how each led to the one before it in the list."""
    links: list[dict[str, Any]] = []
    seen = {id(exc)}
    current = exc
    while len(links) < _CHAIN_LINKS:
        if current.__cause__ is not None:
            behind, link = current.__cause__, "cause"
        elif current.__context__ is not None and not current.__suppress_context__:
            behind, link = current.__context__, "context"
        else:
            break
        if id(behind) in seen:
            break
        seen.add(id(behind))
        links.append(
            {
                "name": type(behind).__name__,
                "message": safe_message(behind),
                "frames": user_frames(behind.__traceback__),
                "notes": [str(note) for note in getattr(behind, "__notes__", ())],
                "link": link,
            }
        )
        current = behind
    return links


def format_frames(info: dict[str, Any], rank: int | None) -> str:
    """Render the remote traceback, its chain of causes first as Python orders them; lines
    missing remotely come from this process's linecache (that is where IPython keeps the source
    of notebook cells). ``rank=None`` gives Python's own header."""
    blocks = []
    for behind in reversed(info.get("chain", ())):
        blocks += [_format_one(behind, rank), "", _LINK_TEXT[behind["link"]], ""]
    return "\n".join([*blocks, _format_one(info, rank)])


def _format_one(info: dict[str, Any], rank: int | None) -> str:
    """One exception's frames and message (runs of a frame collapsed, the message bounded)."""
    origin = "" if rank is None else f" from rank {rank}"
    lines = [f"Traceback{origin} (most recent call last):"]
    previous, repeats = None, 0
    for filename, lineno, name, line in info["frames"]:
        if (filename, lineno, name) == previous:
            repeats += 1
            if repeats >= _REPEATS_SHOWN:
                continue
        else:
            _note_repeats(lines, repeats)
            previous, repeats = (filename, lineno, name), 0
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        text = line or linecache.getline(filename, lineno).strip()
        if text:
            lines.append(f"    {text}")
    _note_repeats(lines, repeats)
    lines.append(f"{info['name']}: {bounded_message(str(info['message']))}")
    lines += [bounded_message(note) for note in info.get("notes", ())]  # PEP 678, as Python shows
    return "\n".join(lines)


def _note_repeats(lines: list[str], repeats: int) -> None:
    """Python's notice for the frames of a run that were not shown."""
    hidden = repeats - _REPEATS_SHOWN + 1
    if hidden > 0:
        lines.append(f"  [Previous line repeated {hidden} more time{'s' if hidden > 1 else ''}]")
