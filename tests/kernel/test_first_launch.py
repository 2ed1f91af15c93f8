"""A fresh kernel's first launch names the rank that caused a failure, and a rank says when the
notebook's NumPy random state could not be restored (real kernels, real ranks)."""

from __future__ import annotations

from faults import FIRST_LAUNCH_CELLS, FIRST_LAUNCH_NAMED
from kernel import cell_text, run_notebook


def test_a_fresh_kernels_first_launch_names_the_rank_that_exited():
    # The rank that stays in the barrier sees its peer vanish (gloo: "Connection reset/closed
    # by peer") before the exited rank's status reaches the notebook: its echo must not be
    # taken for the cause. Each kernel is fresh: its first launch is the one that raced.
    for attempt in range(4):
        nb = run_notebook(FIRST_LAUNCH_CELLS, timeout=120)
        raised = [line for line in cell_text(nb.cells[2]).splitlines() if "RAISED" in line]
        assert raised == [FIRST_LAUNCH_NAMED], (
            attempt,
            cell_text(nb.cells[2]),
        )


def test_a_rank_says_when_numpys_random_state_cannot_be_restored():
    # A NumPy state that does not load in the rank (another NumPy there, say) is not skipped
    # silently: the ranks' np.random draws would differ from the notebook's without a word.
    nb = run_notebook(
        [
            "import numpy as np\nnp.random.seed(0)\n"
            "from nbaccel import notebook_launcher\n"
            "from nbaccel.launch.rank import notebook_state\n"
            "_capture = notebook_state.capture\n"
            "notebook_state.capture = lambda: {**_capture(), 'numpy': b'not a pickle'}",
            "print(notebook_launcher(lambda: 7, num_processes=2))",
        ],
        timeout=120,
    )
    text = cell_text(nb.cells[1])
    assert "[7, 7]" in text
    for rank in (0, 1):
        assert any(
            line.startswith(f"[rank {rank}]")
            and "NumPy's random state of the notebook could not be restored" in line
            for line in text.splitlines()
        ), text


_CHILDREN = """
import os, random, time
import psutil
from nbaccel import notebook_launcher

TOKEN = str(random.randint(10000, 99999))

def start_children(token, fail):
    import os, subprocess
    rank = int(os.environ["RANK"])
    subprocess.Popen(["sleep", f"60.{token}{rank}"])  # a child the rank never waits for
    subprocess.run(["setsid", "-f", "sleep", f"61.{token}{rank}"], check=True)  # a daemon
    if fail and rank == 1:
        raise OSError("rank 1 failed after starting its children")
    return "started"

def left():
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(TOKEN in word for word in p.info["cmdline"] or []) and (
                p.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found

try:
    print("RESULT", notebook_launcher(start_children, (TOKEN, {fail}), num_processes=2))
except OSError as exc:
    print("RAISED", exc, exc.__notes__)
time.sleep(2)
print("LEFT", left())
"""


def test_a_fresh_kernels_first_launch_leaves_no_process_its_ranks_started():
    """The first launch of a fresh kernel (ranks forked while the fork server imports): the
    children and setsid'd daemons its ranks started are gone 2 s after it returned or raised,
    and the ranks said they ended them."""
    for fail in (False, True):
        nb = run_notebook([_CHILDREN.replace("{fail}", str(fail))], timeout=120, shutdown=True)
        text = cell_text(nb.cells[0])
        if fail:
            assert (
                "RAISED rank 1 failed after starting its children ['raised on rank 1']" in text
            ), text
        else:
            assert "RESULT ['started', 'started']" in text, text
        assert "LEFT []" in text, text
        assert "nbaccel: ended 2 process(es) this rank started and left running" in text, text
