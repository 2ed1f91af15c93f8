"""The per-user supervisor of detached runs: ``python -m nbaccel.launch.detached.supervisor ROOT``.

One per runs root, reused while it runs (an exclusive lock on ``supervisor.lock``), detached
from whoever started it (a new session, its parent gone: it belongs to no kernel). It listens
only on a Unix socket of mode 0600 inside the 0700 root, and answers only its own user (the
peer's uid, ``SO_PEERCRED``, where the platform has it). Requests are one JSON line each,
answers too: nothing arriving on the socket is unpickled.

It starts one runner process per run attempt (:mod:`nbaccel.launch.detached.runner`) and one
host process per detached pool (the module its folder's ``launch.json`` names; the pool folders
are :mod:`nbaccel.launch.detached.pool_folder`'s), passes
stop requests on as SIGINT (then SIGTERM, then SIGKILL of the runner's process group), and marks
a run whose runner vanished. On SIGTERM/SIGINT/SIGHUP it stops its runs cleanly and marks them;
killed outright, its runners and pool hosts see their pipe close and stop themselves. A pool
host is stopped with SIGTERM (it ends its ranks), then SIGKILL of its process group; the folder
of a pool whose host vanished is removed. With no run or pool going for
``NBACCEL_SUPERVISOR_IDLE`` seconds (default 600) it exits. With ``NBACCEL_RUNS_MAX_AGE_DAYS``
set, it removes the folders of runs that ended longer ago than that, at start and hourly.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nbaccel.launch.detached.folder import RunFolder, RunState, remove_runs
from nbaccel.launch.detached.paths import private_dir, socket_path
from nbaccel.launch.detached.pool_folder import PoolFolder, pools_root

__all__ = ["IDLE_VAR", "MAX_AGE_VAR", "Supervisor", "main", "peer_uid"]

IDLE_VAR = "NBACCEL_SUPERVISOR_IDLE"
MAX_AGE_VAR = "NBACCEL_RUNS_MAX_AGE_DAYS"
_PRUNE_EVERY = 3600.0
_STOP_STEPS = (("SIGTERM", 20.0), ("SIGKILL", 30.0))  # seconds after the SIGINT
_POOL_KILL_AFTER = 30.0  # seconds after a pool host's SIGTERM
_REQUEST_TIMEOUT = 5.0


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None where unknown)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    fmt = "3i"
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt))
    return struct.unpack(fmt, raw)[1]


@dataclass
class _Runner:
    run_id: str
    process: subprocess.Popen
    stopping_since: float | None = None
    step: int = 0

    def stop(self, first: int) -> None:
        """Send ``first`` once and count the escalation from now (a repeated stop is a no-op)."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            _signal(self.process, first)


