"""The SLURM launcher from a real kernel inside an allocation: ``srun`` starts one agent per node.

Run with ``sudo bash scripts/test-slurm`` (marker ``slurm``): a one-node cluster on this machine.
The kernel gets the allocation's environment as a kernel started under ``salloc`` would.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
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
    left = _agents_of(job, wait=15)  # ended with their kernel (as they end), before scancel
    subprocess.run(["scancel", job], timeout=30)
    assert not left, f"agents left after the test: {left}"


def _agents_of(job: str, wait: float) -> list[str]:
    """The agents (and their fork servers, ranks) of SLURM job ``job`` still running after
    ``wait`` seconds at most (other sessions' agents on this machine are not counted)."""
    import time

    import psutil

    deadline = time.monotonic() + wait
    while True:
        left = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if "nbaccel.launch.remote.agent" not in " ".join(p.info["cmdline"] or []):
                    continue
                if (
                    p.info["status"] != psutil.STATUS_ZOMBIE
                    and p.environ().get("SLURM_JOB_ID") == job
                ):
                    left.append(f"{p.pid} {' '.join(p.info['cmdline'])}")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


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
    assert [(e.ename, e.evalue) for e in errors] == [("ValueError", "rank one fails")]
    assert f"\nraised on rank 1 @ {node}" in "\n".join(errors[0].traceback)


def test_magic_through_srun(allocation, slurm_cluster):
    node = slurm_cluster.nodes[0]
    cells = [
        "%load_ext nbaccel",
        "%%distributed --slurm -n 2\nimport os\nme = int(os.environ['RANK'])\nprint('up', me)",
        "%%distributed\nprint('kept', me * 10)",
        "%%distributed\nimport time\ntime.sleep(120)",
        "%%distributed --ranks 1\nprint('after interrupt', me)",
        "%%distributed\nfor i in range(50_000):\n    print('flood', i)",
        "%%distributed\nimport torch\ntorch.full((1_000_000,), float(me))",
        "%dist_shutdown",
    ]
    nb = run_notebook(cells, timeout=240, interrupt_after={3: 8}, env=allocation)
    texts = [cell_text(c) for c in nb.cells]
    assert f"[rank 1 @ {node}] up 1" in texts[1], texts[1]
    assert f"[rank 1 @ {node}] kept 10" in texts[2]
    assert [e.ename for e in cell_errors(nb.cells[3])] == ["KeyboardInterrupt"]
    assert f"[rank 1 @ {node}] after interrupt 1" in texts[4]
    # through the job step's agent: every line counted in its own cell, none in the next
    assert "of 100000 lines not shown" in texts[5], texts[5][-2000:]
    assert "flood" not in texts[6] and not cell_errors(nb.cells[6]), texts[6][:2000]
    assert f"[rank 1 @ {node}] tensor([1., 1., 1.,  ..., 1., 1., 1.])" in texts[6], texts[6]
    assert "Pool shut down." in texts[7]


_LINEAGE = textwrap.dedent(
    """
    import os, signal, time
    from nbaccel import notebook_launcher

    def lineage():
        import os
        server = os.getppid()  # the node's fork server (torch imported there once)
        with open(f"/proc/{server}/stat") as stat:
            agent = int(stat.read().rsplit(")", 1)[1].split()[1])
        return server, agent

    def launch():
        return notebook_launcher(lineage, num_processes=2, launcher="slurm")
    """
)


def test_agent_step_kept_across_launches_and_restarted_with_a_notice(allocation, slurm_cluster):
    """One srun step per node runs its agent for the kernel's life: the second launch forks
    from the same agent; an agent that died is replaced at the next launch, with a notice."""
    node = slurm_cluster.nodes[0]
    cells = [
        _LINEAGE,
        "first = launch(); print('first', first)",
        "print('same agent:', launch() == first)",
        "os.kill(first[0][1], signal.SIGKILL); time.sleep(1)",
        "again = launch(); print('new agent:', again[0][1] != first[0][1], again[0] == again[1])",
    ]
    nb = run_notebook(cells, timeout=240, env=allocation)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), texts
    assert "same agent: True" in texts[2], texts
    assert f"{node}: its agent ended (srun on {node} exited" in texts[4], texts[4]
    assert "new agent: True True" in texts[4], texts[4]


def test_kernel_death_ends_the_agent_step_and_its_ranks(allocation, tmp_path):
    """SIGKILL the kernel mid-launch: the agent hears no heartbeat, kills its ranks, exits."""
    import os
    import time

    import psutil
    from jupyter_client.manager import KernelManager

    folder = tmp_path / "up"
    folder.mkdir()
    source = textwrap.dedent(
        f"""
        from nbaccel import notebook_launcher

        def sleep_long(folder):
            import os, time
            with open(os.path.join(folder, os.environ["RANK"]), "w") as handle:
                handle.write(f"{{os.getpid()}} {{os.getppid()}}")
            time.sleep(300)

        notebook_launcher(sleep_long, ({str(folder)!r},), num_processes=2, launcher="slurm")
        """
    )
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env={**os.environ, **allocation}, cwd=str(Path.cwd()))
    try:
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(60)
        client.execute(source)
        deadline = time.monotonic() + 200
        while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(folder)) == 2, "the ranks never started"
        pids = {int(p) for name in os.listdir(folder) for p in (folder / name).read_text().split()}
        pids |= {psutil.Process(p).ppid() for p in list(pids)}  # the fork server's agent
        os.kill(manager.provisioner.process.pid, 9)
        client.stop_channels()
    finally:
        manager.cleanup_resources() if not manager.is_alive() else manager.shutdown_kernel(now=True)
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


_PRELOAD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {folder!r})
    import slurm_plain_lib, slurm_thread_lib
    from nbaccel import notebook_launcher

    def where():
        import socket
        from nbaccel.launch.rank.inherited import inherited_modules
        inherited = inherited_modules() or ()
        return (socket.gethostname(), "slurm_plain_lib" in inherited,
                "slurm_thread_lib" in inherited)

    print("FIRST", notebook_launcher(where, launcher="slurm"))
    """
)


def test_the_agents_server_starts_ranks_with_the_notebooks_modules(allocation, slurm_cluster):
    """The agent's fork server on the allocation's node imports what the kernel imported: the
    ranks start with the notebook's own module; one whose import starts a thread is kept out
    and named once, in the launch's output."""
    node = slurm_cluster.nodes[0]
    folder = tempfile.mkdtemp(prefix="nbaccel-slurm-modules-", dir="/var/tmp")
    try:
        os.chmod(folder, 0o755)
        with open(os.path.join(folder, "slurm_plain_lib.py"), "w") as plain:
            plain.write("VALUE = 1\n")
        with open(os.path.join(folder, "slurm_thread_lib.py"), "w") as threaded:
            threaded.write(
                "import threading, time\n"
                "threading.Thread(target=time.sleep, args=(600,), daemon=True,\n"
                "                 name='slurm-poller').start()\n"
            )
        nb = run_notebook([_PRELOAD.format(folder=folder)], timeout=240, env=allocation)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = cell_text(nb.cells[0])
    assert not cell_errors(nb.cells[0]), text
    assert f"FIRST [('{node}', True, False), ('{node}', True, False)]" in text, text
    kept_out = [
        line
        for line in text.splitlines()
        if line.startswith("[nbaccel]") and "slurm_thread_lib is not preloaded" in line
    ]
    assert len(kept_out) == 1 and node in kept_out[0], text
    assert "its import started a thread ('slurm-poller')" in kept_out[0], kept_out
    assert "NBACCEL_PRELOAD=-slurm_thread_lib" in kept_out[0], kept_out
