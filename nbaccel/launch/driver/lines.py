"""One rank's output stream cut into lines, as the notebook shows them.

Bytes arrive in arbitrary pieces; the notebook wants whole lines, never a line glued to another
rank's. A carriage return (a progress bar redrawn in place) keeps only the line's last state. A
line longer than 64 KiB is passed on in pieces, each marked as continuing the one before, so one
endless line cannot hold the rest back. What is left when the stream or the call ends (a
``print(..., end="")``) is passed on by :meth:`StreamLines.flush`.

Control bytes are filtered (:func:`clean`): NUL, BEL, backspace, DEL, C1 codes and terminal
escape sequences (cursor moves, screen clears, window titles, hyperlinks) would corrupt or
silently alter what the notebook shows. Kept: tab, and ANSI colour and style (SGR,
``ESC[...m``), which Jupyter renders in stream output and a terminal shows as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Piece", "StreamLines", "clean"]

_CONTROL = re.compile(
    r"(\x1b\[[0-?]*[ -/]*[@-~])"  # CSI: kept when it is SGR (colour), dropped otherwise
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: titles, hyperlinks
    r"|\x1b[ -/]*[0-~]?"  # other escapes (reset, charsets...), or a lone ESC
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # C0 (but tab and newline), DEL, C1
)


def _keep_colour(match: re.Match[str]) -> str:
    csi = match.group(1)
    return csi if csi is not None and csi.endswith("m") else ""


def clean(text: str) -> str:
    """``text`` without control bytes and escape sequences, colours (SGR) and tabs kept."""
    return _CONTROL.sub(_keep_colour, text) if _NEEDS_CLEANING.search(text) else text


_NEEDS_CLEANING = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

MAX_PARTIAL = 1 << 16


@dataclass(frozen=True)
class Piece:
    """A line to show: ``continues`` when it follows a piece of the same long line,
    ``complete`` when the line ends here."""

    text: str
    continues: bool
    complete: bool


class StreamLines:
    """Cuts one stream's bytes into :class:`Piece` s."""

    def __init__(self) -> None:
        self._partial = bytearray()
        self._continuing = False

    def feed(self, data: bytes) -> list[Piece]:
        """The lines ``data`` completes (the rest waits for more bytes)."""
        self._partial.extend(data)
        *lines, rest = self._partial.split(b"\n")
        pieces = [self._piece(line, complete=True) for line in lines]
        if b"\r" in rest:
            rest = rest[rest.rfind(b"\r") :]
        if len(rest) > MAX_PARTIAL:
            pieces.append(self._piece(rest, complete=False))
            rest = b""
        self._partial = bytearray(rest)
        return [piece for piece in pieces if piece is not None]

    def flush(self) -> list[Piece]:
        """The unfinished last line, if any (its rank ended, or its call did)."""
        if not self._partial and not self._continuing:
            return []
        piece = self._piece(bytes(self._partial), complete=True)
        self._partial.clear()
        return [piece] if piece is not None else []

    def _piece(self, raw: bytes, complete: bool) -> Piece | None:
        text = raw.decode("utf-8", errors="replace")
        if "\r" in text:  # carriage-return progress: keep the last state only
            parts = [part for part in text.split("\r") if part.strip()]
            text = parts[-1] if parts else ""
            if not text and complete and not self._continuing:
                return None
        piece = Piece(clean(text), self._continuing, complete)
        self._continuing = not complete
        return piece
