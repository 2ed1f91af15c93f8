"""Bad input is refused before anything starts; odd endings of a rank are named plainly."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref

import psutil
import pytest
import torch

from nbaccel import RankCrashed, notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.launchers.forkserver.launcher import get_forkserver


def _children() -> list[int]:
    return sorted(p.pid for p in psutil.Process().children(recursive=True))


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [
        ({"args": 5}, TypeError, r"args must be a tuple .* got int; .* args=\(value,\)"),
        ({"args": torch.zeros(10)}, TypeError, r"args must be a tuple .* got Tensor"),
        ({"num_processes": True}, ValueError, "num_processes must be a positive integer"),
        ({"num_processes": "2"}, ValueError, "num_processes must be a positive integer"),
        ({"timeout": -5}, ValueError, "timeout must be a positive number of seconds"),
        ({"timeout": "10"}, ValueError, "timeout must be a positive number of seconds"),
        ({"use_port": "abc"}, ValueError, "use_port must be a TCP port number between 1 and"),
        ({"use_port": 70000}, ValueError, "use_port must be a TCP port number between 1 and"),
        ({"max_restarts": -1}, ValueError, "max_restarts must be a non-negative integer"),
        ({"num_nodes": 2.0}, ValueError, "num_nodes must be an integer"),
        ({"master_addr": "0.0.0.0x"}, ValueError, r"master_addr='0.0.0.0x' does not resolve"),
        ({"master_addr": "192.0.2.77"}, ValueError, r"192.0.2.77.* not an address of this mach"),
        ({"rdzv_endpoint": "192.0.2.77:2950"}, ValueError, r"not an address of this machine"),
    ],
)
def test_bad_options_are_refused_before_any_process_starts(options, error, pattern):
    get_forkserver()  # started ahead, so that any rank would show up as a new child
    before = _children()
    options = {"num_processes": 2, **options}
    with pytest.raises(error, match=pattern):
        notebook_launcher(print, renderer=Renderer(), **options)
    assert _children() == before


def test_accelerates_string_port_is_accepted():
    def port():
        return os.environ["MASTER_PORT"]

    free = str(__import__("nbaccel.launch.host.ports", fromlist=["free_port"]).free_port())
    assert notebook_launcher(port, num_processes=2, use_port=free, renderer=Renderer()) == [
        free,
        free,
    ]


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1", "[::1]", "0.0.0.0", "own"])
def test_a_master_addr_of_this_machine_reaches_the_ranks(address):
    """Names and addresses of this machine (loopback, an interface's address) are accepted
    on one machine, and the ranks see the one given."""
    import psutil

    if address == "own":  # an address of one of this machine's interfaces, not loopback
        address = next(
            a.address
            for addresses in psutil.net_if_addrs().values()
            for a in addresses
            if a.family == __import__("socket").AF_INET and not a.address.startswith("127.")
        )

    def seen():
        return os.environ["MASTER_ADDR"]

    got = notebook_launcher(seen, num_processes=2, master_addr=address, renderer=Renderer())
    assert got == [address, address]


def _exits_with_3():
    import sys

    if os.environ["RANK"] == "1":
        sys.exit(3)
    return "ok"


def test_sys_exit_on_a_rank_is_an_exit_code_not_a_system_exit():
    with pytest.raises(RankCrashed, match="rank 1 exited with code 3") as info:
        notebook_launcher(_exits_with_3, num_processes=2, renderer=Renderer())
    assert info.value.returncode == 3


def _launches_again():
    from nbaccel import notebook_launcher

    return notebook_launcher(print, num_processes=2)


def test_a_launch_inside_a_rank_is_refused():
    with pytest.raises(RuntimeError, match="inside a running launch"):
        notebook_launcher(_launches_again, num_processes=2, renderer=Renderer())


class NeedsKeywords(Exception):
    def __init__(self, *, code: int) -> None:
        super().__init__(f"failed with code {code}")
        self.code = code


class CarriesALock(Exception):
    pass


def _raises_unrebuildable(kind: str):
    import threading

    if kind == "keywords":
        raise NeedsKeywords(code=4)
    raise CarriesALock("holding a lock", threading.Lock())


@pytest.mark.parametrize("kind", ["keywords", "lock"])
def test_exceptions_that_cannot_be_rebuilt_keep_their_type(kind):
    expected = NeedsKeywords if kind == "keywords" else CarriesALock
    with pytest.raises(expected) as info:
        notebook_launcher(_raises_unrebuildable, args=(kind,), num_processes=2, renderer=Renderer())
    assert info.value.rank in (0, 1)  # the rank is named by an attribute and a note
    assert f"raised on rank {info.value.rank}" in info.value.__notes__
    if kind == "keywords":
        assert str(info.value) == "failed with code 4" and info.value.code == 4


def _kill_the_fork_server():
    if os.environ["RANK"] == "0":
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(30)


def test_a_killed_fork_server_is_named_and_the_next_launch_works():
    server = get_forkserver()
    fds = psutil.Process().num_fds()
    with pytest.raises(RankCrashed, match="fork server"):
        notebook_launcher(_kill_the_fork_server, num_processes=2, renderer=Renderer(), timeout=30)
    assert not psutil.pid_exists(server.pid) or psutil.Process(server.pid).status() == "zombie"
    assert notebook_launcher(os.getpid, num_processes=2, renderer=Renderer())
    assert get_forkserver().pid != server.pid
    assert psutil.Process().num_fds() <= fds + 2  # the new server's pipes, nothing per death


def _big(megabytes: int):
    return torch.ones(megabytes * 2**18)  # float32


def test_results_are_freed_once_the_caller_drops_them():
    values = notebook_launcher(_big, args=(64,), num_processes=2, renderer=Renderer())
    refs = [weakref.ref(v) for v in values]
    del values
    gc.collect()
    time.sleep(0.3)  # the fork server's reader thread has seen the workers end
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_gpu_ranks_above_the_gpu_count_are_refused_with_the_count():
    from nbaccel.launch.plan import check_gpu_count

    check_gpu_count(2, 2)
    check_gpu_count(8, 0)  # no GPU: CPU ranks, nothing to check
    with pytest.raises(ValueError, match=r"num_processes=3 but this machine has 2 GPU\(s\)"):
        check_gpu_count(3, 2)
