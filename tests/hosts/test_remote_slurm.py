"""The SLURM launcher from a real kernel inside an allocation: ``srun`` starts one agent per node.

Run with ``sudo bash scripts/test-slurm`` (marker ``slurm``): a one-node cluster on this machine.
The kernel gets the allocation's environment as a kernel started under ``salloc`` would.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import cell_errors, cell_text
from kernel import run_notebook as _run_notebook

pytestmark = pytest.mark.slurm


def run_notebook(cells, **options):
    """A fresh kernel, shut down at the end as Jupyter does: its agents end with it."""
    return _run_notebook(cells, shutdown=True, **options)


@pytest.fixture
def allocation(slurm_cluster):
    """An allocation (``salloc --no-shell``) and the environment a kernel inside it has."""
    res = subprocess.run(
        ["salloc", "--no-shell", "-N1", "-n2", "--job-name=nbaccel-lane"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Granted job allocation (\d+)", res.stderr)
    if match is None:
        pytest.fail(f"salloc failed: {res.stderr}")
    job = match.group(1)
    yield {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": ",".join(slurm_cluster.nodes),
        "SLURM_NTASKS": "2",
        "NBACCEL_NO_WARMUP": "1",
        "NBACCEL_RENDERER": "text",
    }
    subprocess.run(["scancel", job], timeout=30)
    leftover = subprocess.run(
        ["pgrep", "-f", "nbaccel[.]launch[.]remote[.]agent"], capture_output=True, text=True
    ).stdout
    assert not leftover.strip(), f"agents left after the test: {leftover}"


_LAUNCH = textwrap.dedent(
    """
    import os, socket, torch
    import torch.distributed as dist
    from nbaccel import notebook_launcher

    def where():
        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        job = os.environ["SLURM_JOB_ID"]
        print("rank", dist.get_rank(), "on", socket.gethostname(), "job", job)
        if os.environ.get("NBACCEL_AGENT_CONFIG"):
            raise RuntimeError("the agent's keys leaked into the rank's environment")
        return total.item()

    print("results", notebook_launcher(where, launcher="slurm"))
    """
)

_FAIL = textwrap.dedent(
    """
    from nbaccel import notebook_launcher

    def fail_on_one():
        import os
        if os.environ["RANK"] == "1":
            raise ValueError("rank one fails")

    notebook_launcher(fail_on_one, num_processes=2, launcher="slurm")
    """
)


def test_launcher_through_srun(allocation, slurm_cluster):
    node = slurm_cluster.nodes[0]
    nb = run_notebook([_LAUNCH, _FAIL], timeout=240, env=allocation)
    text = cell_text(nb.cells[0])
    assert not cell_errors(nb.cells[0]), text
    assert f"on 1 host ({node}:2) over slurm" in text
    assert f"[rank 1 @ {node}] rank 1 on {node} job {allocation['SLURM_JOB_ID']}" in text
    assert "results [1.0, 1.0]" in text
    errors = cell_errors(nb.cells[1])
    assert [(e.ename, e.evalue) for e in errors] == [
        ("ValueError", f"[rank 1 @ {node}] rank one fails")
    ]


def test_magic_through_srun(allocation, slurm_cluster):
    node = slurm_cluster.nodes[0]
    cells = [
        "%load_ext nbaccel",
        "%%distributed --slurm -n 2\nimport os\nme = int(os.environ['RANK'])\nprint('up', me)",
        "%%distributed\nprint('kept', me * 10)",
        "%%distributed\nimport time\ntime.sleep(120)",
        "%%distributed --ranks 1\nprint('after interrupt', me)",
        "%dist_shutdown",
    ]
    nb = run_notebook(cells, timeout=240, interrupt_after={3: 8}, env=allocation)
    texts = [cell_text(c) for c in nb.cells]
    assert f"[rank 1 @ {node}] up 1" in texts[1], texts[1]
    assert f"[rank 1 @ {node}] kept 10" in texts[2]
    assert [e.ename for e in cell_errors(nb.cells[3])] == ["KeyboardInterrupt"]
    assert f"[rank 1 @ {node}] after interrupt 1" in texts[4]
    assert "Pool shut down." in texts[5]
