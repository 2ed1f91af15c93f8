"""The messages between the kernel's hub and a host's agent, over one ZeroMQ CURVE connection.

Every message is a list of frames ``[kind, header, payload?]``: ``kind`` one of :class:`Kind`,
``header`` a small JSON object, ``payload`` raw bytes. Nothing on this connection is unpickled
by the kernel: rank traffic is tunnelled as bytes to the group's own listener, where the launch's
HMAC handshake authenticates it end to end. The agent receives pickled worker specs from the
kernel only, which CURVE authenticates (only the kernel holds the server's secret key).

CURVE keys are made per launch (:func:`new_keys`); the secret ones travel over ssh's stdin or
the SLURM job's environment, never on a command line.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import zmq

__all__ = ["CONFIG_VAR", "HEARTBEAT", "LOST_AFTER", "Kind", "decode", "encode", "new_keys"]

#: where srun's agents find their configuration (the job's environment, not the command line)
CONFIG_VAR = "NBACCEL_AGENT_CONFIG"

#: seconds between pings on an idle connection, both ways
HEARTBEAT = 0.5
#: seconds of silence after which the other side counts as lost
LOST_AFTER = 5.0


class Kind(bytes, Enum):
    """What a message is (its first frame)."""

    # agent -> kernel
    HELLO = b"hello"  # the host is ready: its address, a free port, environment, paths
    STARTED = b"started"  # {rank, pid}
    EXITED = b"exited"  # {rank, code, at, detail}
    LOG = b"log"  # {text}: something the agent wants the notebook to see (a notice)
    # kernel -> agent
    WORK = b"work"  # {name} + the shared tensors' bytes: written once into the host's /dev/shm,
    # always before the message (a spawn, a call on a tunnelled stream) that refers to it
    SPAWN = b"spawn"  # {rank} + the pickled WorkerSpec, handed to the fork server as is
    SIGNAL = b"signal"  # {rank, signal}
    UNLINK = b"unlink"  # {names}: every rank mapped those shared tensors; remove the files
    QUIT = b"quit"  # stop every rank and exit
    # both ways
    OPEN = b"open"  # {sid}: a rank opened a connection to the notebook's channel
    DATA = b"data"  # {sid} + bytes of that connection
    CLOSE = b"close"  # {sid}: that connection closed
    PING = b"ping"
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
