"""What a launch is: how many ranks, where, how they start, and each rank's environment.

Every front builds one :class:`LaunchPlan` with :meth:`LaunchPlan.create`, and the plan is
complete when created: the defaults (see :data:`CPU_DEFAULT_NUM_PROCESSES`), the validation of
the options against this machine (before anything starts), the hosts placed (a remote launch's
scheduler asked once), the ranks' extra environment (the request's, such as
``PARALLELISM_CONFIG_*``) and the launcher's options (the preload setting read once). The rest
of the launch only reads it: the launcher (:meth:`LaunchPlan.make_launcher`), the announcement
line, and each rank's environment: the torchrun-style variables that ``PartialState`` reads
(RANK, WORLD_SIZE, ...), Accelerate's launch contract for the request's settings
(``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_CPU``, ``FSDP_*``...:
:mod:`nbaccel.launch.options.accelerate_env`) and NBACCEL_LAUNCHER.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nbaccel.launch.host.capacity import check_capacity
from nbaccel.launch.host.master_address import check_local_master_addr
from nbaccel.launch.host.ports import check_port
from nbaccel.launch.launchers.forkserver.kernel_modules import PreloadSetting, preload_setting
from nbaccel.launch.options.accelerate_env import accelerate_environment, contract_notices
from nbaccel.launch.rank import allocator
from nbaccel.launch.request import START_METHODS, Front, LaunchRequest
from nbaccel.launch.wire.protocol import LaunchKind

if TYPE_CHECKING:
    from nbaccel.launch.launchers.base import ProcessLauncher
    from nbaccel.launch.remote.options import RemoteOptions

__all__ = [
    "CPU_DEFAULT_NUM_PROCESSES",
    "START_METHODS",
    "LaunchPlan",
    "check_call",
    "check_cwd",
    "check_gpu_count",
    "default_num_processes",
    "resolve_kind",
]


# The defaults of ``num_processes``, in one place. When the caller does not say how many ranks:
# with GPUs (and not ``cpu``), one rank per GPU; on CPU, the number below (the launcher runs the
# function once, as Accelerate's does; the pool and the test harness want a real world of 2).
CPU_DEFAULT_NUM_PROCESSES = {Front.LAUNCHER: 1, Front.MAGIC: 2, Front.TESTING: 2}
# On XLA devices: every local device (one per TPU chip, CPU_NUM_DEVICES on the CPU), read without
# starting the XLA runtime; torch-xla itself always uses every device it sees (a different count
# is run anyway, with a warning naming both).


def _contract_request(
    request: LaunchRequest, remote: RemoteOptions | None, xla: bool, gpus: int
) -> LaunchRequest:
    """The request whose settings the ranks' Accelerate variables carry. Local ranks on a machine
    without a GPU are CPU ranks whether or not ``cpu=True`` was passed, and say so as
    ``accelerate launch --cpu`` would (``ACCELERATE_USE_CPU``): without it, Accelerate's own
    ``Accelerator`` and transformers' ``Trainer`` take each rank for a world of one and train
    independent copies."""
    if request.cpu or remote is not None or xla or gpus:
        return request
    return dataclasses.replace(request, cpu=True)


def default_num_processes(front: Front, cpu: bool = False, xla: bool = False) -> int:
    """How many ranks ``front`` starts when ``num_processes`` is not given."""
    if xla:
        from nbaccel.launch.launchers.xla import local_device_count

        return local_device_count()
    gpus = 0 if cpu else torch.cuda.device_count()
    return gpus or CPU_DEFAULT_NUM_PROCESSES[Front(front)]


def check_gpu_count(num_processes: int, gpus: int) -> None:
    """ValueError naming the count when GPU ranks (one per GPU) outnumber this machine's GPUs
    (``CUDA_VISIBLE_DEVICES`` decides what is visible); nothing to check without a GPU."""
    if gpus and num_processes > gpus:
        raise ValueError(
            f"num_processes={num_processes} but this machine has {gpus} GPU(s); use at most "
            f"{gpus}, or CPU ranks (debug_launcher, cpu=True)."
        )


def check_call(args: Any, kwargs: Any = None) -> tuple[Any, ...]:
    """Validate what a launch runs, before anything starts; ``args`` as a tuple.

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
    from nbaccel.launch.rank.worker import current_rank, on_worker

    if on_worker():
        raise RuntimeError(
            f"a launch was started on rank {current_rank()}, inside a running launch: ranks "
            "cannot start a second world of their own. Call the function directly on each rank "
            "(it already runs on every rank), or launch from the notebook itself."
        )


