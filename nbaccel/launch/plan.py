"""What a launch is: how many ranks, where, how they start, and each rank's environment.

Every front builds one :class:`LaunchPlan` with :meth:`LaunchPlan.create`, which is the single
place for the defaults (see :data:`CPU_DEFAULT_NUM_PROCESSES`), the validation of the options
(before anything starts) and the announcement line. The plan then gives each rank its
environment: the torchrun-style variables that ``PartialState`` reads (RANK, WORLD_SIZE, ...)
and nbaccel's own (NBACCEL_LAUNCHER, NBACCEL_MIXED_PRECISION, NBACCEL_CPU).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from nbaccel.distributed.state import MIXED_PRECISION_CHOICES
from nbaccel.launch.capacity import check_capacity

if TYPE_CHECKING:
    from nbaccel.launch.remote.options import RemoteOptions

__all__ = [
    "CPU_DEFAULT_NUM_PROCESSES",
    "START_METHODS",
    "XLA_DEFAULT_NUM_PROCESSES",
    "Front",
    "LaunchPlan",
    "check_call",
    "check_cwd",
    "check_port",
    "parse_port",
    "default_num_processes",
    "free_port",
    "resolve_kind",
]

START_METHODS = ("auto", "forkserver", "spawn", "fork")


class Front(str, Enum):
    """Who launches; also each rank's ``NBACCEL_LAUNCHER``."""

    NOTEBOOK = "notebook"  # notebook_launcher / debug_launcher
    POOL = "pool"  # the %%distributed pool
    TESTING = "testing"  # nbaccel.testing.run_on_ranks


# The defaults of ``num_processes``, in one place. When the caller does not say how many ranks:
# with GPUs (and not ``cpu``), one rank per GPU; on CPU, the number below (the launcher runs the
# function once, as Accelerate's does; the pool and the test harness want a real world of 2).
CPU_DEFAULT_NUM_PROCESSES = {Front.NOTEBOOK: 1, Front.POOL: 2, Front.TESTING: 2}
# On XLA devices, Accelerate's TPU default; torch-xla itself always uses every device it sees
# (a different count is run anyway, with a warning naming both).
XLA_DEFAULT_NUM_PROCESSES = 8


def default_num_processes(front: Front, cpu: bool = False, xla: bool = False) -> int:
    """How many ranks ``front`` starts when ``num_processes`` is not given."""
    if xla:
        return XLA_DEFAULT_NUM_PROCESSES
    gpus = 0 if cpu else torch.cuda.device_count()
    return gpus or CPU_DEFAULT_NUM_PROCESSES[Front(front)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port: int, host: str) -> None:
    """ValueError naming the fix when ``port`` is already taken on this machine."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host in ("127.0.0.1", "localhost") else "", port))
        except OSError:
            raise ValueError(
                f"use_port={port} is already in use on this machine (perhaps by an earlier "
                "launch that is still running); pass use_port=None to let nbaccel pick a free "
                "port, or choose another one."
            ) from None


def parse_port(use_port: int | str) -> int:
    """``use_port`` as a TCP port number (Accelerate passes it as a string, ``"29500"``)."""
    text = str(use_port).strip()
    if isinstance(use_port, bool) or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(
            f"use_port must be a TCP port number between 1 and 65535 (an int or a string of "
            f"digits such as '29500'), got {use_port!r}; pass use_port=None to let nbaccel pick "
            "a free port."
        )
    return int(text)


def check_call(
    args: Any, kwargs: Any = None, timeout: Any = None, max_restarts: Any = 0
) -> tuple[Any, ...]:
    """Validate what a launch runs and how long, before anything starts; ``args`` as a tuple.

    ``args`` must be a tuple or list of positional arguments: a lone tensor or int would be
    unpacked (or fail) on the ranks, far from the mistake.
    """
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be a tuple (or list) of the function's positional arguments, got "
            f"{type(args).__name__}; to pass a single value write args=(value,)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}.")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise ValueError(
            f"timeout must be a positive number of seconds (or None for no limit), got {timeout!r}."
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(
            f"max_restarts must be a non-negative integer (0: no restart), got {max_restarts!r}."
        )
    return tuple(args)


def check_cwd() -> str:
    """The working directory the ranks start in; a clear error when it was deleted."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        try:
            where = os.readlink("/proc/self/cwd").removesuffix(" (deleted)")
        except OSError:
            where = "(unknown)"
        raise FileNotFoundError(
            f"this kernel's working directory {where} was deleted, and the ranks start in it. "
            "Change to an existing directory first, e.g. os.chdir(os.path.expanduser('~')), "
            "or recreate it."
        ) from None


def _refuse_nested_launch() -> None:
    from nbaccel.launch.worker import current_rank, on_worker

    if on_worker():
        raise RuntimeError(
            f"a launch was started on rank {current_rank()}, inside a running launch: ranks "
            "cannot start a second world of their own. Call the function directly on each rank "
            "(it already runs on every rank), or launch from the notebook itself."
        )


