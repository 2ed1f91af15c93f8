"""A kernel that launches again and again, in a real kernel (nbclient): what it keeps is bounded.

Widgets: only the most recent launch views stay interactive; older ones become static
snapshots and close their widgets. Logs: the full-output logs of a kernel share a disk budget
(oldest removed first) and are removed when the kernel exits. A ``KeyboardInterrupt`` that the
rank's own code raises is that rank's error, not the stop button.
"""

from __future__ import annotations

import os
import re
import time

from kernel import cell_errors, cell_text, run_notebook

SETUP = """
import os
from ipywidgets.widgets import widget
from nbaccel import notebook_launcher
from nbaccel.launch.host.log_store import store

def noisy(n):  # long lines: the notebook shows 10,000 characters of each, the log all
    for i in range(n):
        print(f"line {i} " + "x" * 60_000)
    return n

def launches(count):
    for _ in range(count):
        notebook_launcher(noisy, (3,), num_processes=2, memory=False)
    return len(widget._instances)
"""


def test_widgets_and_logs_stay_bounded_and_logs_go_with_the_kernel(tmp_path):
    logs = tmp_path / "logs"
    nb = run_notebook(
        [
            SETUP,
            "after_3 = launches(3)",
            "after_8 = launches(5)\nprint('open widgets:', after_3, after_8)",
            "sizes = [os.path.getsize(p) for p in store.paths()]\n"
            "print('kept logs:', len(sizes), sum(sizes))",
        ],
        timeout=300,
        shutdown=True,  # as Jupyter ends a kernel: its logs go with it
        env={
            "NBACCEL_LOG_DIR": str(logs),
            "NBACCEL_LOG_BUDGET_MB": "1",
            "NBACCEL_LIVE_VIEWS": "2",
        },
    )
    for cell in nb.cells:
        assert not cell_errors(cell), cell_text(cell)[-2000:]
    after_3, after_8 = re.findall(r"open widgets: (\d+) (\d+)", cell_text(nb.cells[2]))[-1]
    assert int(after_8) <= int(after_3)  # five more launches, no more widgets
    # the launches pushed out of the live queue read as static snapshots
    frozen = [
        o for o in nb.cells[1].outputs if "nbaccel-frozen" in o.get("data", {}).get("text/html", "")
    ]
    assert frozen and "finished after" in frozen[0]["data"]["text/plain"]
    assert "[rank 1] line 2 xxx" in frozen[0]["data"]["text/plain"]
    # 8 launches wrote 8 logs of 360 KB each; the kernel kept at most its 1 MB budget
    count, size = re.findall(r"kept logs: (\d+) (\d+)", cell_text(nb.cells[3]))[-1]
    assert 1 <= int(count) < 8 and int(size) <= 1024 * 1024
    assert "removed when this process exits" in cell_text(nb.cells[1])
    deadline = time.monotonic() + 10  # the kernel's exit, or its fork server once it is gone
    while os.listdir(logs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(logs) == []  # the kernel is gone, and so are its logs


def test_keyboard_interrupt_raised_by_rank_code_is_its_error():
    nb = run_notebook(
        [
            "%load_ext nbaccel",
            "%%distributed -n 2\nimport os\nif os.environ['RANK'] == '1':\n"
            "    raise KeyboardInterrupt('raised by the code')",
            "%%distributed\nprint('pool alive')",
        ],
        timeout=180,
    )
    [error] = cell_errors(nb.cells[1])
    assert error.ename == "KeyboardInterrupt"
    assert error.evalue == "raised by the code"
    assert "\nraised on rank 1" in "\n".join(error.traceback)
    assert "interrupted the cell" not in cell_text(nb.cells[1])
    assert "[rank 0] pool alive" in cell_text(nb.cells[2])
