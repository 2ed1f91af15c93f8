"""Ranks on other hosts start with the kernel's modules too: each host's fork server imports
them when a launch begins there (real agents on this machine, the remote launch without ssh;
``tests/remote_agents.py``). A module whose import makes forking unsafe gets the host a fresh
server without it, the launch goes on, and the notebook is told once per host; a module whose
file changed gets the host a fresh server at the next launch, which sees the file as it is."""

from __future__ import annotations

import os
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
    "remote_recorder_lib": "import os\nIMPORTED_IN = os.getpid()\nVERSION = 1\n",
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
    yield tmp_path
    shutdown_agents()
    for name in LIBRARIES:
        sys.modules.pop(name, None)


def _where():
    import os

    import remote_recorder_lib

    from nbaccel.launch.rank.inherited import inherited_modules

    inherited = inherited_modules() or ()
    return (
        os.getppid() == remote_recorder_lib.IMPORTED_IN,  # imported by the host's server
        "remote_thread_lib" in inherited,
        remote_recorder_lib.VERSION,
        os.getppid(),
    )


def _launch(libraries=LIBRARIES) -> tuple[list, list[str]]:
    """Launch ``_where`` on two "hosts": its values, and the notices the launch showed."""
    layout = parse_hosts(["pre-a:1", "pre-b:1"], None)
    remote = RemoteOptions(kind=KIND, layout=layout, python=sys.executable, cwd="/")
    request = LaunchRequest(num_processes=2, cpu=True, preload=["off", *libraries])
    plan = LaunchPlan.create(Front.LAUNCHER, request, remote=remote)
    shown = Recorder()
    values = run_function(plan, _where, renderer=shown).values()
    return values, shown.notices


def test_each_hosts_server_imports_the_modules_and_keeps_unsafe_ones_out(libraries):
    values, notices = _launch()
    assert [v[:3] for v in values] == [(True, False, 1), (True, False, 1)]
    # one line per host, naming it, the module, why, and how to silence it
    for host in ("pre-a", "pre-b"):
        line = next(n for n in notices if n.startswith(f"{host}: remote_thread_lib "))
        why = "is not preloaded for the ranks there: its import started a thread ('poller')"
        assert why in line and "each rank imports it itself" in line, line
        assert "NBACCEL_PRELOAD=-remote_thread_lib" in line, line
    assert len([n for n in notices if "not preloaded" in n]) == 2, notices
    # the next launch: the same servers, nothing said again
    again, notices = _launch()
    assert [v[3] for v in again] == [v[3] for v in values]
    assert not [n for n in notices if "not preloaded" in n], notices


def test_an_edited_module_is_seen_fresh_by_the_next_launch_on_each_host(libraries):
    first, _ = _launch(["remote_recorder_lib"])
    assert [v[2] for v in first] == [1, 1]
    path = libraries / "remote_recorder_lib.py"
    path.write_text(LIBRARIES["remote_recorder_lib"].replace("VERSION = 1", "VERSION = 2"))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    second, notices = _launch(["remote_recorder_lib"])
    assert [v[2] for v in second] == [2, 2]  # the file as it is now...
    assert [v[0] for v in second] == [True, True]  # ...imported by each host's server...
    assert all(a[3] != b[3] for a, b in zip(first, second, strict=True))  # ...a fresh one
    for host in ("pre-a", "pre-b"):
        assert (
            f"{host}: remote_recorder_lib changed since the fork server there imported it: a "
            "fresh server imports the files as they are now."
        ) in notices, notices
    third, notices = _launch(["remote_recorder_lib"])  # unchanged since: the same servers
    assert [v[3] for v in third] == [v[3] for v in second]
    assert not [n for n in notices if "changed since" in n], notices


def _host():
    import os

    return os.environ["NBACCEL_HOST"]


def test_a_host_whose_server_imports_for_long_is_not_taken_for_lost(libraries):
    """The kernel counts an agent silent for 5 s as lost; a host's server importing a slow
    library when the launch's ranks are asked for keeps its agent answering."""
    (libraries / "slow_import_lib.py").write_text("import time\ntime.sleep(7)\n")
    layout = parse_hosts(["pre-a:1", "pre-b:1"], None)
    remote = RemoteOptions(kind=KIND, layout=layout, python=sys.executable, cwd="/")
    request = LaunchRequest(num_processes=2, cpu=True, preload=["off", "slow_import_lib"])
    plan = LaunchPlan.create(Front.LAUNCHER, request, remote=remote)
    assert run_function(plan, _host, renderer=Recorder()).values() == ["pre-a", "pre-b"]


def _imported_by_server():
    import os

    import path_only_lib

    return os.getppid() == path_only_lib.IMPORTED_IN


def test_a_module_on_the_kernels_path_only_is_imported_by_each_hosts_server(
    libraries, tmp_path_factory, monkeypatch
):
    """A folder the notebook put on ``sys.path`` (not the hosts' PYTHONPATH): the hosts' servers
    look there too after their own path, as the ranks do."""
    folder = tmp_path_factory.mktemp("kernel-path")
    (folder / "path_only_lib.py").write_text("import os\nIMPORTED_IN = os.getpid()\n")
    monkeypatch.syspath_prepend(str(folder))
    layout = parse_hosts(["pre-a:1", "pre-b:1"], None)
    remote = RemoteOptions(kind=KIND, layout=layout, python=sys.executable, cwd="/")
    request = LaunchRequest(num_processes=2, cpu=True, preload=["off", "path_only_lib"])
    plan = LaunchPlan.create(Front.LAUNCHER, request, remote=remote)
    try:
        assert run_function(plan, _imported_by_server, renderer=Recorder()).values() == [True] * 2
    finally:
        sys.modules.pop("path_only_lib", None)


def _between():
    import os

    import between_lib

    return os.getppid() == between_lib.IMPORTED_IN


def test_modules_sent_between_launches_are_imported_before_the_next_one(libraries):
    """What the kernel imports after a launch reaches the hosts' servers at once (the kernel's
    hook after each cell sends it): the next launch's ranks fork with it, though that launch
    does not ask for it."""
    from nbaccel.launch.remote.warm import warm_agents

    (libraries / "between_lib.py").write_text("import os\nIMPORTED_IN = os.getpid()\n")
    _launch(["remote_recorder_lib"])  # the agents are up
    warm_agents("127.0.0.1").mirror(("a scan", 1), lambda: ["between_lib"])
    layout = parse_hosts(["pre-a:1", "pre-b:1"], None)
    remote = RemoteOptions(kind=KIND, layout=layout, python=sys.executable, cwd="/")
    request = LaunchRequest(num_processes=2, cpu=True, preload=["off", "remote_recorder_lib"])
    plan = LaunchPlan.create(Front.LAUNCHER, request, remote=remote)
    try:
        assert run_function(plan, _between, renderer=Recorder()).values() == [True, True]
    finally:
        sys.modules.pop("between_lib", None)
