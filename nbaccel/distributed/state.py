"""Process-wide distributed state: who am I, how big is the world, which device and backend.

``PartialState``, ``AcceleratorState`` and ``GradientState`` share their attributes across every
instance in a process (the "Borg" pattern), exactly as in Accelerate: create them as often as you
like, the process group is initialised once.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from functools import wraps
from typing import Any

import torch
import torch.distributed as dist

from nbaccel.distributed import xla_runtime
from nbaccel.distributed.comm import Communicator
from nbaccel.distributed.environment import (
    LaunchEnvironment,
    detect_launch_environment,
    is_torch_xla_available,
    is_tpu_requested,
)
from nbaccel.values.booleans import env_flag

__all__ = [
    "AcceleratorState",
    "DistributedType",
    "GradientState",
    "PartialState",
]

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")


class DistributedType(str, Enum):
    """The kind of distributed run this process is part of."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_XPU = "MULTI_XPU"
    FSDP = "FSDP"
    XLA = "XLA"
    DEEPSPEED = "DEEPSPEED"  # DeepSpeed ZeRO engines (Accelerator(deepspeed_plugin=...))
    MEGATRON_LM = "MEGATRON_LM"  # MegatronLMPlugin: tensor + pipeline parallel on torch's engines
    # Accelerate's other device stacks, as values only (nbaccel never reports them).
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


def _pick_device(cpu: bool, launch: LaunchEnvironment) -> torch.device:
    if cpu:
        return torch.device("cpu")
    forced = os.environ.get("NBACCEL_TORCH_DEVICE") or os.environ.get("ACCELERATE_TORCH_DEVICE")
    if forced:  # an explicit device such as "cuda:3" or "xpu:1" (Accelerate's variable too)
        try:
            return torch.device(forced)
        except RuntimeError:
            raise ValueError(
                f"NBACCEL_TORCH_DEVICE/ACCELERATE_TORCH_DEVICE={forced!r} is not a torch device: "
                "use a name like 'cuda:1' or 'cpu'."
            ) from None
    if is_tpu_requested() and is_torch_xla_available():
        return xla_runtime.xla_device()
    if torch.cuda.is_available():
        return torch.device("cuda", launch.local_rank % torch.cuda.device_count())
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _default_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "xla": "xla", "xpu": "xccl"}.get(device.type, "gloo")


# The communication backend of each kind of run (torch.distributed unless listed).
_COMMUNICATORS: dict[DistributedType, type[Communicator]] = {
    DistributedType.XLA: xla_runtime.XLACommunicator,
}


def _distributed_type(device: torch.device, world_size: int) -> DistributedType:
    if device.type == "xla":
        return DistributedType.XLA
    if world_size <= 1:
        return DistributedType.NO
    return {"cuda": DistributedType.MULTI_GPU, "xpu": DistributedType.MULTI_XPU}.get(
        device.type, DistributedType.MULTI_CPU
    )


_STATE_FIELDS = frozenset(
    ("device", "backend", "num_processes", "process_index", "local_process_index",
     "local_num_processes", "distributed_type", "launch_environment", "communicator",
     "fork_launched", "mixed_precision", "dynamo_plugin", "fsdp_plugin", "deepspeed_plugins")
)  # fmt: skip


