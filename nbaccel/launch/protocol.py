"""The one vocabulary of a launch: what travels between the driver and its ranks.

Every message, stream name, event kind and outcome kind is a member here; the engine and the
fronts compare against these members, never against string literals. The members are ``str``
enums, so they pickle by name, print as their value and compare equal to it.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["EventKind", "Message", "OutcomeKind", "Stream"]


class Message(str, Enum):
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


class Stream(str, Enum):
    """The three authenticated connections a rank opens to the driver."""

    STDOUT = "stdout"
    STDERR = "stderr"
    EVENTS = "events"


class EventKind(str, Enum):
    """Structured events a rank emits (``nbaccel.launch.worker.emit``) for the renderer."""

    PROGRESS = "progress"  # a tqdm bar's state (notebook progress bridge)
    MEMORY = "memory"  # a memory sample (notebook memory sampler)
    METRICS = "metrics"  # scalars from a notebook tracker
    DISPLAY = "display"  # a display bundle (pool cells: display(), figures)
    POOL_INFO = "pool_info"  # a pool worker's device and backend, once at start


class OutcomeKind(str, Enum):
    """How one rank's call ended."""

    RESULT = "result"  # returned a value
    ERROR = "error"  # raised; the value is describe_exception's dict
    CRASH = "crash"  # the process ended without reporting; the value is its exit code
