"""The per-host agent: one per host and launch, started by ``ssh`` or ``srun``.

    python -m nbaccel.launch.remote.agent          # reads its configuration from stdin (ssh)
                                                   # or NBACCEL_AGENT_CONFIG (srun's environment)

It starts a fork server with torch preloaded (``nbaccel.launch.launchers.forkserver``), connects
back to the kernel's hub over ZeroMQ CURVE (encrypted; the hub admits only this launch's client
keys), says hello (its address as the hosts reach it, a free port, its environment and paths),
then forks ranks when asked. The ranks connect to the notebook's channel exactly as local ranks
do, through a Unix socket in the agent's private directory that the agent tunnels to the kernel;
the launch's HMAC handshake runs end to end through the tunnel. Large tensors of the work arrive
once per host and are written to this host's /dev/shm, where every rank maps them.

No orphans: when the kernel's connection is lost (ssh's stdin closes, or no message for
``wire.LOST_AFTER`` seconds) the agent kills its ranks and exits; when the agent itself dies,
its fork server sees its stdin close and kills them.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import zmq

from nbaccel.launch.launchers.forkserver import ForkServer
from nbaccel.launch.processes import WorkerProcess
from nbaccel.launch.remote.relay import Relay
from nbaccel.launch.remote.wire import (
    CONFIG_VAR,
    HEARTBEAT,
    LOST_AFTER,
    Kind,
    decode,
    encode,
)

__all__ = ["main"]

_EXIT_KERNEL_LOST = 75


def _log(text: str) -> None:
    print(f"[nbaccel agent {socket.gethostname()}] {text}", file=sys.stderr, flush=True)


def _route_address(hub: str) -> str:
    """This host's address on the route to the kernel (what the other hosts reach, too)."""
    host = hub.split("://", 1)[-1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def relay_flags(relay: Relay) -> int:
    """What to wait for on a tunnelled connection: input unless it is closing, output while
    bytes wait to be written."""
    return (0 if relay.ending else zmq.POLLIN) | (zmq.POLLOUT if relay.wants_write else 0)


def _shm_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class Agent:
    """One host's side of a launch."""

    def __init__(self, config: dict[str, Any], watch_stdin: bool) -> None:
        self.config = config
        self.node = int(config["node"])
        self.watch_stdin = watch_stdin
        self.notes: list[str] = []  # for the notebook, sent after the hello
        cwd = config.get("cwd")
        if cwd:
            try:
                os.chdir(cwd)
            except OSError as exc:
                # asked for: a clear error; the kernel's own folder: it may not exist here
                if config.get("cwd_required"):
                    raise SystemExit(
                        f"[nbaccel agent {socket.gethostname()}] cannot enter cwd={cwd!r}: "
                        f"{exc.strerror}"
                    ) from None
                self.notes.append(
                    f"no {cwd} on this host ({exc.strerror}): the ranks run in {os.getcwd()}"
                )
        self.private = tempfile.mkdtemp(prefix=f"nbaccel-agent-{os.getpid()}-")
        # forked from this process, which imported torch already (one import per host, not two);
        # before any thread or socket of the agent exists
        self.server = ForkServer(config.get("preload", ()), fork=True)
        self.entrance = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = os.path.join(self.private, "channel")
        self.entrance.bind(path)
        os.chmod(path, 0o600)
        self.entrance.listen(256)
        self.entrance_path = path
        self.context = zmq.Context()
        self.link = self.context.socket(zmq.DEALER)
        self.link.setsockopt(zmq.LINGER, 0)
        self.link.setsockopt(zmq.SNDHWM, 0)
        self.link.setsockopt(zmq.RCVHWM, 0)
        self.link.setsockopt(zmq.ROUTING_ID, f"node-{self.node}".encode())
        self.link.curve_serverkey = config["server_key"].encode()
        self.link.curve_publickey = config["public"].encode()
        self.link.curve_secretkey = config["secret"].encode()
        self.link.connect(config["hub"])
        self.relays: dict[int, Relay] = {}
        self.sids = itertools.count(1)
        self.ranks: dict[int, WorkerProcess] = {}
        self.reported: set[int] = set()
        self.files: dict[str, int] = {}  # path -> fd holding its lock (see transport's sweep)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.server.add_wakeup(self._wake)
        self.last_heard = time.monotonic()
        self.last_sent = 0.0

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"x")

    def send(self, kind: Kind, header: dict[str, Any] | None = None, payload: bytes | None = None):
        self.link.send_multipart(encode(kind, header, payload))
        self.last_sent = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    def hello(self) -> None:
        self.server.wait_ready()
        self.send(
            Kind.HELLO,
            {
                "node": self.node,
                "hostname": socket.gethostname(),
                "addr": _route_address(self.config["hub"]),
                "port": _free_port(),
                "pid": os.getpid(),
                "cwd": os.getcwd(),
                "environ": dict(os.environ),
                "sys_path": list(sys.path),
                "entrance": self.entrance_path,
                "private": self.private,
                "shm": _shm_dir(),
                "cpus": os.cpu_count() or 1,
            },
        )

    def run(self) -> int:
        self.hello()
        for text in self.notes:
            self.send(Kind.LOG, {"text": text})
        self.last_heard = time.monotonic()  # the kernel's silence counts from the hello
        poller = zmq.Poller()
        poller.register(self.link, zmq.POLLIN)
        poller.register(self.entrance, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        if self.watch_stdin:
            poller.register(sys.stdin.fileno(), zmq.POLLIN)
        while True:
            watched = [r for r in self.relays.values() if relay_flags(r)]
            for relay in watched:
                poller.register(relay, relay_flags(relay))
            events = dict(poller.poll(int(HEARTBEAT * 1000)))
            for relay in watched:
                poller.unregister(relay)
            stdin = sys.stdin.fileno()
            if self.watch_stdin and stdin in events and not os.read(stdin, 4096):
                _log("the kernel's ssh connection closed: stopping the ranks")
                return _EXIT_KERNEL_LOST
            if self.wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            if self.link in events:
                while self.link.poll(0):
                    if self.handle(self.link.recv_multipart()) is False:
                        return 0
            if self.entrance.fileno() in events:
                conn, _ = self.entrance.accept()
                sid = next(self.sids)
                self.relays[sid] = Relay(conn)
                self.send(Kind.OPEN, {"sid": sid})
            for sid, relay in list(self.relays.items()):
                flags = events.get(relay.fileno(), 0)  # plain fds come back as numbers
                if flags & zmq.POLLOUT:
                    relay.flush()
                if flags & zmq.POLLIN and not relay.closed and not relay.ending:
                    self._pump(sid, relay)
                if relay.closed:
                    del self.relays[sid]
            self.report_exits()
            now = time.monotonic()
            if now - self.last_heard > LOST_AFTER:
                _log(f"no word from the kernel for {LOST_AFTER:.0f} s: stopping the ranks")
                return _EXIT_KERNEL_LOST
            if now - self.last_sent > HEARTBEAT:
                self.send(Kind.PING)

    def _pump(self, sid: int, relay: Relay) -> None:
        data = relay.read()
        if data is None:
            return
        if data:
            self.send(Kind.DATA, {"sid": sid}, data)
        else:
            relay.close()
            self.send(Kind.CLOSE, {"sid": sid})

    def handle(self, frames: list) -> bool:
        """Act on one message from the kernel; False to stop."""
        self.last_heard = time.monotonic()
        kind, header, payload = decode(frames)
        if kind == Kind.DATA:
            relay = self.relays.get(header["sid"])
            if relay is not None:
                relay.feed(payload)
        elif kind == Kind.CLOSE:
            relay = self.relays.get(header["sid"])
            if relay is not None:
                relay.finish()  # written out first; then the loop forgets it
        elif kind == Kind.SPAWN:
            self.spawn(int(header["rank"]), payload)
        elif kind == Kind.WORK:
            self.store(header["name"], payload)
        elif kind == Kind.SIGNAL:
            process = self.ranks.get(int(header["rank"]))
            if process is not None:
                process.signal_tree(int(header["signal"]))
        elif kind == Kind.UNLINK:
            for name in header["names"]:
                path = os.path.join(_shm_dir(), os.path.basename(name))
                if path in self.files:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    os.close(self.files.pop(path))
        elif kind == Kind.QUIT:
            return False
        return True

    def spawn(self, rank: int, spec_bytes: bytes) -> None:
        try:
            pid = self.server.spawn(spec_bytes)
        except RuntimeError as exc:
            self.reported.add(rank)
            self.send(Kind.EXITED, {"rank": rank, "code": 1, "at": time.time(), "detail": str(exc)})
            return
        self.ranks[rank] = WorkerProcess(pid, "agent", server=self.server)
        self.send(Kind.STARTED, {"rank": rank, "pid": pid})

    def store(self, name: str, data: bytes) -> None:
        """Write the work's shared tensors into this host's shared memory, once per host."""
        path = os.path.join(_shm_dir(), os.path.basename(name))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # ours until unlinked: another launch's sweep skips it
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            raise
        self.files[path] = fd

    def report_exits(self) -> None:
        for rank, process in self.ranks.items():
            if rank in self.reported:
                continue
            code = process.poll()
            if code is None:
                continue
            self.reported.add(rank)
            detail = process.lost
            with (
                contextlib.suppress(OSError),
                open(os.path.join(self.private, f"rank-{rank}.error")) as handle,
            ):
                detail = detail or handle.read(2000).strip()
            self.send(
                Kind.EXITED,
                {
                    "rank": rank,
                    "code": code,
                    "at": process.ended_at or time.time(),
                    "detail": detail,
                },
            )

    def close(self) -> None:
        for process in self.ranks.values():
            process.signal_tree(signal.SIGKILL)
        self.server.close()
        for relay in self.relays.values():
            relay.close()
        self.entrance.close()
        for path, fd in self.files.items():
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
        self.files.clear()
        shutil.rmtree(self.private, ignore_errors=True)
        self.link.close(0)
        self.context.term()


def _read_config() -> tuple[dict[str, Any], bool]:
    """The configuration and whether stdin stays the kernel's lifeline (ssh) or not (srun)."""
    encoded = os.environ.pop(CONFIG_VAR, "")
    if encoded:  # srun: one configuration for every node, keys by node id
        config = json.loads(base64.b64decode(encoded))
        node = int(os.environ.get("SLURM_NODEID", "0"))
        config.update(node=node, **config["nodes"][node])
        return config, False
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit("nbaccel agent: no configuration on stdin")
    return json.loads(line), True


def main() -> int:
    """Entry point (``python -m nbaccel.launch.remote.agent``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel forwards interrupts to ranks
    config, watch_stdin = _read_config()
    agent = Agent(config, watch_stdin)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(_EXIT_KERNEL_LOST))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(_EXIT_KERNEL_LOST))
    try:
        return agent.run()
    finally:
        agent.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is closed: skip the interpreter's slow teardown of torch
