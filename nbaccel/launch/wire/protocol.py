"""The one vocabulary of a launch: what travels between the driver and its ranks.

Every message, stream name, event kind, outcome kind, launcher kind and fork-server message is a
member here; the engine and the fronts compare against these members, never against string
literals (the remote agents' wire messages are ``nbaccel.launch.remote.messages.Kind``). The
members are ``str`` enums: they print as their value and compare equal to it (same hash), so a
message's tag travels as its plain value (``pickling.dumps_message``) and is compared with the
members on arrival; a member elsewhere in a message pickles by name.
"""

from __future__ import annotations

import signal
from enum import Enum

from nbaccel.launch.wire.pickling import plain_class

__all__ = [
    "EventKind",
    "LaunchKind",
    "Message",
    "OutcomeKind",
    "STACKS_SIGNAL",
    "ServerMessage",
    "Stream",
    "Word",
]


class Word(str, Enum):
    """A member of this vocabulary: prints (and formats) as its value, on every Python."""

    __str__ = str.__str__
    __format__ = str.__format__

    def __reduce_ex__(self, protocol: int) -> str:
        # A global reference (``Message.RESULT``): pickle and unpickle resolve it in C, where
        # the default ``Message("result")`` runs the enum machinery in Python on every message.
        return f"{type(self).__qualname__}.{self._name_}"

    def __init_subclass__(cls, **options: object) -> None:
        super().__init_subclass__(**options)
        plain_class(cls)  # channel messages holding only words and builtins skip cloudpickle


#: The signal that makes a rank print the Python stack of each of its threads to its stderr
#: (``faulthandler``): sent to the ranks a call timed out on, just before they are stopped or
#: interrupted, so the notebook shows where each one hung. A real-time signal, as user code and
#: schedulers use SIGUSR1/SIGUSR2 (SLURM's ``--signal``, Lightning's requeue); None where the
#: platform has none.
STACKS_SIGNAL: int | None = (
    int(signal.SIGRTMIN) + 6 if hasattr(signal, "SIGRTMIN") else None  # type: ignore[attr-defined]
)


class Message(Word):
    """First element of every tuple on a rank's event stream."""

    HELLO = "hello"  # worker -> driver: (HELLO, pid)
    READY = "ready"  # worker -> driver: set up, waiting for (or running) its work
    RESULT = "result"  # worker -> driver: (RESULT, call_id, pickled value)
    ERROR = "error"  # worker -> driver: (ERROR, call_id, describe_exception(...))
    EVENT = "event"  # worker -> driver: (EVENT, EventKind, payload)
    CALL = "call"  # driver -> worker: (CALL, call_id, packed work)
    STOP = "stop"  # driver -> worker: leave the serve loop and exit
    # driver -> worker (one-shot launches): every rank has reported, exit now. A rank that has
    # returned keeps its process (and its process group) until then, so a peer still joining the
    # group (gloo's full-mesh connect) never sees it vanish.
    RELEASE = "release"


class Stream(Word):
    """The three streams of a rank to the driver: three authenticated connections over TCP;
    on a Unix socket one (events), which carries the driver's ends of the other two."""

    STDOUT = "stdout"
    STDERR = "stderr"
    EVENTS = "events"


class EventKind(Word):
    """Structured events a rank emits (``nbaccel.launch.rank.worker.emit``) for the renderer."""

    PROGRESS = "progress"  # a tqdm bar's state (notebook progress bridge)
    MEMORY = "memory"  # a memory sample (notebook memory sampler)
    METRICS = "metrics"  # scalars from a notebook tracker
    DISPLAY = "display"  # a display bundle (pool cells: display(), figures)
    POOL_INFO = "pool_info"  # a pool worker's device and backend, once at start


class OutcomeKind(Word):
    """How one rank's call ended."""

    RESULT = "result"  # returned a value
    ERROR = "error"  # raised; the value is describe_exception's dict
    CRASH = "crash"  # the process ended without reporting; the value is its exit code


class LaunchKind(Word):
    """The launcher variant that starts a plan's ranks (``nbaccel.launch.launchers``)."""

    FORKSERVER = "forkserver"  # forked from a server with torch preloaded (the default)
    SPAWN = "spawn"  # fresh interpreters
    FORK = "fork"  # forked from the driver (inherits its memory)
    XLA = "xla"  # torch-xla's processes
    SSH = "ssh"  # on other hosts, one agent per host started over ssh
    SLURM = "slurm"  # on the nodes of this SLURM allocation, agents started by srun
    RAY = "ray"  # on the nodes of a Ray cluster, one agent per node started by a Ray actor


class ServerMessage(Word):
    """First element of every frame between the driver and a fork server (and its agents')."""

    PRELOAD = "preload"  # driver -> server: (PRELOAD, modules) import these now
    SPAWN = "spawn"  # driver -> server: (SPAWN, request_id, spec_bytes)
    READY = "ready"  # server -> driver: (READY,) the preloaded modules are imported
    STARTED = "started"  # server -> driver: (STARTED, request_id, pid)
    FAILED = "failed"  # server -> driver: (FAILED, request_id, why) the fork was refused
    EXITED = "exited"  # server -> driver: (EXITED, pid, returncode)
    REFUSED = "refused"  # server -> driver: (REFUSED, request_id, reason) no fork (unsafe)
    PRELOADED = "preloaded"  # server -> driver: (PRELOADED, new top-levels, seconds, count[,
    # stamps]): stamps, {module: (file, mtime_ns)}, when the PRELOAD asked for them
    UNSAFE = "unsafe"  # server -> driver: (UNSAFE, module, why) that import made forking unsafe