def resolve_kind(start_method: str, xla: bool = False) -> LaunchKind:
    """The launcher variant (a key of ``nbaccel.launch.launchers.LAUNCHERS``) for a launch.

    ``auto``: the fork server (spawn where fork does not exist); for XLA, ``auto`` and ``fork``
    are the ``xla`` launcher (forked torch-xla processes that inherit the work). ``fork`` is
    refused once this process has initialised CUDA.
    """
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}.")
    if xla and start_method in ("auto", "fork"):
        return LaunchKind.XLA
    if start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised in this kernel, and a forked child cannot use it. "
            "Use start_method='auto' (nbaccel's fork server is CUDA-safe)."
        )
    if start_method == "auto":
        return LaunchKind.FORKSERVER if hasattr(os, "fork") else LaunchKind.SPAWN
    return LaunchKind(start_method)


def _settings(front: Front, request: LaunchRequest) -> dict[str, Any]:
    """The request's settings by Accelerate's names; none for a pool, whose cells bring theirs."""
    return {} if front == Front.MAGIC else request.accelerate_settings()


def _role(rank: int, world: int) -> dict[str, str]:
    """torchrun's role variables (one role, named ``default``, as torchrun names it)."""
    return {"ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world)}


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks of this node and the world they belong to. Build it with :meth:`create`."""

    num_processes: int
    front: Front = Front.LAUNCHER
    kind: LaunchKind = LaunchKind.FORKSERVER
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
    #: what the fork server imports for the ranks beyond torch (the ``preload=`` words; None:
    #: ``NBACCEL_PRELOAD``, else the notebook's imported libraries)
    preload: tuple[str, ...] | None = None
    #: a one-shot launch with start_method="auto": its ranks may fork from the kernel while the
    #: fork server still imports the kernel's libraries (``ForkServerLauncher.prepare``)
    fork_while_importing: bool = False
    line_prefix: str | None = None  # template of each output line's prefix (RankLabels)
    #: ranks on other hosts (ssh or slurm): the hosts, and how the agents start
    remote: RemoteOptions | None = None
    #: the preload setting of the launch (``preload``, else ``NBACCEL_PRELOAD``), read once by
    #: :meth:`create`; None in a plan built field by field (read when the launcher is made)
    setting: PreloadSetting | None = None
    #: the request's settings by Accelerate's names (``LaunchRequest.accelerate_settings``)
    settings: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        front: Front,
        request: LaunchRequest | None = None,
        *,
        xla: bool = False,
        extra_env: Mapping[str, str] | None = None,
        remote: RemoteOptions | None = None,
    ) -> LaunchPlan:
        """The plan of ``request`` (already validated option by option) on this machine's
        devices; raises before anything starts.

        ``remote``: hosts built apart (the engine's own tests); by default the request's.
        ``extra_env``: the front's own variables for the ranks, on top of the request's
        (:meth:`LaunchRequest.rank_environment`). A pool (``Front.MAGIC``) runs CPU ranks when
        there is no GPU, and its ranks start without mixed precision or the request's
        variables: each cell sets its own (``%%distributed --mixed_precision``).
        """
        _refuse_nested_launch()
        allocator.settings(os.environ)  # a malloc variable the ranks could not read: say so now
        request = request or LaunchRequest()
        if front == Front.MAGIC and request.mixed_precision != "no":
            request = dataclasses.replace(request, mixed_precision="no")  # a cell's, not the pool's
        remote = remote or request.remote
        gpus = torch.cuda.device_count()
        if front != Front.MAGIC:  # a pool's cells each bring theirs
            extra_env = {**_contract_request(request, remote, xla, gpus).rank_environment(),
                         **(extra_env or {})}  # fmt: skip
        cpu = request.cpu or (front == Front.MAGIC and gpus == 0)
        if remote is not None:
            return cls._create_remote(front, request, remote, cpu, xla, extra_env)
        num_processes = request.num_processes
        defaulted = num_processes is None
        if num_processes is None:
            num_processes = default_num_processes(front, cpu, xla)
        if not xla and not cpu:
            check_gpu_count(num_processes, gpus)
        kind = resolve_kind(request.start_method, xla)
        check_capacity(num_processes, forked=kind != LaunchKind.SPAWN)
        check_cwd()
        if xla and request.num_nodes > 1:
            raise ValueError("an XLA launch runs on this host only; leave num_nodes=1.")
        master_addr, port = request.master_addr, request.use_port
        if request.rdzv_endpoint and port is None:
            master_addr, _, text = request.rdzv_endpoint.rpartition(":")
            port = LaunchRequest(use_port=text).use_port
        if request.num_nodes == 1:
            check_local_master_addr(master_addr)
        if port is not None and request.node_rank == 0:
            check_port(port, master_addr)
        return cls(
            num_processes=num_processes,
            front=Front(front),
            kind=kind,
            num_nodes=request.num_nodes,
            node_rank=request.node_rank,
            master_addr=master_addr,
            port=port,
            mixed_precision=request.mixed_precision,
            cpu=cpu,
            backend=request.backend,
            xla=xla,
            defaulted=defaulted,
            extra_env=dict(extra_env or {}),
            preload=request.preload,
            fork_while_importing=front == Front.LAUNCHER and request.start_method == "auto",
            line_prefix=request.log_line_prefix_template,
            setting=preload_setting(request.preload),
            settings=_settings(front, request),
        )

    @classmethod
    def _create_remote(
        cls,
        front: Front,
        request: LaunchRequest,
        remote: RemoteOptions,
        cpu: bool,
        xla: bool,
        extra_env: Mapping[str, str] | None,
    ) -> LaunchPlan:
        """A plan whose ranks run on ``remote``'s hosts, driven from this kernel."""
        from nbaccel.launch.registry import place_remote

        if remote.layout is None:  # placed by the cluster's scheduler (Ray), checked there
            remote = place_remote(
                dataclasses.replace(remote, num_processes=request.num_processes),
                pool=front == Front.MAGIC,
            )
        assert remote.layout is not None
        if remote.ray is not None and not remote.ray.gpus:
            cpu = True  # the ranks hold no GPU: gloo, whatever their node has
        total = remote.layout.num_processes
        if request.num_processes is not None and request.num_processes != total:
            raise ValueError(
                f"num_processes={request.num_processes} but the hosts run {total} ranks "
                f"({remote.layout.describe()})."
            )
        if xla or request.num_nodes != 1 or request.use_port is not None:
            raise ValueError(
                "a launch over hosts forms its world itself (MASTER_ADDR is the first host, "
                "MASTER_PORT a free port there): leave num_nodes, use_port and XLA out."
            )
        return cls(
            num_processes=total,
            front=Front(front),
            kind=remote.kind,
            mixed_precision=request.mixed_precision,
            cpu=cpu,
            backend=request.backend,
            extra_env=dict(extra_env or {}),
            remote=remote,
            preload=request.preload,
            line_prefix=request.log_line_prefix_template,
            setting=preload_setting(request.preload),
            settings=_settings(front, request),
        )

    def launcher_options(self) -> dict[str, Any]:
        """What ``make_launcher`` needs besides the kind (the hosts, for remote kinds; what the
        fork server imports for the ranks, for the default kind)."""
        setting = self.setting if self.setting is not None else preload_setting(self.preload)
        if self.remote is not None:
            return {"remote": self.remote, "setting": setting}
        if self.kind == LaunchKind.FORKSERVER:
            return {"setting": setting, "fork_while_importing": self.fork_while_importing}
        return {}

    def make_launcher(self, preload: Iterable[str] = ()) -> ProcessLauncher:
        """The launcher variant of this plan, with its options (``preload``: modules the front
        wants the fork server to import for its ranks)."""
        from nbaccel.launch.registry import make_launcher

        return make_launcher(self.kind, preload=tuple(preload), **self.launcher_options())

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
        if self.front == Front.MAGIC:
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
        env.update(self.accelerate_environment())
        env["NBACCEL_LAUNCHER"] = self.front.launcher_name
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
                GROUP_WORLD_SIZE=str(len(self.remote.layout.hosts)),
            )
            env.update(_role(index, self.num_processes))
        else:
            env.update(
                RANK=str(self.global_rank(index)),
                LOCAL_RANK=str(index),
                WORLD_SIZE=str(self.world_size),
                LOCAL_WORLD_SIZE=str(self.num_processes),
                GROUP_RANK=str(self.node_rank),
                GROUP_WORLD_SIZE=str(self.num_nodes),
                MASTER_ADDR=self.master_addr,
                MASTER_PORT=str(port),
            )
            env.update(_role(self.global_rank(index), self.world_size))
        env.update(self.extra_env)
        return env

    def accelerate_environment(self) -> dict[str, str]:
        """Accelerate's launch contract for this launch: the variables ``accelerate launch``
        would set for the same settings (precision and CPU as this plan decided them)."""
        return accelerate_environment(
            {**self.settings, "mixed_precision": self.mixed_precision, "cpu": self.cpu}
        )

    def notices(self) -> list[str]:
        """One line per setting that Accelerate's ``Accelerator`` (Trainer, PEFT, TRL) cannot
        carry out on these ranks, naming what runs instead (none when the hosts' devices are
        not known here)."""
        if self.remote is not None and not self.cpu:
            return []
        return contract_notices(self.accelerate_environment(), self.gpus)
