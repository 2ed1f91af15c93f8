"""%%distributed on a persistent pool, judged in a real kernel (nbclient) on what the user sees."""

from __future__ import annotations

import ast
import re

import psutil
import pytest
from kernel import cell_errors, cell_text, run_notebook, stream_text

CELLS = {
    "load": "%load_ext nbaccel",
    "start": (
        "%%distributed -n 2\n"
        "import torch, torch.distributed as dist\n"
        "rank = dist.get_rank()\n"
        "t = torch.tensor([float(rank + 1)])\n"
        'print(f"rank {rank} has {t.item()}")\n'
        "t"
    ),
    "pids": "from nbaccel.notebook.kernel.pool import get_pool\nfirst_pids = dict(get_pool().pids)",
    "allreduce": '%%distributed\ndist.all_reduce(t)\nprint("sum", t.item())',
    "rank1": '%%distributed --ranks 1\nprint("only on", rank)\nrank * 100',
    "notebook_vars": "import torch\nscale = torch.full((3,), 2.0)\noffset = 5",
    "push": "%dist_push scale",
    "compute": "%%distributed --push offset\nscaled = (t * scale + offset + rank).tolist()",
    "pull": "%dist_pull scaled --rank 1\nprint('pulled', scaled)",
    "pull_all": "%dist_pull rank --all\nprint('ranks', rank)",
    "error": (
        "%%distributed\n"
        "x = 1\n"
        "if rank == 1:\n"
        '    raise ValueError(f"bad shard on rank {rank}")\n'
        '"fine"'
    ),
    "runaway": ("%%distributed\ndef down(n):\n    return down(n + 1)\nif rank == 0:\n    down(0)"),
    "huge_message": (
        "%%distributed\n"
        "try:\n"
        "    1 / 0\n"
        "except ZeroDivisionError:\n"
        "    if rank == 1:\n"
        '        raise ValueError("v" * 300_000)'
    ),
    "name_error": "only_here = 3\n%dist_status --help",
    "name_error_cell": "%%distributed\nonly_here + 1",
    "after_error": '%%distributed\nprint("after error", rank, t.item(), x)',
    "interrupt": (
        "%%distributed\n"
        "import time\n"
        "print('sleeping', flush=True)\n"
        "for step in range(600):\n"
        "    time.sleep(0.1)"
    ),
    "survived": '%%distributed\nprint("survived", rank, step < 599, t.item())',
    "same_pids": "print('same pids', get_pool().pids == first_pids)",
    "display": (
        "%%distributed --ranks 0\n"
        "from IPython.display import HTML, display\n"
        'display(HTML("<b>bold from a rank</b>"))\n'
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3])\n"
        'plt.title("rank plot");'
    ),
    "progress": (
        "%%distributed\n"
        "from tqdm.auto import tqdm\n"
        "for _ in tqdm(range(5), desc='steps'):\n"
        "    pass"
    ),
    "quiet": '%%distributed --quiet\nprint("hidden")\ndisplay("hidden too")\n42',
    "status": "%dist_status",
    "mixed_precision": (
        "%%distributed --mixed_precision bf16 --ranks 0\n"
        "import os\n"
        "from nbaccel import PartialState\n"
        "state = PartialState()\n"
        'os.environ["ACCELERATE_MIXED_PRECISION"], state.process_index, state.num_processes'
    ),
    # --mixed_precision is for its cell only: the next plain cell is back to the default
    "after_mixed_precision": (
        "%%distributed\n"
        "import os\n"
        "from nbaccel import AcceleratorState\n"
        'os.environ["ACCELERATE_MIXED_PRECISION"], AcceleratorState().mixed_precision'
    ),
    "timeout": "%%distributed --timeout 1\nimport time\ntime.sleep(30)",
    "bad_n": "%%distributed -n 0\npass",
    "bad_ranks": "%%distributed --ranks 5\npass",
    "bad_option": "%%distributed --bogus\npass",
    "help": "%distributed --help",
    "auto_on": "%dist_mode on",
    "auto_cell": 'print("auto", dist.get_rank())',
    "local_cell": '%%local\nlocal_value = 41 + 1\nprint("local", local_value)',
    "auto_off": "%dist_mode off",
    "collective_failure": (
        '%%distributed\nif rank == 1:\n    raise RuntimeError("rank 1 gave up")\ndist.all_reduce(t)'
    ),
    "after_restart": "%%distributed\nimport torch.distributed as dist\ndist.get_rank() + 10",
    "restart": "%dist_restart",
    "names_gone": "%%distributed\n'rank' in globals()",
    "resize_1": "%%distributed -n 1\nimport torch.distributed as dist\ndist.get_world_size()",
    "resize_2": "%%distributed -n 2\nimport torch.distributed as dist\ndist.get_world_size()",
    "shutdown": (
        "import psutil\n"
        "pids = sorted(get_pool().pids.values())\n"
        "%dist_shutdown\n"
        "left = [p for p in pids if psutil.pid_exists(p)"
        " and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]\n"
        "print('PIDS', pids, 'LEFT', left)"
    ),
    "no_pool": "%dist_status\n%dist_shutdown\n%dist_restart",
}
NAMES = list(CELLS)


