"""The multi-host lanes themselves: what nbaccel's ssh and SLURM launchers may rely on.

Run with ``sudo bash scripts/test-hosts`` (marker ``hosts``) or ``sudo bash scripts/test-slurm``
(marker ``slurm``); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import threading
import uuid

import pytest

# --- hosts lane ------------------------------------------------------------------------------


@pytest.mark.hosts
def test_each_host_has_its_own_hostname(ssh_hosts, venv_python):
    py = f"{venv_python} -c 'import socket; print(socket.gethostname())'"
    seen = {h: ssh_hosts.run(h, f"hostname; {py}").split() for h in ssh_hosts.names}
    assert seen == {h: [h, h] for h in ssh_hosts.names}
    assert socket.gethostname() not in seen


@pytest.mark.hosts
def test_each_host_has_only_its_own_addresses(ssh_hosts):
    for host in ssh_hosts.names:
        out = ssh_hosts.run(host, "ip -4 -o addr show")
        addrs = sorted(line.split()[3] for line in out.splitlines())
        assert addrs == sorted(["127.0.0.1/8", f"{ssh_hosts.addrs[host]}/24"])


@pytest.mark.hosts
@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm"])
def test_tmp_and_shm_are_private_per_host(ssh_hosts, folder):
    name = f"nbaccel-lane-{uuid.uuid4().hex}"
    local = os.path.join(folder, name)
    open(local, "w").close()  # the kernel's file must not show on any host
    try:
        first = ssh_hosts.names[0]
        assert ssh_hosts.run(first, f"stat -f -c %T {folder}").strip() == "tmpfs"
        ssh_hosts.run(first, f"touch {folder}/{name}.{first}")
        for host in ssh_hosts.names:
            listing = ssh_hosts.run(host, f"ls -A {folder}").split()
            assert name not in listing
            assert (f"{name}.{first}" in listing) == (host == first)
        assert not os.path.exists(f"{local}.{first}")  # nor the host's on the kernel
    finally:
        os.unlink(local)
        ssh_hosts.run(ssh_hosts.names[0], f"rm -f {folder}/{name}.*")


@pytest.mark.hosts
def test_hosts_reach_each_other_by_name(ssh_hosts):
    first, *others = ssh_hosts.names
    for host in others:
        assert ssh_hosts.run(first, f"ssh {host} hostname").strip() == host


def _accept_lines(server: socket.socket, count: int, into: list[str]):
    for _ in range(count):
        conn, _addr = server.accept()
        with conn:
            into.append(conn.makefile().readline().strip())


@pytest.mark.hosts
@pytest.mark.parametrize("by", ["address", "name"])
def test_hosts_reach_the_kernel_address(ssh_hosts, venv_python, by):
    target = ssh_hosts.kernel_addr if by == "address" else ssh_hosts.kernel_name
    # A server in this (root-namespace) process, bound to the kernel's lane address only.
    with socket.create_server((ssh_hosts.kernel_addr, 0)) as server:
        server.settimeout(30)
        port = server.getsockname()[1]
        got: list[str] = []
        thread = threading.Thread(target=_accept_lines, args=(server, len(ssh_hosts.names), got))
        thread.start()
        send = (
            "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
            "s.sendall((socket.gethostname() + '\\n').encode())"
        )
        for host in ssh_hosts.names:
            ssh_hosts.run(host, f"{venv_python} -c {shlex.quote(send)} {target} {port}")
        thread.join(timeout=30)
    assert sorted(got) == sorted(ssh_hosts.names)


@pytest.mark.hosts
def test_venv_python_with_torch_runs_on_every_host(ssh_hosts, venv_python):
    import torch

    code = "import socket, torch, nbaccel; print(socket.gethostname(), torch.__version__)"
    for host in ssh_hosts.names:
        out = ssh_hosts.run(host, f"{venv_python} -c {shlex.quote(code)}", timeout=120)
        assert out.split() == [host, torch.__version__]


ALLREDUCE = """
import socket, sys, torch, torch.distributed as dist
rank, world, port = map(int, sys.argv[1:])
dist.init_process_group("gloo", init_method=f"tcp://{KERNEL}:{port}", rank=rank, world_size=world)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(rank, socket.gethostname(), int(t.item()), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.hosts
def test_gloo_group_spans_kernel_and_hosts(ssh_hosts, venv_python):
    """Rank 0 in the kernel's namespace, one rank per host, rendezvous at the kernel address."""
    with socket.socket() as s:  # a free port on the kernel address
        s.bind((ssh_hosts.kernel_addr, 0))
        port = s.getsockname()[1]
    world = 1 + len(ssh_hosts.names)
    code = ALLREDUCE.replace("{KERNEL}", ssh_hosts.kernel_addr)
    procs = [
        subprocess.Popen(
            [venv_python, "-c", code, "0", str(world), str(port)],
            text=True,
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    ]
    for rank, host in enumerate(ssh_hosts.names, start=1):
        cmd = f"OMP_NUM_THREADS=1 {venv_python} -c {shlex.quote(code)} {rank} {world} {port}"
        procs.append(
            subprocess.Popen(ssh_hosts.ssh_argv(host, cmd), text=True, stdout=subprocess.PIPE)
        )
    outs = [p.communicate(timeout=150)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0] * world
    total = world * (world + 1) // 2
    assert outs == [
        [str(r), h, str(total)] for r, h in enumerate([socket.gethostname(), *ssh_hosts.names])
    ]


# --- slurm lane ------------------------------------------------------------------------------

# Each srun task prints these variables as one short JSON line (long lines may interleave).
NAMES = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST", "SLURM_JOB_ID", "NBACCEL_LANE_PROBE"]
PRINT_ENV = "import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"


def _srun_env(argv: list[str]) -> list[dict]:
    env = {**os.environ, "NBACCEL_LANE_PROBE": "passed-through"}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    return sorted(
        (json.loads(line) for line in res.stdout.splitlines()), key=lambda d: d["SLURM_PROCID"]
    )


@pytest.mark.slurm
def test_srun_sets_slurm_vars_and_exports_env(slurm_cluster, venv_python):
    tasks = _srun_env(["srun", "-N1", "-n2", "--export=ALL", venv_python, "-c", PRINT_ENV, *NAMES])
    assert [t["SLURM_PROCID"] for t in tasks] == ["0", "1"]
    assert {t["SLURM_NTASKS"] for t in tasks} == {"2"}
    assert {t["SLURM_NODELIST"] for t in tasks} == {slurm_cluster.nodes[0]}
    assert len({t["SLURM_JOB_ID"] for t in tasks}) == 1 and tasks[0]["SLURM_JOB_ID"]
    assert {t["NBACCEL_LANE_PROBE"] for t in tasks} == {"passed-through"}


@pytest.mark.slurm
def test_salloc_then_srun(slurm_cluster, venv_python):
    argv = ["salloc", "-N1", "-n2", "srun", venv_python, "-c", PRINT_ENV, *NAMES]
    tasks = _srun_env(argv)
    assert [t["SLURM_PROCID"] for t in tasks] == ["0", "1"]
    assert {t["SLURM_NTASKS"] for t in tasks} == {"2"}


@pytest.mark.slurm
def test_srun_runs_more_tasks_than_cores(slurm_cluster, venv_python):
    code = "import torch, os; print(os.environ['SLURM_PROCID'], torch.__version__)"
    res = subprocess.run(
        ["srun", "-n4", venv_python, "-c", code], capture_output=True, text=True, timeout=150
    )
    assert res.returncode == 0, res.stderr
    assert sorted(line.split()[0] for line in res.stdout.splitlines()) == ["0", "1", "2", "3"]