class Supervisor:
    """Serves the runs under ``root`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = socket_path(root)
        self.runners: dict[str, _Runner] = {}
        self.pools: dict[str, _Runner] = {}  # pool id -> its host process
        self.idle = float(os.environ.get(IDLE_VAR, "600"))
        self.last_busy = time.monotonic()
        self.closing = False
        self.listener: socket.socket | None = None
        self.pruned_at = -_PRUNE_EVERY

    # ------------------------------------------------------------------ lifetime
    def listen(self) -> None:
        """Bind the socket (0600) and listen."""
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        listener.listen(16)
        listener.setblocking(False)
        self.listener = listener

    def serve(self) -> None:
        """Answer requests and watch the runners until idle or told to stop."""
        assert self.listener is not None
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            while True:
                for _key, _ in selector.select(timeout=0.25):
                    self._accept()
                self._reap()
                self._reap_pools()
                self._prune()
                if self.closing:
                    self._stop_all()
                    return
                if self.runners or self.pools:
                    self.last_busy = time.monotonic()
                elif time.monotonic() - self.last_busy > self.idle:
                    return
        finally:
            selector.close()
            self.listener.close()
            try:
                self.path.unlink()
            except OSError:
                pass

    def _prune(self) -> None:
        """Remove the folders of runs ended more than ``NBACCEL_RUNS_MAX_AGE_DAYS`` ago."""
        text = os.environ.get(MAX_AGE_VAR, "")
        now = time.monotonic()
        if not text or now - self.pruned_at < _PRUNE_EVERY:
            return
        self.pruned_at = now
        try:
            remove_runs(older_than_days=float(text), root=self.root)
        except (ValueError, OSError) as exc:  # a bad value or a folder in use: say it, go on
            print(f"nbaccel supervisor: pruning old runs failed: {exc}", file=sys.stderr)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.closing = True

    def _stop_all(self) -> None:
        """Stop every run (SIGINT, then escalate), mark them, wait for the runners."""
        for run_id in list(self.runners):
            self._stop(run_id, "its supervisor ended")
        for pool_id in list(self.pools):
            self._stop_pool(pool_id)
        while self.runners or self.pools:
            self._reap()
            self._reap_pools()
            time.sleep(0.1)

    # ------------------------------------------------------------------ requests
    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(_REQUEST_TIMEOUT)
            uid = peer_uid(conn)
            try:
                line = _read_line(conn)  # read first: a refusal sent early meets a broken pipe
                if uid is not None and uid != os.getuid():
                    answer = {"ok": False, "error": "this supervisor serves another user"}
                else:
                    answer = self._handle(json.loads(line))
            except Exception as exc:  # a bad request gets its error, the supervisor goes on
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self._answer(conn, answer)

    @staticmethod
    def _answer(conn: socket.socket, answer: dict[str, Any]) -> None:
        try:
            conn.sendall(json.dumps(answer).encode() + b"\n")
        except OSError:
            pass

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        self.last_busy = time.monotonic()
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "runs": sorted(self.runners),
                    "pools": sorted(self.pools)}  # fmt: skip
        if op == "shutdown":
            self.closing = True
            return {"ok": True}
        if op in ("pool-start", "pool-stop"):
            pool_id = str(request.get("pool", ""))
            if not pool_id or "/" in pool_id or pool_id.startswith("."):
                raise ValueError(f"not a pool id: {pool_id!r}")
            if op == "pool-start":
                self._start_pool(pool_id)
                return {"ok": True}
            return {"ok": True, "stopping": self._stop_pool(pool_id)}
        run_id = str(request.get("run", ""))
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"not a run id: {run_id!r}")
        if op in ("start", "resume"):
            self._start(run_id)
            return {"ok": True}
        if op == "stop":
            return {"ok": True, "stopping": self._stop(run_id, "stopped")}
        raise ValueError(f"unknown request {op!r}")

    # ------------------------------------------------------------------ runners
    def _start(self, run_id: str) -> None:
        folder = RunFolder(self.root / run_id)
        runner = self.runners.get(run_id)
        leaving = folder.info().state != RunState.RUNNING  # its runner wrote the end: exiting
        if runner is not None and runner.stopping_since is None and leaving:
            try:
                runner.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self._reap()
        if run_id in self.runners:
            raise ValueError(f"run {run_id} is still running: stop it first")
        launch = folder.read_json("launch.json")
        folder.update(state=RunState.STARTING, reason="", ended=None)
        process = _start_child(launch, "nbaccel.launch.detached.runner", folder.path,
                               folder.file("runner.log"))  # fmt: skip
        self.runners[run_id] = _Runner(run_id, process)

    def _stop(self, run_id: str, reason: str) -> bool:
        runner = self.runners.get(run_id)
        if runner is None:
            return False
        runner.stop(signal.SIGINT)
        return True

    def _reap(self) -> None:
        now = time.monotonic()
        for run_id, runner in list(self.runners.items()):
            code = runner.process.poll()
            if code is None:
                if runner.stopping_since is not None and runner.step < len(_STOP_STEPS):
                    name, after = _STOP_STEPS[runner.step]
                    if now - runner.stopping_since > after:
                        runner.step += 1
                        sig = getattr(signal, name)
                        if sig == signal.SIGKILL:
                            _kill_group(runner.process)
                        else:
                            _signal(runner.process, sig)
                continue
            if runner.process.stdin is not None:
                runner.process.stdin.close()
            del self.runners[run_id]
            self._mark_if_unmarked(run_id, code, runner.stopping_since is not None)

    def _mark_if_unmarked(self, run_id: str, code: int, stopped: bool) -> None:
        folder = RunFolder(self.root / run_id)
        try:
            info = folder.info()
        except OSError:
            return
        if info.ended_:
            return
        if stopped:
            folder.update(state=RunState.STOPPED, reason="stopped (its runner was killed)",
                          ended=time.time(), runner_pid=None)  # fmt: skip
        else:
            folder.update(state=RunState.FAILED, ended=time.time(), runner_pid=None,
                          reason=f"its runner process ended with code {code} before the run "
                          f"did; see {folder.file('runner.log')}")  # fmt: skip

    # ------------------------------------------------------------------ pool hosts
    def _start_pool(self, pool_id: str) -> None:
        if pool_id in self.pools:
            raise ValueError(f"pool {pool_id} already has its host process")
        folder = PoolFolder(pools_root(self.root) / pool_id)
        launch = json.loads(folder.file("launch.json").read_text())
        process = _start_child(launch, launch["entry"], folder.path, folder.file("host.log"))
        self.pools[pool_id] = _Runner(pool_id, process)

    def _stop_pool(self, pool_id: str) -> bool:
        host = self.pools.get(pool_id)
        if host is None:
            return False
        host.stop(signal.SIGTERM)
        return True

    def _reap_pools(self) -> None:
        for pool_id, host in list(self.pools.items()):
            if host.process.poll() is None:
                late = host.stopping_since is not None and host.step == 0
                if late and time.monotonic() - host.stopping_since > _POOL_KILL_AFTER:
                    host.step = 1
                    _kill_group(host.process)
                continue
            if host.process.stdin is not None:
                host.process.stdin.close()
            del self.pools[pool_id]
            folder = PoolFolder(pools_root(self.root) / pool_id)
            if folder.path.exists():  # its host did not end it: say so here, then tidy up
                log = folder.file("host.log")
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                print(f"nbaccel supervisor: pool {pool_id}'s host ended with code "
                      f"{host.process.returncode}:\n{tail}", file=sys.stderr)  # fmt: skip
                folder.remove()


def _start_child(
    launch: dict[str, Any], module: str, folder: Path, log_file: Path
) -> subprocess.Popen:
    """Start ``python -m MODULE FOLDER`` as ``launch.json`` says (interpreter, environment,
    working folder, the folder itself where that one is gone), in a session of its own, its
    output appended to ``log_file`` and its stdin a pipe: the pipe closes when the supervisor
    dies, which is how the child learns to stop itself."""
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(
            [launch["python"], "-m", module, str(folder)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=launch["env"],
            cwd=launch["cwd"] if os.path.isdir(launch["cwd"]) else str(folder),
            start_new_session=True,
        )
    finally:
        os.close(log)


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        process.send_signal(sig)
    except OSError:
        pass


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        _signal(process, signal.SIGKILL)


def _read_line(conn: socket.socket, limit: int = 65536) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError("request too long")
    return data


def _daemonize() -> int:
    """Leave the starting process (itself started in a new session): fork; the parent waits
    until the child is ready (or gave up), then exits, so the supervisor's parent is init and
    not the kernel. The child's end of the readiness pipe."""
    ready_read, ready_write = os.pipe()
    if os.fork():
        os.close(ready_write)
        os.read(ready_read, 1)
        os._exit(0)
    os.close(ready_read)
    return ready_write


def main(argv: list[str] | None = None) -> int:
    """Start (or, when one already serves ``ROOT``, leave to it) the supervisor of ``ROOT``."""
    argv = sys.argv[1:] if argv is None else argv
    root = private_dir(argv[0])
    ready = _daemonize()
    os.chdir(root)
    lock: IO[bytes] = os.fdopen(
        os.open(root / "supervisor.lock", os.O_RDWR | os.O_CREAT, 0o600), "r+b"
    )
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another supervisor serves this root
        os.close(ready)
        return 0
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    supervisor = Supervisor(root)
    supervisor.listen()
    os.write(ready, b"1")
    os.close(ready)
    supervisor.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
