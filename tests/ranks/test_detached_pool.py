"""A detached pool from Python, without a kernel: attach and take over, refusals that name the
fix (an unknown id, a pool another kernel holds, other versions), a rank that died while no one
was attached said at the next attach, ``nbaccel pools`` listing and stopping it, and another Unix
user kept out (list, attach, stop). Nothing is left: the fixture checks processes and shared
memory once the supervisor is gone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from detached import runs_fixture  # noqa: F401 (the fixture `runs`)

from nbaccel.launch.detached.pool_folder import list_pools, pools_root
from nbaccel.launch.detached.pool_link import connect
from nbaccel.launch.detached.recorder import RelayRenderer
from nbaccel.launch.host.processes import pid_alive
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.notebook.kernel.detached_pool import (
    PoolEnded,
    attach_detached_pool,
    start_detached_pool,
)

_SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def detached(runs, monkeypatch):
    """A started detached pool of 2 CPU ranks in the test's own runs folder (ended after)."""
    root, _, env = runs
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    request = LaunchRequest.create(Front.MAGIC, num_processes=2, cpu=True, detach=True)
    pool = start_detached_pool(request)
    try:
        yield root, pool
    finally:
        pool.shutdown()


def _gone(pids, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


def test_attach_takeover_and_the_refusals_that_name_the_fix(detached):
    root, first = detached
    first.run_cell("import torch\nx = torch.arange(3.0)")
    assert [info.id for info in list_pools()] == [first.id]

    with pytest.raises(RuntimeError, match=rf"attached to kernel pid {os.getpid()}.*--takeover"):
        attach_detached_pool(first.id)
    with pytest.raises(ValueError, match=rf"'pool-nope' is not a detached pool.*{first.id}"):
        attach_detached_pool("pool-nope")

    second = attach_detached_pool(first.id, takeover=True)
    assert second.welcome["taken_from"]["pid"] == os.getpid()
    values = second.run_cell("x.sum().item()")
    assert values[0]["data"]["text/plain"] == "3.0"  # the names outlived the holder's change
    with pytest.raises(PoolEnded, match="taken over"):
        first.run_cell("pass")

    # a kernel of other versions is refused, naming both: a hello as such a kernel sends it
    second.release()
    versions = second.info().versions
    assert versions["torch"]
    conn = connect(second.folder.socket)
    try:
        conn.send(
            (
                "hello",
                {
                    "pid": os.getpid(),
                    "host": "here",
                    "kernel": "other-env",
                    "versions": dict(versions, nbaccel="0.0.1"),
                    "takeover": True,
                },
            )
        )
        kind, text = conn.recv()
    finally:
        conn.close()
    assert kind == "refused"
    assert f"runs nbaccel {versions['nbaccel']} with torch {versions['torch']}" in text, text
    assert f"this kernel has nbaccel 0.0.1 with torch {versions['torch']}" in text, text
    third = attach_detached_pool(first.id)
    assert third.pull("x")[1].tolist() == [0.0, 1.0, 2.0]
    first.conn, first.closed = third.conn, False  # the fixture's shutdown goes through it


def test_a_takeover_mid_cell_stops_that_cell_and_each_cell_gets_the_ranks_labels(
    detached, tmp_path
):
    _, first = detached
    cells = [[], []]  # the renderer calls of two cells, as records
    for records, word in zip(cells, ("one", "two")):
        first.run_cell(f"print('{word}')", renderer=RelayRenderer(records.append))
    for records, word in zip(cells, ("one", "two")):
        assert records[0][0] == "labels", records  # each cell's renderer knows the ranks
        assert records[0][1].prefix(1) == first.labels.prefix(1) != ""
        lines = sorted((r[1], r[3]) for r in records if r[0] == "line")
        assert lines == [(0, word), (1, word)], records

    # a kernel taking the pool over while a cell runs stops that cell (the host reads the
    # takeover while it runs the call) and runs its own cells; the holder is told
    began = tmp_path / "began"
    outcome: dict = {}

    def hold() -> None:
        try:
            first.run_cell(f"import time\nopen({str(began)!r}, 'w').close()\ntime.sleep(120)")
        except BaseException as exc:
            outcome["exc"] = exc

    import threading

    holder = threading.Thread(target=hold)
    holder.start()
    deadline = time.monotonic() + 60
    while not began.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert began.exists()
    second = attach_detached_pool(first.id, takeover=True)
    assert second.run_cell("1 + 1")[0]["data"]["text/plain"] == "2"
    holder.join(60)
    assert not holder.is_alive()
    assert isinstance(outcome.get("exc"), PoolEnded), outcome
    assert "taken over" in str(outcome["exc"])
    first.conn, first.closed = second.conn, False  # the fixture's shutdown goes through it


def test_a_rank_that_dies_while_detached_is_reported_at_the_next_attach(detached):
    _, pool = detached
    pool.run_cell("y = 1")
    pids = pool.pids
    pool.release()
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not pool.folder.info().lost and time.monotonic() < deadline:
        time.sleep(0.2)
    again = attach_detached_pool(pool.id)
    assert "rank(s) [1] ended" in again.welcome["lost"], again.welcome
    assert "names defined on the ranks are lost" in again.welcome["lost"]
    again.run_cell("z = 2")  # the pool restarts its ranks and goes on
    assert not again.folder.info().lost

    # the stop button (SIGINT in the kernel) interrupts the cell on the ranks; names are kept
    import threading

    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    cell = (
        "import time\ntry:\n    time.sleep(120)\n    slept = 'through'\n"
        "except KeyboardInterrupt:\n    slept = 'interrupted'\n    raise"
    )
    with pytest.raises(KeyboardInterrupt):
        again.run_cell(cell)
    assert again.pull("slept") == {0: "interrupted", 1: "interrupted"}
    assert again.pull("z") == {0: 2, 1: 2}
    pool.conn, pool.closed = again.conn, False


def test_nbaccel_pools_lists_and_stops_a_pool(detached):
    root, pool = detached
    pool.run_cell("print('hello')")
    pids = list(pool.pids.values())
    host = pool.info().host_pid
    cli = [sys.executable, "-m", "nbaccel", "pools"]
    listed = subprocess.run(cli, capture_output=True, text=True, timeout=120, env=os.environ)
    assert listed.returncode == 0, listed.stderr
    head, row = listed.stdout.splitlines()[:2]
    for column in ("id", "ranks", "started", "last cell", "attached", "memory"):
        assert column in head
    assert pool.id in row and "print('hello')" in row and f"kernel pid {os.getpid()}" in row
    unknown = subprocess.run([*cli, "stop", "pool-nope"], capture_output=True, text=True,
                             timeout=120, env=os.environ)  # fmt: skip
    assert unknown.returncode == 2 and pool.id in unknown.stderr, unknown.stderr
    stopped = subprocess.run([*cli, "stop", pool.id], capture_output=True, text=True, timeout=120,
                             env=os.environ)  # fmt: skip
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert _gone([host, *pids])
    assert list(pools_root(root).iterdir()) == []
    with pytest.raises(PoolEnded, match="has ended"):
        pool.run_cell("pass")


_AS_OTHER = """
import json, os, socket, sys
pools, pool_id, sock, supervisor = sys.argv[1:5]
out = {}
def attempt(name, call):
    try:
        out[name] = ["ok", call()]
    except OSError as exc:
        out[name] = [type(exc).__name__, str(exc)]
attempt("list", lambda: os.listdir(pools))
def attach():
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(sock)
    try:  # a pickle frame: never read, the host closes a stranger's connection first
        conn.sendall(b"\\0\\0\\0\\0\\0\\0\\0\\1N")
        return conn.recv(4096).hex() or "closed"
    except OSError:
        return "closed"
attempt("attach", attach)
def stop():
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(supervisor)
    conn.sendall(json.dumps({"op": "pool-stop", "pool": pool_id}).encode() + b"\\n")
    return conn.recv(4096).decode()
attempt("stop", stop)
print(json.dumps(out))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("runuser") or not os.path.exists(_SYSTEM_PYTHON),
    reason="needs root (runuser as the user nobody) and /usr/bin/python3: a root-lane test",
)
def test_another_user_cannot_list_attach_or_stop_a_pool(detached):
    from nbaccel.launch.detached.paths import socket_path

    root, pool = detached
    pool.run_cell("w = 7")
    paths = [str(pools_root(root)), pool.id, str(pool.folder.socket), str(socket_path(root))]

    def as_nobody() -> dict:
        done = subprocess.run(
            ["runuser", "-u", "nobody", "--", _SYSTEM_PYTHON, "-c", textwrap.dedent(_AS_OTHER),
             *paths], capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    seen = as_nobody()
    assert [seen[k][0] for k in ("list", "attach", "stop")] == ["PermissionError"] * 3, seen

    # even with every folder and socket opened up, the host and the supervisor answer only
    # their user: the host closes the connection unread, the supervisor refuses
    opened = [root, pools_root(root), pool.folder.path]
    for folder in opened:
        os.chmod(folder, 0o711)
    for sock in paths[2:]:
        os.chmod(sock, 0o666)
    try:
        seen = as_nobody()
    finally:
        for folder in opened:
            os.chmod(folder, 0o700)
        for sock in paths[2:]:
            os.chmod(sock, 0o600)
    assert seen["list"][0] == "PermissionError", seen  # 0711: no listing
    assert seen["attach"] == ["ok", "closed"], seen  # closed unread: nothing came back
    status, answer = seen["stop"]
    assert status == "ok" and "another user" in json.loads(answer)["error"], seen
    assert pool.pull("w")[0] == 7  # the pool went on, untouched
