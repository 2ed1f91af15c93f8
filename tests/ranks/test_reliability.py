"""Reliability: fault injection, soak without leaks, driver death, authenticated channel."""

from __future__ import annotations

import os
import pickle
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback

import psutil
import pytest
from faults import FAULTS, succeed
from recorder import Recorder

import nbaccel
from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.launchers.forkserver.launcher import get_forkserver
from nbaccel.launch.wire.channel import (
    AuthenticationFailed,
    Handshake,
    Listener,
    connect,
    new_secret,
    readable,
)


def _launch(fault: str):
    function, _, _ = FAULTS[fault]
    timeout = 1 if "timeout" in fault else 30
    return notebook_launcher(function, num_processes=2, timeout=timeout, renderer=Renderer())


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_reported_with_rank_and_cause(fault):
    _, type_name, text = FAULTS[fault]
    with pytest.raises(BaseException) as info:
        _launch(fault)
    # the fault itself, not the launch's 30 s timeout: the waiting rank was stopped for it
    assert type(info.value).__name__ == type_name
    assert text in "".join(traceback.format_exception_only(info.value))
    assert notebook_launcher(succeed, num_processes=2, renderer=Renderer()) == ["ok", "ok"]


def _resources() -> dict[str, object]:
    me = psutil.Process()
    server = psutil.Process(get_forkserver().pid)
    return {
        "workers": sorted(p.pid for p in server.children(recursive=True)),
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "shm": sorted(f for f in os.listdir("/dev/shm") if f.startswith("nbaccel-")),
        "tmp": sorted(
            f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"nbaccel-{me.pid}-")
        ),
        "listening": sorted(
            c.laddr for c in me.net_connections("all") if c.status == psutil.CONN_LISTEN
        ),
    }