@pytest.fixture(scope="module")
def nb():
    executed = run_notebook(
        list(CELLS.values()), timeout=120, interrupt_after={NAMES.index("interrupt"): 2.5}
    )
    return dict(zip(NAMES, executed.cells))


def test_pool_starts_and_values_per_rank(nb):
    text = cell_text(nb["start"])
    assert "Starting a pool of 2 CPU processes (gloo)." in text
    assert "[rank 0] rank 0 has 1.0" in text and "[rank 1] rank 1 has 2.0" in text
    assert "[rank 0] tensor([1.])" in text and "[rank 1] tensor([2.])" in text
    assert not cell_errors(nb["start"])


def test_names_persist_and_collectives_work(nb):
    text = cell_text(nb["allreduce"])
    assert "[rank 0] sum 3.0" in text and "[rank 1] sum 3.0" in text


def test_ranks_option_runs_on_rank_1_only(nb):
    text = cell_text(nb["rank1"])
    assert "[rank 1] only on 1" in text and "[rank 1] 100" in text
    assert "[rank 0]" not in text


def test_push_compute_pull(nb):
    assert not cell_errors(nb["push"]) and not cell_errors(nb["compute"])
    assert "pulled [12.0, 12.0, 12.0]" in cell_text(nb["pull"])  # 3*2 + 5 + rank 1
    assert "ranks [0, 1]" in cell_text(nb["pull_all"])


def test_rank_error_is_original_type_with_cell_traceback(nb):
    (error,) = cell_errors(nb["error"])
    assert error.ename == "ValueError"
    assert error.evalue == "bad shard on rank 1"  # as the rank saw it; the rank in a note
    traceback = "\n".join(error.traceback)
    assert "\nraised on rank 1" in traceback
    assert "Traceback from rank 1" in traceback
    assert re.search(r"<rank-cell-\d+>\", line 4", traceback)
    assert 'raise ValueError(f"bad shard on rank {rank}")' in traceback
    assert "[rank 0] 'fine'" in cell_text(nb["error"])


def test_rank_errors_show_bounded_in_the_cell(nb):
    """A runaway recursion, and a 300,000-character message raised while handling another error:
    the cell shows Python's "[Previous line repeated ...]", or the cut message with its notice
    after the error it was handling; not megabytes."""
    (error,) = cell_errors(nb["runaway"])
    assert error.ename == "RecursionError"
    shown = error.evalue + "\n".join(error.traceback)
    assert re.search(r"\[Previous line repeated \d{3} more times\]", shown)
    assert len(shown) < 10_000, len(shown)
    (error,) = cell_errors(nb["huge_message"])
    assert error.ename == "ValueError" and "290,000 more characters not shown" in error.evalue
    shown = error.evalue + "\n".join(error.traceback)
    during = shown.index("During handling of the above exception, another exception occurred")
    assert shown.index("ZeroDivisionError: division by zero") < during
    assert len(shown) < 40_000, len(shown)


def test_name_error_says_to_push(nb):
    (error,) = cell_errors(nb["name_error_cell"])
    assert error.ename == "NameError"
    assert error.evalue == "name 'only_here' is not defined"  # as the rank saw it
    shown = "\n".join(error.traceback)  # the hint and the rank: notes under the message
    assert (
        "'only_here' exists in the notebook: send it to the ranks with %dist_push only_here"
        in shown
    )
    assert "\nraised on rank " in shown


def test_pool_keeps_working_after_error_and_interrupt(nb):
    assert "[rank 1] after error 1 3.0 1" in cell_text(nb["after_error"])
    (error,) = cell_errors(nb["interrupt"])
    assert error.ename == "KeyboardInterrupt"
    assert "[rank 0] sleeping" in cell_text(nb["interrupt"])
    assert "the pool and its names are kept" in stream_text(nb["interrupt"], "stderr")
    text = cell_text(nb["survived"])
    assert "[rank 0] survived 0 True 3.0" in text and "[rank 1] survived 1 True 3.0" in text
    assert "same pids True" in cell_text(nb["same_pids"])


def test_display_and_matplotlib_under_the_rank(nb):
    outputs = nb["display"].outputs
    html = [o for o in outputs if "text/html" in o.get("data", {})]
    png = [o for o in outputs if "image/png" in o.get("data", {})]
    assert html and "<b>bold from a rank</b>" in html[0].data["text/html"]
    assert png and png[0].data["text/plain"].startswith("<Figure size")
    assert "[rank 0]" in stream_text(nb["display"]) and "[rank 1]" not in cell_text(nb["display"])


