"""How one rank's output bytes become the lines the notebook shows."""

from __future__ import annotations

from nbaccel.launch.driver.lines import MAX_PARTIAL, Piece, StreamLines


def test_lines_are_whole_whatever_the_chunks():
    lines = StreamLines()
    assert lines.feed(b"hel") == []
    assert lines.feed(b"lo\nwor") == [Piece("hello", False, True)]
    assert lines.feed(b"ld\n\n") == [Piece("world", False, True), Piece("", False, True)]
    assert lines.flush() == []


def test_a_progress_bar_redrawn_in_place_keeps_its_last_state():
    lines = StreamLines()
    assert lines.feed(b"10%\r50%\r100%\n") == [Piece("100%", False, True)]
    assert lines.feed(b"\r\r\n") == []  # only carriage returns: nothing to show


def test_an_endless_line_is_passed_on_in_pieces_then_ended():
    lines = StreamLines()
    first = lines.feed(b"x" * (MAX_PARTIAL + 1))
    assert first == [Piece("x" * (MAX_PARTIAL + 1), False, False)]
    assert lines.feed(b"yy\n") == [Piece("yy", True, True)]


def test_a_partial_line_is_flushed_at_the_end():
    lines = StreamLines()
    assert lines.feed("né".encode()) == []
    assert lines.flush() == [Piece("né", False, True)]
    assert lines.flush() == []
    lines.feed(b"z" * (MAX_PARTIAL + 1))
    assert lines.flush() == [Piece("", True, True)]  # ends the long line that was cut


def _noisy() -> None:
    import os
    import sys

    print("nul\x00bel\x07 esc\x1b[2J\x1b]0;title\x07 \x1b[31mred\x1b[0m\tend")
    os.write(1, b"c-level\x00\x1b[H\x08 bytes\n")
    sys.stderr.write("err\x1bc\x7f\n")


def test_control_bytes_from_ranks_are_filtered_colours_and_tabs_kept():
    """NUL, BEL, cursor and screen escapes, titles, DEL never reach the notebook; ANSI colours
    (which Jupyter renders) and tabs do."""
    from recorder import Recorder

    from nbaccel import notebook_launcher

    renderer = Recorder()
    notebook_launcher(_noisy, num_processes=1, renderer=renderer)
    shown = [text for _, _, text in renderer.lines]
    assert "nulbel esc \x1b[31mred\x1b[0m\tend" in shown
    assert "c-level bytes" in shown
    assert "err" in shown