def test_soak_50_launches_leak_nothing():
    notebook_launcher(succeed, num_processes=2, renderer=Renderer())  # warm everything up
    before = _resources()
    kinds = list(FAULTS)
    for i in range(50):
        if i % 2 == 0:
            assert notebook_launcher(succeed, num_processes=2, renderer=Renderer()) == ["ok"] * 2
        else:
            with pytest.raises(BaseException):  # noqa: B017 - every fault kind in turn
                _launch(kinds[(i // 2) % len(kinds)])
    deadline = time.monotonic() + 5
    after = _resources()
    while _grown(before, after) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _resources()
    assert not _grown(before, after), (before, after)


def _grown(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    """What is held now that was not before: new entries in the lists, higher counts (a
    count may fall, e.g. when a fault replaced the fork server and its pipes)."""
    grown: dict[str, object] = {}
    for key, now in after.items():
        was = before[key]
        if isinstance(now, list):
            new = [item for item in now if item not in was]  # type: ignore[operator]
            if new:
                grown[key] = new
        elif now > was:  # type: ignore[operator]
            grown[key] = (was, now)
    return grown


_DRIVER = textwrap.dedent(
    """
    import os, time
    from nbaccel import notebook_launcher

    def forever():
        print("worker", os.getpid(), flush=True)
        time.sleep(3600)

    if __name__ == "__main__":
        notebook_launcher(forever, num_processes=2)
    """
)


def test_workers_exit_when_the_driver_is_killed(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = []
    while len(pids) < 2:
        line = driver.stdout.readline()
        assert line, "driver ended early"
        if "worker" in line:
            pids.append(int(line.split()[-1]))
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        time.sleep(0.05)
    assert alive == []


def test_connection_without_the_secret_is_refused_before_unpickling(tmp_path):
    secret = new_secret()
    listener = Listener(secret)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(type("Evil", (), {"__reduce__": lambda s: (open, (str(marker), "w"))})())
    try:
        path = listener.address.location
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(path)
        raw.sendall(os.urandom(32) + b"\0" * 32 + len(evil).to_bytes(8, "big") + evil)
        with pytest.raises(AuthenticationFailed):
            listener.accept()
        raw.close()
        assert not marker.exists()
        # A peer with the wrong secret is refused too, and the client sees the driver's proof fail.
        client_error = []

        def wrong_client():
            try:
                connect(listener.address, new_secret(), {"rank": 0})
            except Exception as exc:
                client_error.append(exc)

        thread = threading.Thread(target=wrong_client)
        thread.start()
        with pytest.raises(AuthenticationFailed):
            listener.accept()
        thread.join(10)
        assert client_error and isinstance(client_error[0], (ConnectionError, EOFError, OSError))
        # The right secret gets through.
        clients = []
        thread = threading.Thread(
            target=lambda: clients.append(
                connect(listener.address, secret, {"rank": 0, "stream": "events"})
            )
        )
        thread.start()
        conn = listener.accept()
        thread.join(10)
        good = clients[0]
        good.send({"hello": 1})
        assert conn.recv() == {"hello": 1}
        assert conn.header["rank"] == 0
    finally:
        listener.close()
    assert not os.path.exists(os.path.dirname(listener.address.location))


def _challenge(listener: Listener, nonce: bytes) -> tuple[socket.socket, Handshake, bytes, bytes]:
    """A local process that speaks first, as a worker does; the driver's nonce and proof."""
    raw = socket.socket(socket.AF_UNIX)
    raw.settimeout(10)
    raw.connect(listener.address.location)
    raw.sendall(nonce)
    handshake = listener.start_handshake()
    assert readable([handshake], 10)
    assert handshake.advance() is None  # answered; the peer has not proved anything yet
    reply = b""
    while len(reply) < 64:
        reply += raw.recv(64 - len(reply))
    return raw, handshake, reply[:32], reply[32:]


def _answer(raw: socket.socket, handshake: Handshake, proof: bytes) -> None:
    raw.sendall(proof + len(b"{}").to_bytes(4, "big") + b"{}")
    deadline = time.monotonic() + 10
    while handshake.advance() is None:  # raises once the proof is in
        assert time.monotonic() < deadline
        readable([handshake], 1)


def test_the_drivers_early_proof_lets_no_one_in():
    """The driver proves the secret before the worker does (one wait per worker, not two); what
    a peer without the secret learns from that proof cannot be turned into its own: neither sent
    back, nor obtained for the driver's nonce on a second connection (the roles are in the MAC)."""
    listener = Listener(new_secret())
    try:
        first, first_handshake, driver_nonce, proof = _challenge(listener, os.urandom(32))
        # a second connection has the driver prove itself over the first one's challenge
        second, second_handshake, _, proof_over_driver_nonce = _challenge(listener, driver_nonce)
        with pytest.raises(AuthenticationFailed):
            _answer(first, first_handshake, proof_over_driver_nonce)
        with pytest.raises(AuthenticationFailed):
            _answer(second, second_handshake, proof)
        first.close()
        second.close()
    finally:
        listener.close()


def test_tcp_listener_binds_loopback_only():
    listener = Listener(new_secret(), host="127.0.0.1")
    try:
        assert listener.address.location[0] == "127.0.0.1"
    finally:
        listener.close()
    assert nbaccel.__version__


def _listening_addresses():
    from nbaccel import PartialState

    PartialState().wait_for_everyone()  # the process group (gloo) is up on every rank
    me = psutil.Process()
    return sorted({c.laddr.ip for c in me.net_connections("inet") if c.status == "LISTEN"})


def test_single_node_launch_listens_on_loopback_only():
    driver = psutil.Process()
    per_rank = notebook_launcher(_listening_addresses, num_processes=2, renderer=Renderer())
    for addresses in per_rank:
        assert set(addresses) <= {"127.0.0.1"}, addresses  # no TCPStore on 0.0.0.0 / ::
    assert [c for c in driver.net_connections("inet") if c.status == "LISTEN"] == []


def _what_a_rank_can_see():
    import sys

    print("environment", dict(os.environ))
    return dict(os.environ), list(sys.argv)


def test_the_secret_never_reaches_environment_arguments_or_output():
    from nbaccel.launch.driver.group import WorkerGroup
    from nbaccel.launch.registry import make_launcher
    from nbaccel.launch.wire.transport import pack

    lines = Recorder()
    payload, _ = pack((_what_a_rank_can_see, (), {}))
    group = WorkerGroup(
        1, lambda i: dict(os.environ), lines, make_launcher("forkserver"), work=payload
    )
    group.expect_call(0)
    try:
        group.start()
        group.pump_until(lambda: 0 in group.outcomes(0), 30)
        env, argv = group.outcomes(0)[0].value
    finally:
        group.close()
    secret = group._secret
    seen = " ".join([*env.values(), *argv, lines.text()])
    assert lines.lines  # the rank did print its environment
    assert secret.hex() not in seen and repr(secret) not in seen
    assert secret.hex() not in " ".join(psutil.Process(get_forkserver().pid).cmdline())


def test_private_folders_of_dead_processes_are_swept(monkeypatch):
    """A kernel killed with SIGKILL leaves its private folder; the next one removes it."""
    import pathlib
    import shutil

    import nbaccel.launch.wire.channel as channel

    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="sweep-"))  # short: it holds a socket
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(channel, "_sweeps", channel._Sweeps())  # this test's root is new
    try:
        _sweep_check(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _sweep_check(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"nbaccel-{dead.pid}-abc"
    stale.mkdir()
    (stale / "channel").write_text("")
    alive = tmp_path / f"nbaccel-{os.getpid()}-xyz"
    alive.mkdir()
    unrelated = tmp_path / "nbaccel-logs-0"
    unrelated.mkdir()
    listener = Listener(new_secret())
    try:
        assert not stale.exists()
        assert alive.exists() and unrelated.exists()
    finally:
        listener.close()


def test_a_long_temp_folder_still_gets_a_channel(tmp_path, monkeypatch):
    """A Unix socket path has ~104 bytes; a deep TMPDIR must not break launches."""
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    listener = Listener(new_secret())
    try:
        assert listener.address.location.startswith("/tmp/nbaccel-")
    finally:
        listener.close()
    assert notebook_launcher(succeed, num_processes=2, renderer=Renderer()) == ["ok", "ok"]