def test_tqdm_on_ranks_reaches_the_notebook(nb):
    text = cell_text(nb["progress"])
    assert re.search(r"\[rank 0\] steps: 100%.*5/5", text)
    assert re.search(r"\[rank 1\] steps: 100%.*5/5", text)


def test_quiet_hides_output(nb):
    assert cell_text(nb["quiet"]) == "" and not cell_errors(nb["quiet"])


def test_status_table(nb):
    text = cell_text(nb["status"])
    assert "Pool of 2 CPU processes (gloo)" in text
    rows = [line.split() for line in text.splitlines() if line[:1] in "01"]
    assert [row[0] for row in rows] == ["0", "1"]
    assert all("cpu" in row and "idle" in row for row in rows)


def test_bad_options_are_usage_errors(nb):
    for name, words in [
        ("bad_n", "num_processes must be a positive integer, got 0"),
        ("bad_ranks", "not in the pool"),
        ("bad_option", "unrecognized arguments: --bogus"),
    ]:
        text = cell_text(nb[name])
        assert "UsageError" in text and words in text, (name, text)
    assert "usage: %%distributed [-n N]" in cell_text(nb["help"])
    assert "--ssh_args ARGS" in cell_text(nb["help"])  # every launch option the magic takes
    assert "--ranks SPEC" in cell_text(nb["help"])
    assert "usage: %dist_status" in cell_text(nb["name_error"])


def test_auto_mode_and_local(nb):
    assert "[rank 0] auto 0" in cell_text(nb["auto_cell"])
    assert "[rank 1] auto 1" in cell_text(nb["auto_cell"])
    local = cell_text(nb["local_cell"])
    assert "local 42" in local and "[rank" not in local
    assert "Auto mode is off." in cell_text(nb["auto_off"])


def test_mixed_precision_and_timeout(nb):
    assert "[rank 0] ('bf16', 0, 2)" in cell_text(nb["mixed_precision"])
    after = cell_text(nb["after_mixed_precision"])
    assert "[rank 0] ('no', 'no')" in after and "[rank 1] ('no', 'no')" in after
    (error,) = cell_errors(nb["timeout"])
    assert error.ename == "LaunchTimeout" and "timeout=1.0 s on rank(s) [0, 1]" in error.evalue
    stderr = stream_text(nb["timeout"], "stderr")  # where each rank was: the cell's sleep
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\]   File \"<rank-cell-\d+>\", line 3 in <module>", stderr)


def test_peer_blocked_in_collective_gets_pool_restarted(nb):
    (error,) = cell_errors(nb["collective_failure"])
    assert error.ename == "RuntimeError" and error.evalue == "rank 1 gave up"
    assert "\nraised on rank 1" in "\n".join(error.traceback)
    stderr = stream_text(nb["collective_failure"], "stderr")
    assert "rank(s) [0] did not stop" in stderr and "restarting the pool" in stderr
    text = cell_text(nb["after_restart"])
    assert "[rank 0] 10" in text and "[rank 1] 11" in text


def test_restart_and_resize(nb):
    assert "Restarted the pool of 2 CPU processes (gloo)" in cell_text(nb["restart"])
    assert "[rank 0] False" in cell_text(nb["names_gone"])
    resized = cell_text(nb["resize_1"])
    assert "restarting the pool (2 -> 1 processes" in resized and "[rank 0] 1" in resized
    resized = cell_text(nb["resize_2"])
    assert "[rank 0] 2" in resized and "[rank 1] 2" in resized


def test_shutdown_leaves_no_process(nb):
    text = cell_text(nb["shutdown"])
    assert "Pool shut down." in text
    match = re.search(r"PIDS (\[.*?\]) LEFT (\[.*?\])", text)
    pids, left = ast.literal_eval(match.group(1)), ast.literal_eval(match.group(2))
    assert len(pids) == 2 and left == []
    assert not [p for p in pids if psutil.pid_exists(p)]
    text = cell_text(nb["no_pool"])
    assert "No pool is running." in text and "UsageError: no pool is running" in text


def test_cell_syntax_errors_point_at_the_notebook_line_and_ipython_syntax_is_refused():
    nb = run_notebook(
        [
            "%load_ext nbaccel",
            "%%distributed -n 2\nx = 1\ny = (\nz = 3",
            "%%distributed -n 2\nx = 1\n!echo hi",
            "%%distributed -n 2\n%time y = 2",
            "%%distributed -n 2\nprint('pool untouched')",
        ],
        timeout=180,
    )
    syntax = cell_errors(nb.cells[1])[0]
    assert syntax.ename == "SyntaxError" and "line 3" in syntax.evalue  # the notebook's line 3
    # IPython shows a UsageError as text, without a traceback
    assert "UsageError: line 3: '!echo hi' is IPython syntax" in cell_text(nb.cells[2])
    assert "UsageError: line 2: '%time y = 2' is IPython syntax" in cell_text(nb.cells[3])
    assert "[rank 1] pool untouched" in cell_text(nb.cells[4])
