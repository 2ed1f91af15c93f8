"""What the ranks print, from bytes on their output connections to whole rank-labelled lines.

:class:`OutputReader` reads a rank's stdout or stderr connection, cuts what arrives into lines
(a partial last line waits for its end, or for the call's end), takes nbaccel's own frames out
of stack dumps on stderr, and hands each line to the renderer, or to the log file once the
output budget of the call is spent.
"""

from __future__ import annotations

import time

from nbaccel.launch.driver.lines import Piece
from nbaccel.launch.driver.output_budget import OutputBudget
from nbaccel.launch.driver.rank_connections import ConnectionTable
from nbaccel.launch.driver.rank_ends import still_draining
from nbaccel.launch.driver.rank_state import RankState
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.channel import Connection, readable
from nbaccel.launch.wire.protocol import Stream

__all__ = ["OutputReader"]


class OutputReader:
    """Turns the ranks' output into lines for ``renderer``, within ``budget``.

    Args:
        connections: the table holding the ranks' output connections (closed at their end).
        budget: the limits of what each call shows.
        renderer: where lines go (the group sets :attr:`renderer` anew when its own changes).
    """

    def __init__(
        self, connections: ConnectionTable, budget: OutputBudget, renderer: Renderer
    ) -> None:
        self._connections = connections
        self._budget = budget
        self.renderer = renderer

    def read(self, state: RankState, stream: str, conn: Connection) -> bool:
        """Read what waits on ``conn`` (``state``'s ``stream``); True when the stream ended
        (its process may have ended too)."""
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        still_draining(state)
        state.output_at = time.monotonic()
        if not data:
            self._connections.close_output(conn)
            state.streams_open.discard(stream)
            self.flush_partial(state, stream)
            return True
        state.printed = True
        for piece in state.lines[stream].feed(data):
            self._show(state, stream, piece)
        return False

    def drain(self) -> None:
        """Read every output connection until nothing more waits on it (a call is over)."""
        outputs = self._connections.outputs
        by_socket = {conn.sock: conn for conn in outputs}  # sockets: fileno() in C
        waiting = list(by_socket)
        while waiting:
            ready = readable(waiting)
            for sock in ready:
                conn = by_socket[sock]
                self.read(*outputs[conn], conn)
            waiting = [sock for sock in ready if by_socket[sock] in outputs]  # not at end

    def flush_printed(self, ranks: list[RankState]) -> None:
        """Pass on the partial last lines of the ranks that printed since the last call."""
        for state in ranks:
            if state.printed:  # else nothing of it waits in a partial line
                state.printed = False
                for stream in list(state.lines):
                    self.flush_partial(state, stream)

    def flush_partial(self, state: RankState, stream: str) -> None:
        """Pass on the unfinished last line of ``stream`` (its rank ended, or its call did)."""
        for piece in state.lines[stream].flush():
            self._show(state, stream, piece)
        if stream == Stream.STDERR:
            for text in state.stack_dump.flush():
                self._pass(state, stream, text, False, True)

    def _show(self, state: RankState, stream: str, piece: Piece) -> None:
        """A piece of a line to the notebook; a stack dump's lines without nbaccel's frames."""
        if stream != Stream.STDERR or piece.continues or not piece.complete:
            self._pass(state, stream, piece.text, piece.continues, piece.complete)
            return
        for text in state.stack_dump.feed(piece.text):
            self._pass(state, stream, text, False, True)

    def _pass(
        self, state: RankState, stream: str, text: str, continues: bool, complete: bool
    ) -> None:
        """A line to the renderer, or to the log file once the output budget is spent."""
        shown = self._budget.take(state.rank, stream, text, continues, complete)
        if shown is not None:
            self.renderer.line(state.rank, stream, shown)
        else:
            self.renderer.overflow(state.rank, stream, text)
