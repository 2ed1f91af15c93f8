"""The one listing of detached runs and pools (the runs and pools commands, runs(), pools())."""

from nbaccel.launch.detached.listing import MAX_WIDTH, listing_text


def test_empty_listing_says_so():
    assert listing_text([], "no detached runs") == "no detached runs"


def test_columns_line_up_under_the_header_and_long_text_is_cut():
    rows = [
        {"id": "a1", "state": "running", "last line": "x" * 100},
        {"id": "b22222", "state": "finished", "last line": "done"},
    ]
    lines = listing_text(rows, "none").splitlines()
    assert len(lines) == 3
    assert lines[0].split() == ["id", "state", "last", "line"]
    starts = [line.index(value) for line, value in zip(lines[1:], ("running", "finished"))]
    assert starts[0] == starts[1] == lines[0].index("state")
    assert lines[1].endswith("x" * MAX_WIDTH) and "x" * (MAX_WIDTH + 1) not in lines[1]
    assert all(line == line.rstrip() for line in lines)