class PartialState:
    """The distributed environment, without the training-specific parts of ``AcceleratorState``.

    Args:
        cpu: force the CPU (and gloo) even when accelerators are present.
        **kwargs: ``backend``, the process-group backend to use instead of the default for
            the device, and ``timeout``, a ``datetime.timedelta`` for the process group's
            collectives.
    """

    _shared_state: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the instance lacks: explain the usual cause for a state field.
        cls = type(self).__name__
        if name in _STATE_FIELDS and not self._shared_state:
            raise AttributeError(
                f"`{cls}` object has no attribute `{name}`: the shared state was cleared. "
                f"This happens if `{cls}._reset_state()` was called and no `{cls}()` was "
                "created since: create one again before reading it."
            )
        raise AttributeError(f"'{cls}' object has no attribute '{name}'")

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if self.initialized:
            return
        try:
            self._setup(cpu, kwargs)
        except BaseException:
            # A half-built state would look initialised to the next PartialState(): forget it.
            self._shared_state.clear()
            raise

    def _setup(self, cpu: bool, kwargs: dict[str, Any]) -> None:
        launch = detect_launch_environment()
        self.launch_environment = launch
        self.device = _pick_device(cpu or bool(env_flag("ACCELERATE_USE_CPU")), launch)
        self.backend = kwargs.pop("backend", None) or _default_backend(self.device)
        timeout = kwargs.pop("timeout", None)
        if self.device.type == "xla":
            self._init_xla()
        else:
            self.process_index = launch.rank
            self.num_processes = launch.world_size
            self.local_process_index = launch.local_rank
            self.local_num_processes = launch.local_world_size
            if launch.world_size > 1 or dist.is_initialized():
                self._init_process_group(timeout)
        self.distributed_type = _distributed_type(self.device, self.num_processes)
        communicator = _COMMUNICATORS.get(self.distributed_type, Communicator)
        self.communicator = communicator(self.device, self.backend)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.fork_launched = bool(env_flag("NBACCEL_FORK_LAUNCHED"))

    def _init_xla(self) -> None:
        self.backend = "xla"
        world = xla_runtime.world()
        self.num_processes, self.process_index = world[0], world[1]
        self.local_process_index, self.local_num_processes = world[2], world[3]

    def _init_process_group(self, timeout: datetime.timedelta | None) -> None:
        if not dist.is_initialized():
            launch = self.launch_environment
            init_method = os.environ.get("NBACCEL_INIT_METHOD", "env://")
            if init_method == "env://" and (
                launch.master_addr is None or launch.master_port is None
            ):
                raise RuntimeError(
                    f"WORLD_SIZE={launch.world_size} but MASTER_ADDR/MASTER_PORT are not set: "
                    "start the script with torchrun, nbaccel.notebook_launcher or set both "
                    "variables (and RANK) yourself."
                )
            kwargs: dict[str, Any] = {
                "backend": self.backend,
                "rank": launch.rank,
                "world_size": launch.world_size,
                "init_method": init_method,
            }
            if init_method == "env://":
                os.environ.setdefault("MASTER_ADDR", launch.master_addr)
                os.environ.setdefault("MASTER_PORT", str(launch.master_port))
            if timeout is not None:
                kwargs["timeout"] = timeout
            if self.device.type == "cuda":
                kwargs["device_id"] = self.device
            dist.init_process_group(**kwargs)
        self.backend = dist.get_backend()
        self.process_index = dist.get_rank()
        self.num_processes = dist.get_world_size()

    # -- identity ---------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return "device" in self._shared_state

    @property
    def use_distributed(self) -> bool:
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def default_device(self) -> torch.device:
        return self.device

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}  Backend: {self.backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    # -- synchronisation --------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Barrier: every process waits here until all of them arrive."""
        if self.distributed_type == DistributedType.XLA:
            xla_runtime.rendezvous("nbaccel.wait_for_everyone")
        elif self.use_distributed:
            dist.barrier()

    @contextmanager
    def _goes_first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        try:
            yield
        finally:
            # Release the others even when the block raised, so they fail fast instead of hanging.
            if is_first:
                self.wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others (e.g. dataset caching)."""
        with self._goes_first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like :meth:`main_process_first`, once per node."""
        with self._goes_first(self.is_local_main_process):
            yield

    # -- decorators ---------------------------------------------------------------------------
    # The choice is made when the function is called. As in Accelerate, a process that is not
    # part of a distributed run executes every decorated function.
    def _only_if(self, predicate: Callable[[], bool], function: Callable) -> Callable:
        @wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if predicate() or not self.use_distributed:
                return function(*args, **kwargs)
            return None

        return wrapper

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run ``function`` only on the global main process."""
        if function is None:
            return self.on_main_process
        return self._only_if(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run ``function`` only on each node's main process."""
        if function is None:
            return self.on_local_main_process
        return self._only_if(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` only on the last process."""
        return self._only_if(lambda: self.is_last_process, function)

    def on_process(
        self, function: Callable | None = None, process_index: int | None = None
    ) -> Callable:
        """Decorator: run ``function`` only on global process ``process_index``."""
        if function is None:
            return lambda f: self.on_process(f, process_index=process_index)
        return self._only_if(lambda: self.process_index == process_index, function)

    def on_local_process(
        self, function: Callable | None = None, local_process_index: int | None = None
    ) -> Callable:
        """Decorator: run ``function`` only on local process ``local_process_index``."""
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index=local_process_index)
        return self._only_if(lambda: self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per node (on the local main process)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- work splitting -----------------------------------------------------------------------
    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give this process its contiguous share of ``inputs`` (list, tuple, dict or tensor).

        The first ``len % num_processes`` processes get one extra element. With
        ``apply_padding=True`` the shorter shares repeat their last element so that every process
        has the same count (drop the padding after a gather).
        """
        from nbaccel.distributed.work_split import split_for_process

        yield split_for_process(inputs, self.process_index, self.num_processes, apply_padding)

    # -- teardown -----------------------------------------------------------------------------
    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy the process group (when this process created one)."""
        # (also after _reset_state(): the group outlives the forgotten shared state)
        kind = getattr(self, "distributed_type", None)
        if dist.is_initialized() and kind != DistributedType.XLA:
            dist.destroy_process_group(group)

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state (tests, pool restarts). Does not tear down the group."""
        cls._shared_state.clear()


class AcceleratorState(PartialState):
    """``PartialState`` plus training options: mixed precision, FSDP plugin, dynamo backend."""

    _shared_state: dict[str, Any] = {}

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        fsdp_plugin: Any = None,
        deepspeed_plugin: Any = None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        partial = PartialState(cpu, **kwargs)
        if "mixed_precision" in self.__dict__:
            if mixed_precision is not None and mixed_precision != self.mixed_precision:
                raise ValueError(
                    f"AcceleratorState is already set up with mixed_precision="
                    f"{self.mixed_precision!r}; call AcceleratorState._reset_state() first to "
                    f"switch to {mixed_precision!r}."
                )
            if fsdp_plugin is not None and fsdp_plugin != self.fsdp_plugin:
                # A later Accelerator (a re-run cell in a pool) asks for another plugin: it takes
                # effect for the accelerators built from now on; earlier ones keep their strategy.
                self._use_fsdp_plugin(fsdp_plugin, partial.distributed_type)
            if deepspeed_plugin is not None and deepspeed_plugin is not self.deepspeed_plugins:
                self._use_deepspeed_plugins(deepspeed_plugin)
            return
        self.__dict__.update(partial.__dict__)
        chosen = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION") or "no"
        chosen = str(chosen).lower()
        if chosen not in MIXED_PRECISION_CHOICES:
            raise ValueError(
                f"Unknown mixed_precision {chosen!r}; choose one of {MIXED_PRECISION_CHOICES}."
            )
        self.mixed_precision = chosen
        self.dynamo_plugin = dynamo_plugin
        self.fsdp_plugin = None
        if fsdp_plugin is not None:
            self._use_fsdp_plugin(fsdp_plugin, partial.distributed_type)
        self._use_deepspeed_plugins(deepspeed_plugin)

    def _use_deepspeed_plugins(self, plugins: Any) -> None:
        """Run DeepSpeed with ``plugins`` (None, one, or a dict by name); select the first."""
        single = not isinstance(plugins, dict | None)
        self.deepspeed_plugins = {"default": plugins} if single else plugins
        self.deepspeed_plugin = None
        if self.deepspeed_plugins:
            self.distributed_type = DistributedType.DEEPSPEED
            self.select_deepspeed_plugin(next(iter(self.deepspeed_plugins)))

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The DeepSpeed plugin registered as ``name``."""
        return self.deepspeed_plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Make plugin ``name`` the one the next ``prepare`` (and transformers) uses."""
        plugins = self.deepspeed_plugins or {}
        if name not in plugins:
            raise ValueError(f"No DeepSpeed plugin {name!r}; the plugins are {list(plugins)}.")
        for plugin in plugins.values():
            plugin._unselect()
        self.deepspeed_plugin = plugins[name]
        plugins[name].select(_from_accelerator_state=True)

    def _use_fsdp_plugin(self, fsdp_plugin: Any, process_type: DistributedType) -> None:
        """Shard with ``fsdp_plugin`` from now on (FSDP over the process's DDP-able run)."""
        self.fsdp_plugin = fsdp_plugin
        if process_type in (
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
            DistributedType.NO,
        ):
            self.distributed_type = DistributedType.FSDP

    @property
    def initialized(self) -> bool:
        return "mixed_precision" in self._shared_state

    @classmethod
    def current(cls) -> AcceleratorState | None:
        """This process's state when an ``Accelerator`` (or ``AcceleratorState``) built it, else
        None; never builds one (so it never starts a process group)."""
        if "mixed_precision" not in cls._shared_state:
            return None
        state = cls.__new__(cls)
        state.__dict__ = cls._shared_state
        return state

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


class GradientState:
    """Gradient-synchronisation bookkeeping shared by the accelerator, optimizers and loaders."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references: list[Any] = [None]
            self.plugin_kwargs: dict[str, Any] = {}
            self._is_xla_gradients_synced = False
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs()

    @property
    def initialized(self) -> bool:
        return "sync_gradients" in self._shared_state

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return bool(loader is not None and getattr(loader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        loader = self.active_dataloader
        return -1 if loader is None else getattr(loader, "remainder", -1)

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        self.dataloader_references.remove(dataloader)
        self.active_dataloader = self.dataloader_references[-1]

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()
