"""Ranks on other hosts start with the kernel's modules too: each host's fork server imports
them when a launch begins there (real agents on this machine, the remote launch without ssh;
``tests/remote_agents.py``). A module whose import makes forking unsafe gets the host a fresh
server without it, and the launch goes on."""

from __future__ import annotations

import sys

import pytest
from recorder import Recorder
from remote_agents import KIND

from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.remote.hosts import parse_hosts
from nbaccel.launch.remote.options import RemoteOptions
from nbaccel.launch.remote.warm import shutdown_agents
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.run import run_function

LIBRARIES = {
    "remote_recorder_lib": "import os\nIMPORTED_IN = os.getpid()\n",
    "remote_thread_lib": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True, name='poller').start()\n"
    ),
}


@pytest.fixture
def libraries(tmp_path, monkeypatch):
    for name, code in LIBRARIES.items():
        (tmp_path / f"{name}.py").write_text(code)
    # the hosts' agents find them on their sys.path, as a shared file system would give them
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{sys.path[0]}:" + ":".join(sys.path[1:4]))
    monkeypatch.syspath_prepend(str(tmp_path))
    shutdown_agents()  # agents started now, with that PYTHONPATH
    yield
    shutdown_agents()
    for name in LIBRARIES:
        sys.modules.pop(name, None)


def _where():
    import os

    import remote_recorder_lib

    from nbaccel.launch.launchers.forkserver_loop import inherited_modules

    inherited = inherited_modules() or ()
    return (
        os.getppid() == remote_recorder_lib.IMPORTED_IN,  # imported by the host's server
        "remote_thread_lib" in inherited,
    )


def test_each_hosts_server_imports_the_modules_and_keeps_unsafe_ones_out(libraries):
    layout = parse_hosts(["pre-a:1", "pre-b:1"], None)
    remote = RemoteOptions(kind=KIND, layout=layout, python=sys.executable, cwd="/")
    request = LaunchRequest(num_processes=2, cpu=True, preload=["off", *LIBRARIES])
    plan = LaunchPlan.create(Front.LAUNCHER, request, remote=remote)
    values = run_function(plan, _where, renderer=Recorder()).values()
    assert values == [(True, False), (True, False)]
