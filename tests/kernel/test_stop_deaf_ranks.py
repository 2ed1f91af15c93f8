"""The stop button on ranks that ignore SIGINT (they honour SIGTERM): the pool does not wait for a
reaction that cannot come. It shows where each rank was, restarts at once, saying why, and the
next cell runs."""

from __future__ import annotations

import re

from kernel import cell_errors, cell_text, run_notebook, stream_text

DEAF = (
    "%%distributed\n"
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "print('deaf', flush=True)\n"
    "while True:\n"
    "    time.sleep(0.01)\n"
)


def test_stop_on_ranks_ignoring_sigint_restarts_the_pool_and_says_why():
    cells = [
        "%load_ext nbaccel",
        "%%distributed -n 2\nx = 41",
        DEAF,
        "%%distributed\nprint('x' in globals())",
    ]
    nb = run_notebook(cells, timeout=120, interrupt_after={2: 2.5})
    (error,) = cell_errors(nb.cells[2])
    assert error.ename == "KeyboardInterrupt"
    assert "[rank 0] deaf" in cell_text(nb.cells[2])
    notice = stream_text(nb.cells[2], "stderr")
    assert "rank(s) [0, 1] ignore SIGINT, which the stop button sends" in notice
    assert "restarting the pool; names defined on the ranks are lost" in notice
    for rank in (0, 1):  # where each deaf rank was when the stop came: the cell's loop
        assert re.search(rf"\[rank {rank}\]   File \"<rank-cell-\d+>\", line 6 in <module>", notice)
    text = cell_text(nb.cells[3])
    assert "[rank 0] False" in text and "[rank 1] False" in text  # fresh ranks, running again
