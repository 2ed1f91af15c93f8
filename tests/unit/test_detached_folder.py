"""Run folders and journals, without any process: ids, lookup by prefix, removal rules, the
journal's bound and its reader's partial frames, private directories, and the refusal of
unpicklable work before anything starts."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from nbaccel.launch.detached.folder import RunFolder, RunState, list_runs, remove_runs
from nbaccel.launch.detached.handle import submit
from nbaccel.launch.detached.journal import JournalReader, JournalWriter
from nbaccel.launch.detached.paths import private_dir
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.wire.unpicklable import UnpicklableError


def test_folders_are_private_found_by_prefix_and_removed_only_when_ended(tmp_path):
    root = private_dir(tmp_path / "runs")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    one = RunFolder.create("train", root)
    two = RunFolder.create("eval", root)
    assert stat.S_IMODE(one.path.stat().st_mode) == 0o700
    assert RunFolder.find(one.id, root).id == one.id
    with pytest.raises(KeyError, match="several runs"):
        RunFolder.find(one.id[:4], root)
    with pytest.raises(KeyError, match="is not a run"):
        RunFolder.find("nope", root)
    assert [i.name for i in list_runs(root)] == ["train", "eval"]
    with pytest.raises(ValueError, match="stop it first"):
        remove_runs([one.id], root=root)
    one.update(state=RunState.FINISHED, ended=1.0)  # ended long ago
    assert remove_runs(older_than_days=1, root=root) == [one.id]
    assert [i.id for i in list_runs(root)] == [two.id]


def test_the_journal_is_bounded_and_read_frame_by_frame(tmp_path):
    path = tmp_path / "journal.bin"
    writer = JournalWriter(path, bound=2000)
    reader = JournalReader(path)
    writer.write(("start", "2 ranks", 2))
    for i in range(100):
        writer.write(("line", i % 2, "stdout", f"line {i}"))
    writer.write(("finish", True, None))
    writer.close()
    records = reader.read()
    lines = [r for r in records if r[0] == "line"]
    assert 0 < len(lines) < 100 and lines[0] == ("line", 0, "stdout", "line 0")
    notices = [r[1] for r in records if r[0] == "notice"]
    assert "reached its bound" in notices[0]
    assert notices[-1] == f"{100 - len(lines)} output lines beyond the bound were not kept."
    assert records[-2] == ("finish", True, None)  # always kept, in order
    assert reader.read() == []

    data = path.read_bytes()  # a writer mid-record: the reader waits for the rest
    half = tmp_path / "half.bin"
    half.write_bytes(data[:7])
    partial = JournalReader(half)
    assert partial.read() == []
    half.write_bytes(data)
    assert partial.read() == records


def test_another_users_directory_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match="another user"):
        private_dir(theirs)


def test_unpicklable_work_is_refused_before_anything_starts(tmp_path):
    root = private_dir(tmp_path / "runs")
    request = LaunchRequest(num_processes=1, cpu=True, detach=True)
    with pytest.raises(UnpicklableError, match=r"args\[0\] \(lock\)"):
        submit(print, (threading.Lock(),), request, root=root)
    assert list(root.iterdir()) == []  # no folder, no supervisor


def test_the_supervisor_prunes_runs_past_the_age_limit(tmp_path, monkeypatch):
    from nbaccel.launch.detached.supervisor import MAX_AGE_VAR, Supervisor

    root = private_dir(tmp_path / "runs")
    old, going = RunFolder.create("old", root), RunFolder.create("going", root)
    old.update(state=RunState.FAILED, ended=1.0)
    going.update(state=RunState.RUNNING)
    Supervisor(root)._prune()  # no limit set: nothing removed
    assert len(list_runs(root)) == 2
    monkeypatch.setenv(MAX_AGE_VAR, "7")
    Supervisor(root)._prune()
    assert [i.id for i in list_runs(root)] == [going.id]


def test_a_detached_launch_is_planned_and_refused_in_the_notebook(tmp_path, monkeypatch):
    from nbaccel import notebook_launcher

    monkeypatch.setenv("NBACCEL_RUNS_DIR", str(tmp_path / "runs"))
    with pytest.raises(ValueError, match="not an address of this machine"):
        notebook_launcher(print, num_processes=2, cpu=True, master_addr="192.0.2.77", detach=True)
    assert not (tmp_path / "runs").exists()  # no folder, no supervisor


def test_a_run_whose_process_vanished_is_marked_failed(tmp_path):
    from pathlib import Path

    from nbaccel.launch.detached.handle import DetachedRun, current_runs

    root = private_dir(tmp_path / "runs")
    never = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids stay below it
    folder = RunFolder.create("train", root)
    folder.update(state=RunState.RUNNING, runner_pid=never)
    (info,) = current_runs(root)
    assert info.state == RunState.FAILED and "vanished" in info.reason
    assert DetachedRun(folder.id, root).wait(timeout=1).state == RunState.FAILED
