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
