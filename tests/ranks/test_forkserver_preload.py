"""What ranks start with: modules the fork server imported for them, inherited by the fork; a
module whose import makes forking unsafe (initialises CUDA, starts a thread, opens a socket) kept
out and named, the launch going on; an edited module seen fresh by the next launch.

On a machine without CUDA a library that initialises CUDA at import is simulated by a module
that marks torch's CUDA state initialised (what ``torch.cuda.init()`` leaves behind);
``tests/kernel/test_gpu_launch.py`` does it for real on a GPU. The kernel's own side (its
imports mirrored by the import hook, no ``preload=`` given) is ``tests/kernel/test_preload.py``.
"""

import os
import sys

import pytest
from recorder import Recorder

from nbaccel.launch.launchers.forkserver.launcher import (
    get_forkserver,
    preload_report,
    shutdown_forkserver,
)
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.run import run_function

LIBRARIES = {
    "cuda_at_import_lib": "import torch\ntorch.cuda._initialized = True  # as torch.cuda.init()\n",
    "thread_at_import_lib": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True, name='poller').start()\n"
    ),
    "socket_at_import_lib": "import socket\nCONNECTION = socket.socket()\n",
    "recorder_lib": (
        "import os\nIMPORTED_IN = os.getpid()\nVERSION = 1\n"
        "FLAG = os.environ.get('RECORDER_LIB_FLAG')\n"  # read at import, as HF_HOME is
    ),
}


@pytest.fixture
def libraries(tmp_path, monkeypatch):
    """The stand-in libraries, on ``sys.path`` and imported here (as a notebook would)."""
    for name, code in LIBRARIES.items():
        (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    import recorder_lib  # noqa: F401 - the others must not touch this process

    yield tmp_path
    for name in LIBRARIES:
        sys.modules.pop(name, None)
    shutdown_forkserver()  # never leave a server with these modules to the next test


def _start():
    import os

    import recorder_lib

    from nbaccel.launch.rank.inherited import inherited_modules

    inherited = inherited_modules() or frozenset()
    return {
        "imported_in": recorder_lib.IMPORTED_IN,
        "pid": os.getpid(),
        "server": os.getppid(),
        "version": recorder_lib.VERSION,
        "flag": recorder_lib.FLAG,
        "inherited": sorted(m for m in inherited if m.endswith("_lib")),
    }


def _launch(words, shown=None):
    plan = LaunchPlan.create(Front.TESTING, LaunchRequest(num_processes=2, cpu=True, preload=words))
    return run_function(plan, _start, renderer=shown or Recorder()).values()


def test_unsafe_imports_are_kept_out_and_named_and_the_launch_goes_on(libraries, monkeypatch):
    get_forkserver()  # started before the variable below is set
    monkeypatch.setenv("RECORDER_LIB_FLAG", "set after the server started")
    shown = Recorder()
    values = _launch(["off", *LIBRARIES], shown)  # off: only these, not pytest's modules
    assert len(values) == 2
    for value in values:
        # imported once, in the server the ranks were forked from, not in the rank
        assert value["imported_in"] == value["server"] != value["pid"]
        assert value["inherited"] == ["recorder_lib"]
        assert value["flag"] == "set after the server started"  # the kernel's os.environ
    notices = "\n".join(shown.notices)
    for name, why in [
        ("cuda_at_import_lib", "initialised CUDA"),
        ("thread_at_import_lib", "started a thread ('poller')"),
        ("socket_at_import_lib", "opened a socket"),
    ]:
        line = next(n for n in shown.notices if n.startswith(f"{name} is not preloaded"))
        assert why in line and f"NBACCEL_PRELOAD=-{name}" in line, notices
    report = preload_report()
    assert set(report["refused"]) == {n for n in LIBRARIES if n != "recorder_lib"}
    assert "recorder_lib" in report["preloaded"] and report["server_rss"] > 0
    # the next launch: the same server, nothing said again
    again = Recorder()
    assert _launch(["off", *LIBRARIES], again)[0]["server"] == values[0]["server"]
    assert not [n for n in again.notices if "not preloaded" in n]


def test_an_edited_module_is_seen_fresh_by_the_next_launch(libraries):
    first = _launch(["off", "recorder_lib"])
    assert {v["version"] for v in first} == {1}
    path = libraries / "recorder_lib.py"
    path.write_text(LIBRARIES["recorder_lib"].replace("VERSION = 1", "VERSION = 2"))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    shown = Recorder()
    second = _launch(["off", "recorder_lib"], shown)
    assert {v["version"] for v in second} == {2}  # the file as it is now
    assert second[0]["server"] != first[0]["server"]  # from a fresh server...
    assert second[0]["imported_in"] == second[0]["server"]  # ...which imported it
    assert any("recorder_lib changed since" in n for n in shown.notices)


def test_preload_off_leaves_the_module_to_the_ranks(libraries):
    values = _launch(["off"])
    assert all(v["imported_in"] == v["pid"] and not v["inherited"] for v in values)


def test_spawn_start_method_is_not_affected(libraries):
    plan = LaunchPlan.create(
        Front.TESTING, LaunchRequest(num_processes=1, cpu=True, start_method="spawn")
    )
    report = run_function(plan, _start, renderer=Recorder(), preload=("cuda_at_import_lib",))
    assert len(report.values()) == 1
