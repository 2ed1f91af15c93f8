"""The per-host agent: one per host for the kernel's life, started by ``ssh`` or ``srun``.

    python -m nbaccel.launch.remote.agent          # reads its configuration from stdin (ssh)
                                                   # or NBACCEL_AGENT_CONFIG (srun's environment)

It starts a fork server with torch preloaded (``nbaccel.launch.launchers.forkserver``),
connects back to the kernel's hub over ZeroMQ CURVE (encrypted; the hub admits only the keys it
made for its agents), says hello (its address as the hosts reach it, its environment and paths),
then serves one launch after another, each a :class:`Session` (``BEGIN`` ... ``END``): a later
launch on this host costs a fork per rank, not an ``import torch``. A session's ranks connect to
the notebook's channel exactly as local ranks do, through a Unix socket in the session's private
directory that the agent tunnels to the kernel; the launch's HMAC handshake runs end to end
through the tunnel. Large tensors of the work arrive once per host and are written to this
host's /dev/shm, where every rank maps them. The server imports the kernel's modules when a
launch begins, and between launches (``MIRROR``); its generations (a module kept out, a file
that changed) are :mod:`.host_server`'s, and what they have to say reaches the notebook as the
launch's notices (``LOG``).

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
import select
import shutil
import signal
import socket
import sys
import time
from typing import Any

import zmq

from nbaccel.launch.host.ports import free_port
from nbaccel.launch.host.processes import WorkerProcess
from nbaccel.launch.remote.agent_session import (
    Session,
    agent_folder,
    directory_error,
    machine_id,
    shm_dir,
)
from nbaccel.launch.remote.host_server import HostServer
from nbaccel.launch.remote.messages import (
    CONFIG_VAR,
    HEARTBEAT,
    LOST_AFTER,
    RECEIVE_SLICE,
    WINDOW,
    Kind,
    decode,
    encode,
)
from nbaccel.launch.remote.relay import Relay

__all__ = ["main"]

_EXIT_KERNEL_LOST = 75
#: what this agent understands beyond the first version's messages (the kernel sends those
#: only to agents that say so: an agent of an older nbaccel on a host is served as before)
FEATURES = ("mirror",)


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


def relay_flags(relay: Relay, reading: bool = True) -> int:
    """What to wait for on a tunnelled connection: input unless it is closing (or the kernel's
    window is full), output while bytes wait to be written."""
    wanted = zmq.POLLIN if reading and not relay.ending else 0
    return wanted | (zmq.POLLOUT if relay.wants_write else 0)


class Agent:
    """One host's side of the kernel's launches."""

    def __init__(self, config: dict[str, Any], watch_stdin: bool) -> None:
        self.config = config
        self.name = str(config.get("name", socket.gethostname()))
        self.watch_stdin = watch_stdin
        self.start_dir = os.getcwd()
        self.private = agent_folder()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        # forked from this process, which imported torch already (one import per host, not two);
        # before any thread or socket of the agent exists
        self.servers = HostServer(config.get("preload", ()), self._wake)
        self.context = zmq.Context()
        self.link = self.context.socket(zmq.DEALER)
        self.link.setsockopt(zmq.LINGER, 0)
        self.link.setsockopt(zmq.SNDHWM, 0)
        self.link.setsockopt(zmq.RCVHWM, 0)
        self.link.setsockopt(zmq.ROUTING_ID, f"agent-{config['id']}".encode())
        self.link.curve_serverkey = config["server_key"].encode()
        self.link.curve_publickey = config["public"].encode()
        self.link.curve_secretkey = config["secret"].encode()
        self.link.connect(config["hub"])
        self.sessions: dict[str, Session] = {}
        self.relays: dict[int, tuple[str, Relay]] = {}  # sid -> (lid, its connection)
        self.sids = itertools.count(1)
        self.dying: list[WorkerProcess] = []  # killed at their launch's end, not yet reaped
        self.last_heard = time.monotonic()
        self.last_sent = 0.0
        # launch id -> its ranks' bytes sent to the kernel, and those the kernel acknowledged
        self.sent_bytes: dict[str, int] = {}
        self.acked: dict[str, int] = {}

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"x")

    def ahead(self, lid: str) -> int:
        """Bytes of launch ``lid`` sent that the kernel has not written to its sockets yet."""
        return self.sent_bytes.get(lid, 0) - self.acked.get(lid, 0)

    def send(self, kind: Kind, header: dict[str, Any] | None = None, payload: bytes | None = None):
        self.link.send_multipart(encode(kind, header, payload))
        self.last_sent = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    def hello(self) -> None:
        self.servers.wait_ready()
        self.send(
            Kind.HELLO,
            {
                "hostname": socket.gethostname(),
                "addr": _route_address(self.config["hub"]),
                "pid": os.getpid(),
                "server_pid": self.servers.server.pid,
                "environ": dict(os.environ),
                "sys_path": list(sys.path),
                "shm": shm_dir(),
                "cpus": os.cpu_count() or 1,
                "machine": machine_id(),
                "features": list(FEATURES),
            },
        )

    def run(self) -> int:
        self.hello()
        self.last_heard = time.monotonic()  # the kernel's silence counts from the hello
        stdin = sys.stdin.fileno()
        while True:
            poller = zmq.Poller()
            poller.register(self.link, zmq.POLLIN)
            poller.register(self.wake_r, zmq.POLLIN)
            if self.watch_stdin:
                poller.register(stdin, zmq.POLLIN)
            entrances = {s.entrance.fileno(): s for s in self.sessions.values()}
            for fd in entrances:
                poller.register(fd, zmq.POLLIN)
            # each launch has its own window: a pool whose output waits for its next cell
            # (nobody reads it in between) must not hold up another launch's ranks
            reading = {lid: self.ahead(lid) < WINDOW for lid in self.sessions}
            for lid, relay in self.relays.values():
                flags = relay_flags(relay, reading.get(lid, False))
                if flags:
                    poller.register(relay, flags)
            events = dict(poller.poll(int(HEARTBEAT * 1000)))
            if self.watch_stdin and stdin in events and not os.read(stdin, 4096):
                _log("the kernel's ssh connection closed: stopping the ranks")
                return _EXIT_KERNEL_LOST
            if self.wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            if self.link in events:
                until = time.monotonic() + RECEIVE_SLICE
                while self.link.poll(0) and time.monotonic() < until:
                    if self.handle(self.link.recv_multipart()) is False:
                        return 0
            for fd, session in entrances.items():
                if fd in events and session.lid in self.sessions:
                    conn, _ = session.entrance.accept()
                    sid = next(self.sids)
                    self.relays[sid] = (session.lid, Relay(conn))
                    self.send(Kind.OPEN, {"lid": session.lid, "sid": sid})
            # in the order the connections opened (a rank opens stdout, stderr, then events),
            # each read to its end: what a rank printed before its result leaves before it
            for sid, (lid, relay) in list(self.relays.items()):
                flags = events.get(relay.fileno(), 0) if not relay.closed else 0
                if flags & zmq.POLLOUT:
                    relay.flush()
                # a full window stops the round's reads of that launch, not one relay's: a
                # rank's later connection (its events) is never read before its earlier ones
                reading[lid] = reading.get(lid, False) and self.ahead(lid) < WINDOW
                if flags & zmq.POLLIN and reading[lid] and not relay.closed and not relay.ending:
                    self._pump(sid, lid, relay)
                if relay.closed:
                    del self.relays[sid]
            self.report_exits()
            now = time.monotonic()
            if now - self.last_heard > LOST_AFTER:
                _log(f"no word from the kernel for {LOST_AFTER:.0f} s: stopping the ranks")
                return _EXIT_KERNEL_LOST
            if now - self.last_sent > HEARTBEAT:
                self.send(Kind.PING)

    def _pump(self, sid: int, lid: str, relay: Relay) -> None:
        data = relay.read(WINDOW - self.ahead(lid))  # a relay cut short here fills the window:
        # the round reads no later connection of the launch (see run)
        if data is None:
            return
        if data:
            self.send(Kind.DATA, {"sid": sid, "lid": lid}, data)
            self.sent_bytes[lid] = self.sent_bytes.get(lid, 0) + len(data)
        else:
            relay.close()
            self.send(Kind.CLOSE, {"sid": sid})

    def handle(self, frames: list) -> bool:
        """Act on one message from the kernel; False to stop."""
        self.last_heard = time.monotonic()
        try:
            kind, header, payload = decode(frames)
        except ValueError:  # a kind this agent does not know (a newer kernel): not for it
            return True
        if kind in (Kind.DATA, Kind.CLOSE):
            _, relay = self.relays.get(header["sid"], (None, None))
            if relay is not None and kind == Kind.DATA:
                relay.feed(payload)
            elif relay is not None:
                relay.finish()  # written out first; then the loop forgets it
        elif kind == Kind.ACK:
            lid = str(header["lid"])
            if lid in self.sessions:
                self.acked[lid] = max(self.acked.get(lid, 0), int(header["bytes"]))
        elif kind == Kind.QUIT:
            return False
        elif kind == Kind.BEGIN:
            self.begin(header)
        elif kind == Kind.END:
            self.end(str(header["lid"]))
        elif kind == Kind.MIRROR:
            self.servers.mirror(header.get("modules", ()), header.get("sys_path", ()))
        elif (session := self.sessions.get(str(header.get("lid")))) is not None:
            if kind == Kind.SPAWN:
                self.spawn(session, int(header["rank"]), payload)
            elif kind == Kind.WORK:
                self.store(session, header["name"], payload)
            elif kind == Kind.SIGNAL:
                process = session.ranks.get(int(header["rank"]))
                if process is not None and header.get("tree", True):
                    process.signal_tree(int(header["signal"]))
                elif process is not None:
                    process.signal(int(header["signal"]))
            elif kind == Kind.UNLINK:
                for name in header["names"]:
                    session.unlink(os.path.join(shm_dir(), os.path.basename(name)))
        return True

    # ------------------------------------------------------------------ launches
    def begin(self, header: dict[str, Any]) -> None:
        """A launch starts using this host: its folder checked, its modules preloaded."""
        lid = str(header["lid"])
        cwd = header.get("cwd") or self.start_dir
        notes = []
        why = directory_error(cwd)
        if why is not None:
            if header.get("cwd_required"):  # asked for: a clear error
                error = f"[nbaccel agent {socket.gethostname()}] cannot enter cwd={cwd!r}: {why}"
                self.send(Kind.READY, {"lid": lid, "error": error})
                return
            # the kernel's own folder: it may not exist here
            notes.append(f"no {cwd} on this host ({why}): the ranks run in {self.start_dir}")
            cwd = self.start_dir
        # the kernel's imported modules, imported here too while the launch gets ready (by a
        # new server when the current one was made unsafe, or a file it imported changed)
        self.servers.begin(
            header.get("preload", ()), header.get("mirror", ()), header.get("sys_path", ())
        )
        session = Session(lid, os.path.join(self.private, f"launch-{len(self.sessions)}-{lid}"))
        self.sessions[lid] = session
        self.tell(lid)
        self.send(
            Kind.READY,
            {
                "lid": lid,
                "port": free_port(""),  # the world's MASTER_PORT, on every interface
                "cwd": cwd,
                "entrance": session.entrance_path,
                "private": session.private,
                "notes": notes,
            },
        )

    def end(self, lid: str) -> None:
        session = self.sessions.pop(lid, None)
        if session is None:
            return
        for sid in [sid for sid, (owner, _) in self.relays.items() if owner == lid]:
            self.relays.pop(sid)[1].close()
        self.sent_bytes.pop(lid, None)
        self.acked.pop(lid, None)
        self.dying.extend(session.close())

    def spawn(self, session: Session, rank: int, spec_bytes: bytes) -> None:
        lid = session.lid
        try:
            pid = self.servers.spawn(spec_bytes, self._keep_alive)
        except RuntimeError as exc:
            session.reported.add(rank)
            self.tell(lid)
            self.send(
                Kind.EXITED,
                {"lid": lid, "rank": rank, "code": 1, "at": time.time(), "detail": str(exc)},
            )
            return
        finally:
            self.last_heard = time.monotonic()  # busy here, not deaf: the kernel's pings wait
        self.tell(lid)
        session.ranks[rank] = WorkerProcess(pid, "agent", server=self.servers.server)
        self.send(Kind.STARTED, {"lid": lid, "rank": rank, "pid": pid})

    def tell(self, lid: str) -> None:
        """Send the host server's news (a module kept out, a file changed) to launch ``lid``:
        the notebook shows each line once, naming this host."""
        for text in self.servers.take_notices():
            self.send(Kind.LOG, {"lid": lid, "text": text})

    def _keep_alive(self, timeout: float) -> None:
        """Wait at most ``timeout`` s for the fork server (importing the kernel's modules, or a
        new server importing torch), pinging the kernel meanwhile: a host busy starting its
        ranks must not pass for a lost one."""
        if time.monotonic() - self.last_sent > HEARTBEAT / 2:
            self.send(Kind.PING)
        ready, _, _ = select.select([self.wake_r], [], [], timeout)
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)

    def store(self, session: Session, name: str, data: bytes) -> None:
        """Write the work's shared tensors into this host's shared memory, once per host."""
        path = os.path.join(shm_dir(), os.path.basename(name))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # ours until unlinked: another launch's sweep skips it
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            raise
        session.files[path] = fd

    def report_exits(self) -> None:
        self.dying = [p for p in self.dying if p.poll() is None]  # reaped: forgotten
        for session in self.sessions.values():
            for rank, process in session.ranks.items():
                if rank in session.reported:
                    continue
                code = process.poll()
                if code is None:
                    continue
                session.reported.add(rank)
                detail = process.lost
                with (
                    contextlib.suppress(OSError),
                    open(os.path.join(session.private, f"rank-{rank}.error")) as handle,
                ):
                    detail = detail or handle.read(2000).strip()
                self.send(
                    Kind.EXITED,
                    {
                        "lid": session.lid,
                        "rank": rank,
                        "code": code,
                        "at": process.ended_at or time.time(),
                        "detail": detail,
                    },
                )

    def close(self) -> None:
        for session in self.sessions.values():
            for process in session.ranks.values():
                process.signal_tree(signal.SIGKILL)
        self.servers.close()
        for lid in list(self.sessions):
            self.end(lid)
        for _, relay in self.relays.values():
            relay.close()
        shutil.rmtree(self.private, ignore_errors=True)
        self.link.close(0)
        self.context.term()


def _read_config() -> tuple[dict[str, Any], bool]:
    """The configuration and whether stdin stays the kernel's lifeline (ssh) or not (srun)."""
    encoded = os.environ.pop(CONFIG_VAR, "")
    if encoded:  # srun: one step (and one agent) per node, its configuration in the environment
        return json.loads(base64.b64decode(encoded)), False
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
