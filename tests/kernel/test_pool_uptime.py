"""%dist_status's uptime, judged in a real kernel: each rank's age on one clock, between the
time since just before the pool started and the time since it was ready."""

from __future__ import annotations

import re

from kernel import cell_errors, cell_text, run_notebook

CELLS = [
    "%load_ext nbaccel",
    "import time\nbefore = time.monotonic()",
    "%%distributed -n 2\nx = 1",
    "ready = time.monotonic()\ntime.sleep(3)",
    # the rows %dist_status renders, bracketed by this kernel's monotonic clock
    "from nbaccel.notebook.kernel.pool import get_pool\n"
    "start = time.monotonic()\n"
    "rows = get_pool().status()\n"
    "end = time.monotonic()\n"
    "print('LOW', start - ready, 'HIGH', end - before)\n"
    "print('UPTIMES', *[row['uptime'] for row in rows])",
    "%dist_status",
    "%dist_shutdown",
]
TICK = 0.02  # a process's start is kept in clock ticks (1/100 s)


def test_uptime_is_each_rank_age_on_one_clock():
    nb = run_notebook(CELLS, timeout=180)
    for cell in nb.cells:
        assert not cell_errors(cell), cell_text(cell)[-2000:]
    text = cell_text(nb.cells[4])
    low, high = (float(v) for v in re.search(r"LOW (\S+) HIGH (\S+)", text).groups())
    uptimes = [float(v) for v in re.search(r"UPTIMES (.+)", text).group(1).split()]
    assert len(uptimes) == 2, text
    for uptime in uptimes:
        assert low - TICK <= uptime <= high + TICK, (low, uptimes, high)
    # the table shows the same age as m:ss (the cell ran after the sleep: 0:03 at least)
    table = cell_text(nb.cells[5])
    shown = re.findall(r"\b(\d+):(\d\d)\b", table)
    assert len(shown) == 2, table
    assert all(int(m) * 60 + int(s) >= int(low) for m, s in shown), (table, low)
