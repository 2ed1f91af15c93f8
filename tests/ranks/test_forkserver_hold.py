"""The fork server steps aside while ranks forked from the kernel start: a held server's imports
wait (at the next module) until released, and a held server never outlives its kernel.

Real server processes; a stand-in library records when the server imported it.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from nbaccel.launch.launchers.forkserver.handle import ForkServer

LIBRARY = (
    "import os, time\nIMPORTED_AT = time.time()\n"
    "open(os.environ['HOLD_LIB_OUT'], 'w').write(str(IMPORTED_AT))\n"
)


@pytest.fixture
def library(tmp_path, monkeypatch):
    (tmp_path / "hold_lib.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "imported_at"
    monkeypatch.setenv("HOLD_LIB_OUT", str(out))
    return out


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_held_server_imports_only_once_released(library):
    server = ForkServer()
    try:
        server.wait_ready()
        server.hold()
        time.sleep(0.1)  # the signal is handled at once; the import below must wait on it
        server.mirror(["hold_lib"], quiet=False, stamp=False)
        assert server.importing()
        time.sleep(1.0)
        assert not library.exists(), "a held server imported a module"
        released = time.time()
        server.release()
        assert _wait_for(lambda: not server.importing(), 20)
        assert float(library.read_text()) >= released
        assert "hold_lib" in server.imported
        # and it still forks: the hold is not inherited by ranks (nothing to hold there)
        assert server.ready() and server.alive()
    finally:
        server.close()


def test_spawning_releases_a_held_server(library):
    """A launch that needs the server (a pool, a kernel that used CUDA) never waits on a hold."""
    server = ForkServer()
    try:
        server.wait_ready()
        server.hold()
        server.mirror(["hold_lib"], quiet=False, stamp=False)
        server.release()  # what spawn_many and wait_preloaded do first
        assert _wait_for(lambda: not server.importing(), 60), "the released server kept importing"
        assert library.exists()
    finally:
        server.close()


def test_a_held_server_ends_with_its_kernel(library, tmp_path):
    """A kernel killed while it holds its server: the server's imports go on and it exits (its
    pipe closed), instead of waiting forever for a release that cannot come."""
    pid_file = tmp_path / "server.pid"
    kernel = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import time
                from nbaccel.launch.launchers.forkserver.handle import ForkServer
                server = ForkServer()
                server.wait_ready()
                server.hold()
                time.sleep(0.1)
                server.mirror(["hold_lib"], quiet=False, stamp=False)
                open({str(pid_file)!r}, "w").write(str(server.pid))
                time.sleep(600)
                """
            ),
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert _wait_for(pid_file.exists, 60), "the kernel did not start its server"
        server_pid = int(pid_file.read_text())
        time.sleep(0.5)
        assert not library.exists(), "the held server imported"
        kernel.kill()
        kernel.wait()
        # the server notices its kernel is gone within its polling interval, imports, then
        # sees its pipe closed and exits
        assert _wait_for(lambda: not _running(server_pid), 20), (
            "the held server outlived its kernel"
        )
    finally:
        kernel.kill()
        kernel.wait()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_hold_sent_while_the_server_starts_holds_its_torch_import():
    """The hold may come before the server handles it (a launch right after ``import nbaccel``):
    it must neither kill the starting server nor be lost; torch's own import waits on it."""
    server = ForkServer()
    try:
        server.hold()  # at once: blocked in the new process until its bootstrap handles it
        time.sleep(3.0)
        assert not server.ready(), "the server imported torch while held"
        server.release()
        server.wait_ready()
        assert server.alive()
    finally:
        server.close()
