"""Another Unix user cannot list, read, attach to or stop this user's detached runs; a stopped
run leaves nothing behind and says it was stopped.

The other user is ``nobody``, driven with ``runuser``, so this needs root (it belongs with the
root lanes, ``scripts/test-hosts``; as another user it is skipped). That user runs the system's
Python with the standard library only: the same system calls nbaccel would make (list the
folder, read a run's files, connect to the supervisor's socket and send it a stop request).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap

import pytest
from detached import runs_fixture  # noqa: F401 (the fixture `runs`)

from nbaccel import notebook_launcher
from nbaccel.launch.detached.folder import RunState
from nbaccel.launch.detached.handle import RunStopped
from nbaccel.launch.detached.paths import socket_path

_SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("runuser") or not os.path.exists(_SYSTEM_PYTHON),
    reason="needs root (runuser as the user nobody) and /usr/bin/python3: a root-lane test",
)


def sleeper(seconds: float) -> str:
    import time

    print("started", flush=True)
    time.sleep(seconds)
    return "slept"


_AS_OTHER = """
import json, os, socket, sys
root, run_id, sock = sys.argv[1:4]
out = {}
def attempt(name, call):
    try:
        out[name] = ["ok", call()]
    except OSError as exc:
        out[name] = [type(exc).__name__, str(exc)]
attempt("list", lambda: os.listdir(root))
attempt("read", lambda: open(os.path.join(root, run_id, "journal.bin"), "rb").read(10).hex())
def stop():
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(sock)
    conn.sendall(json.dumps({"op": "stop", "run": run_id}).encode() + b"\\n")
    return conn.recv(4096).decode()
attempt("stop", stop)
print(json.dumps(out))
"""


def _story(run) -> str:
    """What to show when the run is not where the test expects it."""
    log = run.folder.file("runner.log")
    return f"{run.info}\n{log.read_text() if log.exists() else ''}"


def _as_nobody(root, run_id) -> dict:
    done = subprocess.run(
        ["runuser", "-u", "nobody", "--", _SYSTEM_PYTHON, "-c", textwrap.dedent(_AS_OTHER),
         str(root), run_id, str(socket_path(root))],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_another_user_cannot_list_read_or_stop_a_run(runs, monkeypatch):
    root, _, env = runs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = notebook_launcher(sleeper, (120,), num_processes=2, cpu=True, detach=True)
    try:
        seen = _as_nobody(root, run.id)
        assert seen["list"][0] == "PermissionError", seen
        assert seen["read"][0] == "PermissionError", seen
        assert seen["stop"][0] == "PermissionError", seen

        # even with the folder and the socket opened up, the supervisor answers only its user
        sock = socket_path(root)
        os.chmod(root, 0o711)
        os.chmod(sock, 0o666)
        try:
            seen = _as_nobody(root, run.id)
        finally:
            os.chmod(root, 0o700)
            os.chmod(sock, 0o600)
        status, answer = seen["stop"]
        assert status == "ok" and "another user" in json.loads(answer)["error"], seen
        assert run.state in (RunState.STARTING, RunState.RUNNING), _story(run)
    finally:
        info = run.stop()  # the stop button's guarantees: every rank ends (checked by `runs`)
    assert info.state == RunState.STOPPED, _story(run)
    with pytest.raises(RunStopped, match="stopped"):
        run.result()
