"""An agent's private folder: folders left by agents killed outright are removed by the next
agent on the host (only empty ones, only of processes gone), and a launch makes its agent's
folder again if it was swept. Real folders, a real socket."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from nbaccel.launch.remote.agent_session import Session, agent_folder


@pytest.fixture
def temp_root(monkeypatch):
    root = tempfile.mkdtemp(prefix="nbt-", dir="/tmp")  # short: a Unix socket's path goes in it
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as handle:
        pid = int(handle.read()) - 1
    while True:  # the highest number no process has
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_a_dead_agents_empty_folder_goes_and_nothing_else(temp_root):
    dead = _dead_pid()
    (temp_root / f"nbaccel-agent-{dead}-gone").mkdir()
    kept_full = temp_root / f"nbaccel-agent-{dead}-full"
    kept_full.mkdir()
    (kept_full / "launch-0-a").mkdir()
    kept_live = temp_root / f"nbaccel-agent-{os.getppid()}-live"  # a running process's
    kept_live.mkdir()
    kept_other = temp_root / "nbaccel-agent-x-other"
    kept_other.mkdir()

    mine = agent_folder()

    names = sorted(p.name for p in temp_root.iterdir())
    assert f"nbaccel-agent-{dead}-gone" not in names
    assert {kept_full.name, kept_live.name, kept_other.name} <= set(names)
    assert os.path.basename(mine).startswith(f"nbaccel-agent-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700


def test_a_launch_makes_its_swept_folder_again(temp_root):
    folder = agent_folder()
    os.rmdir(folder)  # as a sweep from another PID namespace sharing this temp dir would
    session = Session("lid", os.path.join(folder, "launch-0-lid"))
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(session.entrance_path).st_mode)
    finally:
        session.close()
    assert not os.path.exists(os.path.join(folder, "launch-0-lid"))
