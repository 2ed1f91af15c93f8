"""What a rank is told when it starts: a typed worker spec.

The driver builds one :class:`WorkerSpec` per rank; a launcher variant delivers it (pickled
through the fork server or a pipe, or inherited by ``fork``) and the rank's
:func:`nbaccel.launch.rank.worker.run_worker` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:  # the kernel imports this module before torch (fork server warm-up)
    from nbaccel.launch.wire.channel import Address
    from nbaccel.launch.wire.transport import Packed

__all__ = ["Inline", "Mode", "WorkerSpec", "load_work"]


class Mode(str, Enum):
    """``CALL``: run the spec's work once, then exit. ``SERVE``: run calls until told to stop."""

    CALL = "call"
    SERVE = "serve"


@dataclass
class Inline:
    """Work handed over in memory, for launchers whose children inherit the driver's memory
    (``fork``): a model passed in ``args`` is shared copy-on-write instead of pickled."""

    function: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


Work = Union["Packed", Inline]


def load_work(work: Work) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """``(function, args, kwargs)`` from packed or inherited work."""
    if isinstance(work, Inline):
        return work.function, tuple(work.args), dict(work.kwargs)
    from nbaccel.launch.wire.transport import unpack  # torch: only where work is unpacked

    return unpack(work)


@dataclass
class WorkerSpec:
    """Everything one rank needs to connect back and do its work.

    Args:
        rank: the rank shown to the user (global rank).
        index: the rank's index among the ranks of this driver (local rank).
        env: the rank's full environment (replaces the inherited one).
        sys_path: the driver's ``sys.path``.
        cwd: the driver's working directory.
        address: where the driver's listener accepts this rank's connections.
        secret: the launch secret for the HMAC handshake (never in env or argv).
        launch_id: tells this launch's connections from a stale one's.
        mode: run once or serve calls.
        work: for ``Mode.CALL``, the function and arguments.
        threads: torch intra-op threads for this rank.
        setup: importable callables run in the rank before the work (worker hooks).
        error_path: where the rank writes why it could not connect back (the driver reads it
            to say why the rank ended).
        argv: the driver's ``sys.argv``: code reading it (``argparse``'s ``parse_args()``)
            sees what it would see called in the notebook, not the rank's start-up command.
        notebook_state: the driver's generators, torch settings and warning filters
            (``notebook_state.capture``), applied as the rank starts.
    """

    rank: int
    index: int
    env: dict[str, str]
    sys_path: list[str]
    cwd: str
    address: Address
    secret: bytes
    launch_id: str
    mode: Mode = Mode.CALL
    work: Work | None = None
    threads: int = 1
    setup: tuple[Callable[[], None], ...] = ()
    error_path: str | None = None
    argv: list[str] = field(default_factory=list)
    notebook_state: dict[str, Any] = field(default_factory=dict)