def resolve_kind(start_method: str, xla: bool = False) -> str:
    """The launcher variant (a key of ``nbaccel.launch.launchers.LAUNCHERS``) for a launch.

    ``auto``: the fork server (spawn where fork does not exist); for XLA, ``auto`` and ``fork``
    are the ``xla`` launcher (forked torch-xla processes that inherit the work). ``fork`` is
    refused once this process has initialised CUDA.
    """
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}.")
    if xla and start_method in ("auto", "fork"):
        return "xla"
    if start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised in this kernel, and a forked child cannot use it. "
            "Use start_method='auto' (nbaccel's fork server is CUDA-safe)."
        )
    if start_method == "auto":
        return "forkserver" if hasattr(os, "fork") else "spawn"
    return start_method


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks of this node and the world they belong to. Build it with :meth:`create`."""

    num_processes: int
    front: Front = Front.NOTEBOOK
    kind: str = "forkserver"
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    port: int | None = None  # None: a free port per attempt
    mixed_precision: str = "no"
    cpu: bool = False
    backend: str | None = None
    xla: bool = False  # ranks are torch-xla processes (one per chip, threads per device)
    defaulted: bool = False  # num_processes was not given
    extra_env: Mapping[str, str] = field(default_factory=dict)
    #: ranks on other hosts (ssh or slurm): the hosts, and how the agents start
    remote: RemoteOptions | None = None

    @classmethod
    def create(
        cls,
        front: Front,
        num_processes: int | None = None,
        *,
        start_method: str = "auto",
        xla: bool = False,
        cpu: bool | None = False,
        backend: str | None = None,
        mixed_precision: str = "no",
        num_nodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        use_port: int | str | None = None,
        rdzv_backend: str = "static",
        rdzv_endpoint: str = "",
        rdzv_conf: dict[str, Any] | None = None,
        rdzv_id: str = "none",
        extra_env: Mapping[str, str] | None = None,
        remote: RemoteOptions | None = None,
    ) -> LaunchPlan:
        """Resolve the defaults and validate every option; raises before anything starts.

        ``cpu=None`` means CPU ranks when there is no GPU (the pool's default). ``remote``
        (``nbaccel.launch.remote.options.remote_options``) puts the ranks on other hosts.
        """
        _refuse_nested_launch()
        if remote is not None:
            return cls._create_remote(
                front,
                num_processes,
                remote,
                cpu,
                backend,
                mixed_precision,
                num_nodes,
                use_port,
                xla,
                extra_env,
            )
        gpus = torch.cuda.device_count()
        cpu = gpus == 0 if cpu is None else bool(cpu)
        defaulted = num_processes is None
        if num_processes is None:
            num_processes = default_num_processes(front, cpu, xla)
        if not isinstance(num_processes, int) or isinstance(num_processes, bool):
            raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}.")
        if num_processes < 1:
            raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}.")
        if str(mixed_precision).lower() not in MIXED_PRECISION_CHOICES:
            raise ValueError(
                f"Unknown mixed_precision {mixed_precision!r}; choose one of "
                f"{', '.join(MIXED_PRECISION_CHOICES)}."
            )
        for name, value in (("num_nodes", num_nodes), ("node_rank", node_rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        if num_nodes < 1 or not 0 <= node_rank < num_nodes:
            raise ValueError(f"node_rank must be in [0, num_nodes={num_nodes}), got {node_rank}.")
        if rdzv_backend not in ("static", "c10d"):
            raise ValueError(f"rdzv_backend must be 'static' or 'c10d', got {rdzv_backend!r}.")
        if rdzv_conf:
            raise ValueError(
                f"rdzv_conf={rdzv_conf!r} is not supported: nbaccel forms the world through "
                "MASTER_ADDR/MASTER_PORT. Pass master_addr and use_port (or "
                "rdzv_endpoint='host:port') instead, and leave rdzv_conf unset."
            )
        if rdzv_id not in ("none", "", None):
            raise ValueError(
                f"rdzv_id={rdzv_id!r} is not supported: every launch is its own run, told "
                "apart by its port. Leave rdzv_id at its default ('none')."
            )
        if not xla and not cpu and gpus and num_processes > gpus:
            raise ValueError(
                f"num_processes={num_processes} but this machine has {gpus} GPU(s); use at most "
                f"{gpus}, or CPU ranks (debug_launcher, cpu=True)."
            )
        kind = resolve_kind(start_method, xla)
        check_capacity(num_processes, forked=kind != "spawn")
        check_cwd()
        if xla and num_nodes > 1:
            raise ValueError("an XLA launch runs on this host only; leave num_nodes=1.")
        if num_nodes > 1 and use_port is None and not rdzv_endpoint:
            raise ValueError("a multi-node launch needs use_port (the same on every node).")
        if rdzv_endpoint and use_port is None:
            master_addr, _, use_port = rdzv_endpoint.rpartition(":")
        port = None if use_port is None else parse_port(use_port)
        if port is not None and node_rank == 0:
            check_port(port, master_addr)
        return cls(
            num_processes=num_processes,
            front=Front(front),
            kind=kind,
            num_nodes=num_nodes,
            node_rank=node_rank,
            master_addr=master_addr,
            port=port,
            mixed_precision=str(mixed_precision).lower(),
            cpu=cpu,
            backend=backend,
            xla=xla,
            defaulted=defaulted,
            extra_env=dict(extra_env or {}),
        )

    @classmethod
    def _create_remote(
        cls,
        front: Front,
        num_processes: int | None,
        remote: RemoteOptions,
        cpu: bool | None,
        backend: str | None,
        mixed_precision: str,
        num_nodes: int,
        use_port: int | str | None,
        xla: bool,
        extra_env: Mapping[str, str] | None,
    ) -> LaunchPlan:
        """A plan whose ranks run on ``remote``'s hosts, driven from this kernel."""
        total = remote.layout.num_processes
        if num_processes is not None and num_processes != total:
            raise ValueError(
                f"num_processes={num_processes} but the hosts run {total} ranks "
                f"({remote.layout.describe()})."
            )
        if xla or num_nodes != 1 or use_port is not None:
            raise ValueError(
                "a launch over hosts forms its world itself (MASTER_ADDR is the first host, "
                "MASTER_PORT a free port there): leave num_nodes, use_port and XLA out."
            )
        if str(mixed_precision).lower() not in MIXED_PRECISION_CHOICES:
            raise ValueError(
                f"Unknown mixed_precision {mixed_precision!r}; choose one of "
                f"{', '.join(MIXED_PRECISION_CHOICES)}."
            )
        return cls(
            num_processes=total,
            front=Front(front),
            kind=remote.kind,
            mixed_precision=str(mixed_precision).lower(),
            cpu=bool(cpu),
            backend=backend,
            extra_env=dict(extra_env or {}),
            remote=remote,
        )

    def launcher_options(self) -> dict[str, Any]:
        """What ``make_launcher`` needs besides the kind (the hosts, for remote kinds)."""
        return {"remote": self.remote} if self.remote is not None else {}

    # ------------------------------------------------------------------ what it is
    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @property
    def gpus(self) -> int:
        """GPUs the ranks use (0 for CPU ranks)."""
        return 0 if self.cpu or self.xla else torch.cuda.device_count()

    @property
    def local_rendezvous(self) -> bool:
        """All ranks on this machine: their process group meets in a private file store."""
        return self.num_nodes == 1 and not self.xla and self.remote is None

    def describe(self) -> str:
        """``2 CPU processes (gloo)``, ``4 GPUs (nccl)``, ``XLA devices``."""
        n = self.num_processes
        if self.remote is not None:  # the hosts' devices are theirs to know
            kind = "CPU process" if self.cpu else "process"
            return f"{n} {kind}{'es' if n > 1 else ''}" + (
                f" ({self.backend})" if self.backend else ""
            )
        if self.xla:
            return "XLA devices (torch-xla uses every device it sees)"
        if self.gpus:
            return f"{n} GPU{'s' if n > 1 else ''} ({self.backend or 'nccl'})"
        return f"{n} CPU process{'es' if n > 1 else ''} ({self.backend or 'gloo'})"

    def announcement(self, where: str = "") -> str:
        """The line a front shows when the launch starts (``where``: the launcher's words on
        where the ranks run, ``ProcessLauncher.describe``)."""
        if self.front == Front.POOL:
            return f"Starting a pool of {self.describe()}{where}."
        text = f"Launching on {self.describe()}{where}"
        if self.num_nodes > 1:
            text += f" per node, {self.num_nodes} nodes"
        if self.defaulted and not self.xla:
            text += "; num_processes was not given: " + (
                f"using the {self.gpus} GPU(s) found" if self.gpus else "no GPU found, using 1"
            )
        return text + "."

    # ------------------------------------------------------------------ per rank
    def global_rank(self, index: int) -> int:
        """The rank of this node's ``index``-th process in the whole world."""
        return self.node_rank * self.num_processes + index

    def rank_env(self, index: int, port: int) -> dict[str, str]:
        """The full environment of this node's ``index``-th process."""
        env = dict(os.environ)
        env.update(
            NBACCEL_LAUNCHER=self.front.value,
            NBACCEL_MIXED_PRECISION=self.mixed_precision,
        )
        if self.xla:  # torch-xla sets up its own world; the launcher names the process
            from nbaccel.launch.launchers.xla import XLA_PROCESS_VAR

            env[XLA_PROCESS_VAR] = str(index)
        elif self.remote is not None:  # MASTER_ADDR/PORT: the launcher's, from the first host
            node, local = self.remote.layout.place(index)
            env.update(
                RANK=str(index),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(self.num_processes),
                LOCAL_WORLD_SIZE=str(self.remote.layout.hosts[node].slots),
                GROUP_RANK=str(node),
                NODE_RANK=str(node),
            )
        else:
            env.update(
                RANK=str(self.global_rank(index)),
                LOCAL_RANK=str(index),
                WORLD_SIZE=str(self.world_size),
                LOCAL_WORLD_SIZE=str(self.num_processes),
                GROUP_RANK=str(self.node_rank),
                MASTER_ADDR=self.master_addr,
                MASTER_PORT=str(port),
            )
        if self.cpu:
            env["NBACCEL_CPU"] = "1"
        env.update(self.extra_env)
        return env
