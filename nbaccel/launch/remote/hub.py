"""The kernel's end of the hosts' connections: one ZeroMQ CURVE server, one thread.

The hub binds one address the hosts reach (never every interface), admits only clients holding
a key it made for one of its agents (:meth:`Hub.admit`; a ZAP check in libzmq's handshake, before
any message), and encrypts everything with CURVE. For each connection a rank opens on its host,
the agent sends ``OPEN`` with the rank's launch id and the hub connects a socket to that launch's
worker group listener (a private Unix socket on this machine, :meth:`Hub.route`); bytes then flow
both ways untouched, so the group authenticates remote ranks with the launch's HMAC handshake and
treats them as ordinary connections.

Everything else (hello, ready, started, exited, log, an agent lost) goes to one callback, called
on the hub's thread with the agent's id.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from nbaccel.launch.remote.messages import (
    HEARTBEAT,
    LOST_AFTER,
    RECEIVE_SLICE,
    WINDOW,
    Kind,
    decode,
    encode,
    new_keys,
)
from nbaccel.launch.remote.relay import Ordered, Relay
from nbaccel.launch.wire.channel import Address

__all__ = ["Hub"]

#: ``callback(agent id, kind, header)``; kind is a wire.Kind (``Kind.LOST`` with {"why": ...}
#: when the hub gives up on an agent)
EventCallback = Callable[[int, Any, dict[str, Any]], None]


class _Keys(ThreadAuthenticator):
    """ZAP: admit the hub's agent keys only; the ZAP user id of a connection is its agent id."""

    def __init__(self, context: zmq.Context, allowed: dict[str, int]) -> None:
        super().__init__(context)
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:  # credentials provider
        return key.decode() in self.allowed

    def curve_user_id(self, client_public_key: bytes) -> str:
        return str(self.allowed.get(z85.encode(client_public_key).decode(), -1))


