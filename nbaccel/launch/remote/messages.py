"""The messages between the kernel's hub and a host's agent, over one ZeroMQ CURVE connection.

An agent lives as long as the kernel and serves one launch after another (several at once: a
pool and a ``notebook_launcher`` call): every message about a launch carries its id ``lid``;
a launch begins with ``BEGIN``/``READY`` and ends with ``END``. Tunnelled connections are numbered
per agent (``sid``), so ``DATA``/``CLOSE`` need no launch id.

Every message is a list of frames ``[kind, header, payload?]``: ``kind`` one of :class:`Kind`,
``header`` a small JSON object, ``payload`` raw bytes. Nothing on this connection is unpickled
by the kernel: rank traffic is tunnelled as bytes to the group's own listener, where the launch's
HMAC handshake authenticates it end to end. The agent receives pickled worker specs from the
kernel only, which CURVE authenticates (only the kernel holds the server's secret key).

CURVE keys are made per agent (:func:`new_keys`); the secret ones travel over ssh's stdin or
the SLURM job's environment, never on a command line.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import zmq

__all__ = [
    "CONFIG_VAR",
    "HEARTBEAT",
    "LOST_AFTER",
    "RECEIVE_SLICE",
    "WINDOW",
    "Kind",
    "decode",
    "encode",
    "new_keys",
]

#: where srun's agents find their configuration (the job's environment, not the command line)
CONFIG_VAR = "NBACCEL_AGENT_CONFIG"

#: seconds between pings on an idle connection, both ways
HEARTBEAT = 0.5
#: seconds of silence after which the other side counts as lost
LOST_AFTER = 5.0
#: seconds a loop reads the link at most before its other duties (pings, writes, other
#: sockets): a rank printing without pause, or a large push, must not silence the pings
RECEIVE_SLICE = 0.05
#: bytes of a launch's connections an agent sends ahead of the kernel's ACKs (each launch its
#: own window). Past it the agent stops reading that launch's ranks' sockets, so a rank printing
#: without pause blocks in ``print`` as it does on the kernel's own host, instead of queueing
#: gigabytes in the hub; and what it sends after (its result, the stop button's answer) is never
#: more than this behind.
WINDOW = 1 << 20


class Kind(bytes, Enum):
    """What a message is (its first frame)."""

    # agent -> kernel
    HELLO = b"hello"  # the agent is up (once): its host's address, environment, paths, pid,
    # machine (boot id), features (the later kinds it understands, such as "mirror")
    READY = b"ready"  # {lid, port, cwd, entrance, private, notes} or {lid, error}
    STARTED = b"started"  # {lid, rank, pid}
    EXITED = b"exited"  # {lid, rank, code, at, detail}
    LOG = b"log"  # {lid, text}: something the agent wants the notebook to see (a notice)
    # kernel -> agent
    BEGIN = b"begin"  # {lid, cwd, cwd_required, preload, mirror, sys_path}: a launch starts
    # using this host; its server imports preload and mirror (the kernel's modules)
    WORK = b"work"  # {lid, name} + the shared tensors' bytes: written once into the host's
    # /dev/shm, always before the message (a spawn, a call on a tunnelled stream) that uses it
    SPAWN = b"spawn"  # {lid, rank} + the pickled WorkerSpec, handed to the fork server as is
    SIGNAL = b"signal"  # {lid, rank, signal}
    UNLINK = b"unlink"  # {lid, names}: every rank mapped those shared tensors; remove the files
    END = b"end"  # {lid}: the launch is over: kill what is left of its ranks, free its files
    QUIT = b"quit"  # the kernel is ending: stop every rank and exit
    MIRROR = b"mirror"  # {modules, sys_path}: what the kernel imported since, for the host's
    # server to import between launches (the kernel's hook after a cell)
    # both ways
    OPEN = b"open"  # {lid, sid}: a rank opened a connection to its launch's channel
    DATA = b"data"  # {sid} (+ {lid} from an agent: whose window) + bytes of that connection
    CLOSE = b"close"  # {sid}: that connection closed
    PING = b"ping"
    # kernel -> agent
    ACK = b"ack"  # {lid, bytes}: that launch's bytes from the agent written (or dropped) here
    # hub -> launcher, in this kernel only (never on the wire): the host's agent is gone
    LOST = b"lost"  # {why}


def encode(kind: Kind, header: dict[str, Any] | None = None, payload: bytes | None = None):
    """The frames of one message."""
    frames = [kind.value, json.dumps(header or {}).encode()]
    if payload is not None:
        frames.append(payload)
    return frames


def decode(frames: list) -> tuple[Kind, dict[str, Any], bytes]:
    """``(kind, header, payload)`` of one message; ValueError on anything malformed."""
    if len(frames) not in (2, 3):
        raise ValueError(f"a message of {len(frames)} frames")
    kind = Kind(bytes(frames[0]))
    header = json.loads(bytes(frames[1]))
    if not isinstance(header, dict):
        raise ValueError("a header that is not an object")
    payload = bytes(frames[2]) if len(frames) == 3 else b""
    return kind, header, payload


def new_keys() -> tuple[str, str]:
    """A fresh CURVE key pair ``(public, secret)``, Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()
