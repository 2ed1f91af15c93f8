"""Fixtures for the opt-in multi-host lanes: ``scripts/test-hosts`` and ``scripts/test-slurm``.

Both lanes need root and Debian packages, so the default test run skips everything in this
folder: a test here runs only when its lane script set ``NBACCEL_HOSTS_LANE=1`` (tests marked
``hosts``) or ``NBACCEL_SLURM_LANE=1`` (tests marked ``slurm``).

The hosts lane (``scripts/hosts/up``): hosts ``nbh1``, ``nbh2``, ... are network namespaces at
10.77.0.11, 10.77.0.12, ... with their own sshd, hostname, /tmp and /dev/shm; they share the
filesystem (same repository and venv paths). This process, like a notebook kernel, runs in the
root namespace and is reachable from the hosts at 10.77.0.1 (name ``nbkernel``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STATE_DIR = Path(os.environ.get("NBH_STATE", "/var/lib/nbaccel-hosts"))
KERNEL_ADDR = "10.77.0.1"  # the root namespace (the kernel) on the lane's bridge nbbr0
KERNEL_NAME = "nbkernel"  # its name in /etc/hosts while the lane is up

LANES = {
    # marker: (env var the lane script sets, how to run the lane)
    "hosts": ("NBACCEL_HOSTS_LANE", "scripts/test-hosts"),
    "slurm": ("NBACCEL_SLURM_LANE", "scripts/test-slurm"),
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "hosts: needs the ssh hosts nbh1, nbh2, ... (run as root: scripts/test-hosts)"
    )
    config.addinivalue_line(
        "markers", "slurm: needs the one-node SLURM cluster (run as root: scripts/test-slurm)"
    )


def _lane_on(marker: str) -> bool:
    return os.environ.get(LANES[marker][0]) == "1"


def pytest_collection_modifyitems(config, items):
    # This hook sees the whole session's items: only touch the ones in this folder.
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        lanes = [m for m in LANES if item.get_closest_marker(m)]
        if not lanes:  # unmarked helpers here run with either lane
            lanes = list(LANES)
        if not any(_lane_on(m) for m in lanes):
            how = " or ".join(f"`sudo bash {LANES[m][1]}`" for m in lanes)
            env = " / ".join(f"{LANES[m][0]}=1" for m in lanes)
            item.add_marker(pytest.mark.skip(reason=f"multi-host lane test: run {how} ({env})"))


@dataclass(frozen=True)
class SshHosts:
    """The hosts lane as the tests see it."""

    names: list[str]  # ["nbh1", "nbh2", ...]
    addrs: dict[str, str]  # name -> address on the bridge
    ssh_config: Path  # use as `ssh -F ssh_config NAME ...`
    kernel_addr: str = KERNEL_ADDR  # this process (the kernel) as the hosts reach it
    kernel_name: str = KERNEL_NAME

    def ssh_argv(self, host: str, command: str) -> list[str]:
        return ["ssh", "-F", str(self.ssh_config), host, command]

    def run(self, host: str, command: str, timeout: float = 60, **kw) -> str:
        """Run a shell command on ``host``; return its stdout, fail the test on a non-zero exit."""
        res = subprocess.run(
            self.ssh_argv(host, command), capture_output=True, text=True, timeout=timeout, **kw
        )
        if res.returncode != 0:
            pytest.fail(f"ssh {host} {command!r} exited {res.returncode}:\n{res.stderr}")
        return res.stdout


def _skip_lane(marker: str, why: str):
    pytest.skip(f"{why}; run the lane with `sudo bash {LANES[marker][1]}`")


@pytest.fixture(scope="session")
def ssh_hosts() -> SshHosts:
    """The lane's hosts (brought up by scripts/hosts/up); skips when the lane is not up."""
    hosts_file, config = STATE_DIR / "hosts", STATE_DIR / "ssh_config"
    if not (hosts_file.is_file() and config.is_file()):
        _skip_lane("hosts", f"hosts lane not up (no {hosts_file})")
    addrs = dict(line.split() for line in hosts_file.read_text().splitlines() if line.strip())
    hosts = SshHosts(names=sorted(addrs, key=lambda n: int(n[3:])), addrs=addrs, ssh_config=config)
    probe = subprocess.run(
        hosts.ssh_argv(hosts.names[0], "true"), capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        _skip_lane("hosts", f"ssh {hosts.names[0]} failed: {probe.stderr.strip()}")
    return hosts


@pytest.fixture(scope="session")
def venv_python() -> str:
    """The project's interpreter; the same path works on every lane host (shared filesystem)."""
    return sys.executable


@dataclass(frozen=True)
class SlurmCluster:
    """The slurm lane (scripts/hosts/slurm-up): one node, one default partition."""

    partition: str
    nodes: list[str]


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The one-node SLURM cluster; skips when the lane is not up."""
    if shutil.which("sinfo") is None or not Path("/etc/slurm/slurm.conf").is_file():
        _skip_lane("slurm", "slurm lane not up (no sinfo or /etc/slurm/slurm.conf)")
    res = subprocess.run(
        ["sinfo", "-h", "-o", "%P %N %T"], capture_output=True, text=True, timeout=30
    )
    if res.returncode != 0 or not res.stdout.strip():
        _skip_lane("slurm", f"sinfo failed: {res.stderr.strip()}")
    partition, nodes, _state = res.stdout.split()[:3]
    return SlurmCluster(partition=partition.rstrip("*"), nodes=nodes.split(","))