class Hub:
    """Bind ``address`` (``0`` port: any free one) and serve the agents it admits."""

    def __init__(self, address: str, callback: EventCallback) -> None:
        self.server_public, server_secret = new_keys()
        self.callback = callback
        self._allowed: dict[str, int] = {}  # agent public key -> agent id (while not lost)
        self._ids = itertools.count()
        self._channels: dict[str, Address] = {}  # launch id -> its worker group's listener
        self.context = zmq.Context()
        self.auth = _Keys(self.context, self._allowed)
        self.auth.start()
        self.auth.configure_curve_callback("nbaccel", credentials_provider=self.auth)
        self.router = self.context.socket(zmq.ROUTER)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.SNDHWM, 0),
            (zmq.RCVHWM, 0),
            (zmq.ROUTER_MANDATORY, 1),
        ):
            self.router.setsockopt(option, value)
        self.router.curve_server = True
        self.router.curve_publickey = self.server_public.encode()
        self.router.curve_secretkey = server_secret.encode()
        self.router.zap_domain = b"nbaccel"
        try:
            self.router.bind(f"tcp://{address}:0")
        except zmq.ZMQError as exc:
            self.close()
            raise RuntimeError(
                f"could not listen for the hosts' agents on {address}: {exc}; pass the address "
                "of this machine that the hosts reach as channel_address=..."
            ) from None
        endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.endpoint = endpoint.replace("0.0.0.0", address)
        self.address, self.port = address, int(endpoint.rsplit(":", 1)[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._outbox: deque[tuple[int, list]] = deque()
        self._to_lose: deque[tuple[int, str]] = deque()
        self._identity: dict[int, bytes] = {}
        self._heard: dict[int, float] = {}
        self._sent: dict[int, float] = {}
        self._lost: set[int] = set()
        self._relays: dict[tuple[int, int], Relay] = {}
        # (agent, launch id) -> the queue of that launch's connections' bytes on that host,
        # the bytes received, and (bytes, time) of the last ACK: what is written to the
        # launch's sockets (or dropped) is acknowledged, moving the agent's window for it
        self._inbound: dict[tuple[int, str], Ordered] = {}
        self._received: dict[tuple[int, str], int] = {}
        self._acked: dict[tuple[int, str], tuple[int, float]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nbaccel-hub")
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def admit(self) -> tuple[int, str, str]:
        """Keys for one more agent: ``(agent id, public, secret)``; ids are never reused."""
        public, secret = new_keys()
        agent = next(self._ids)
        self._allowed[public] = agent
        return agent, public, secret

    def route(self, lid: str, channel: Address | None) -> None:
        """Tunnel the connections of launch ``lid``'s ranks to ``channel`` (None: forget it)."""
        if channel is None:
            self._channels.pop(lid, None)
        else:
            self._channels[lid] = channel

    def send(
        self, agent: int, kind: Kind, header: dict | None = None, payload: bytes | None = None
    ):
        """Queue a message for agent ``agent`` (sent by the hub's thread)."""
        self._outbox.append((agent, encode(kind, header, payload)))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def lose(self, agent: int, why: str) -> None:
        """Count agent ``agent`` as lost (its process ended): done on the hub's thread."""
        self._to_lose.append((agent, why))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def connected(self, agent: int) -> bool:
        return agent in self._identity

    def close(self) -> None:
        """Stop the thread and free the sockets (agents still connected see the link drop)."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        for relay in getattr(self, "_relays", {}).values():
            relay.close()
        with contextlib.suppress(Exception):
            self.router.close(0)
        self.auth.stop()
        self.context.term()
        for sock in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if sock is not None:
                sock.close()

    # ------------------------------------------------------------------ the hub's thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop:
            watched = []
            for relay in self._relays.values():
                flags = (0 if relay.ending else zmq.POLLIN) | (
                    zmq.POLLOUT if relay.wants_write else 0
                )
                if flags:
                    poller.register(relay, flags)
                    watched.append(relay)
            events = dict(poller.poll(int(HEARTBEAT * 1000 / 2)))
            for relay in watched:
                poller.unregister(relay)
            if self._wake_r.fileno() in events:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
            while self._to_lose:
                self._lose(*self._to_lose.popleft())
            self._flush_outbox()
            if self.router in events:
                until = time.monotonic() + RECEIVE_SLICE
                while self.router.poll(0) and time.monotonic() < until:
                    self._receive(self.router.recv_multipart(copy=False))
            for (agent, sid), relay in list(self._relays.items()):
                flags = events.get(relay.fileno(), 0)  # plain fds come back as numbers
                if flags & zmq.POLLOUT:
                    relay.flush()
                if flags & zmq.POLLIN and not relay.closed and not relay.ending:
                    # what was queued before these bytes were written goes first (the shared
                    # tensors of a call before the call itself)
                    self._flush_outbox()
                    data = relay.read()
                    if data:
                        self._send_now(agent, encode(Kind.DATA, {"sid": sid}, data))
                    elif data is not None:
                        relay.close()
                        self._send_now(agent, encode(Kind.CLOSE, {"sid": sid}))
                if relay.closed:
                    del self._relays[(agent, sid)]
            self._acknowledge()
            self._heartbeat()

    def _flush_outbox(self) -> None:
        while self._outbox:
            agent, frames = self._outbox.popleft()
            self._send_now(agent, frames)

    def _send_now(self, agent: int, frames: list) -> None:
        identity = self._identity.get(agent)
        if identity is None or agent in self._lost:
            return
        try:
            self.router.send_multipart([identity, *frames])
            self._sent[agent] = time.monotonic()
        except zmq.ZMQError:  # the agent is gone (ROUTER_MANDATORY): the heartbeat names it
            pass

    def _receive(self, frames: list) -> None:
        identity, *rest = frames
        try:
            agent = int(rest[0].get("User-Id"))
            kind, header, payload = decode([f.bytes for f in rest])
        except (ValueError, zmq.ZMQError, IndexError, KeyError):
            return  # only admitted agents reach here; a malformed message is dropped
        if agent < 0 or agent in self._lost:
            return
        self._identity[agent] = identity.bytes
        self._heard[agent] = time.monotonic()
        if kind == Kind.OPEN:
            self._open(agent, int(header["sid"]), str(header.get("lid")))
        elif kind == Kind.DATA:
            key = (agent, str(header.get("lid")))
            self._received[key] = self._received.get(key, 0) + len(payload)
            relay = self._relays.get((agent, int(header["sid"])))
            if relay is not None:
                relay.feed(payload)
        elif kind == Kind.CLOSE:
            relay = self._relays.get((agent, int(header["sid"])))
            if relay is not None:
                relay.finish()
        elif kind != Kind.PING:
            self.callback(agent, kind, header)

    def _open(self, agent: int, sid: int, lid: str) -> None:
        """A rank of agent ``agent`` connects to its group's listener: connect on its behalf."""
        address = self._channels.get(lid)
        family = (
            socket.AF_UNIX if address is not None and address.family == "unix" else socket.AF_INET
        )
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if address is None:
                raise OSError("no launch is listening")
            sock.settimeout(5.0)
            sock.connect(address.location)
        except OSError:
            sock.close()
            self._send_now(agent, encode(Kind.CLOSE, {"sid": sid}))
            return
        # one queue for all of a launch's connections on a host: a rank's output reaches the
        # group before the result it sent after it (the agent forwards them in that order)
        order = self._inbound.setdefault((agent, lid), Ordered())
        self._relays[(agent, sid)] = Relay(sock, order)

    def _acknowledge(self) -> None:
        """Tell each agent how many of its bytes are written here: every quarter window, and
        the rest within a heartbeat (the agent stops reading its ranks a window ahead)."""
        now = time.monotonic()
        for key, received in list(self._received.items()):
            agent, lid = key
            order = self._inbound.get(key)
            done = received - (order.size if order is not None else 0)
            acked, at = self._acked.get(key, (0, 0.0))
            if done - acked >= WINDOW // 4 or (done > acked and now - at > HEARTBEAT):
                self._acked[key] = (done, now)
                self._send_now(agent, encode(Kind.ACK, {"lid": lid, "bytes": done}))
            elif lid not in self._channels and done == acked:  # the launch is over
                for table in (self._received, self._acked, self._inbound):
                    table.pop(key, None)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for agent in list(self._identity):
            if agent in self._lost:
                continue
            if now - self._heard.get(agent, now) > LOST_AFTER:
                self._lose(
                    agent,
                    f"no word from its agent for {LOST_AFTER:.0f} s (host down or network lost)",
                )
                continue
            if now - self._sent.get(agent, 0.0) > HEARTBEAT:
                self._send_now(agent, encode(Kind.PING))

    def _lose(self, agent: int, why: str) -> None:
        """Count ``agent`` as lost (once): drop its connections, tell the callback."""
        if agent in self._lost:
            return
        self._lost.add(agent)
        for key in [k for k, v in list(self._allowed.items()) if v == agent]:
            del self._allowed[key]  # a lost agent that comes back is refused in the handshake
        for key in [k for k in self._relays if k[0] == agent]:
            self._relays.pop(key).close()
        for table in (self._inbound, self._received, self._acked):
            for key in [k for k in table if k[0] == agent]:
                del table[key]
        self.callback(agent, Kind.LOST, {"why": why})
