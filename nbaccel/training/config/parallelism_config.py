"""The parallelism layout of a run: how many ranks replicate, shard, split tensors or context.

:class:`ParallelismConfig` describes an N-dimensional device mesh with up to four named axes
(``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; ``sp`` for DeepSpeed's sequence parallelism).
Sizes left as ``None`` come from ``PARALLELISM_CONFIG_<AXIS>_SIZE`` environment variables (what
``nbaccel launch`` exports) and default to 1. Axes of size 1 are left out of the mesh.
:meth:`ParallelismConfig.build_device_mesh` builds the torch ``DeviceMesh`` in the canonical
order ``dp_replicate, dp_shard, cp, sp, tp`` and flattens the joint axes ``dp``,
``dp_shard_cp`` and ``dp_cp`` that data loading and FSDP use.

The :class:`~nbaccel.training.accelerator.core.Accelerator` trains every layout but DeepSpeed's
sequence parallelism: pure replication = DDP, pure sharding = FSDP2, and tensor parallel, HSDP
and their compositions on the mesh strategy
(:mod:`nbaccel.training.strategies.model_parallel.mesh`); context
parallel runs on CUDA ranks only (torch has no CPU kernel for it).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"]

_AXES = ("dp_replicate", "dp_shard", "cp", "sp", "tp")  # the mesh order, outermost first
_CP_STRATEGIES = ("allgather", "alltoall")
_ENV = "PARALLELISM_CONFIG_"


@dataclass
class TorchTensorParallelConfig:
    """Options of torch's tensor parallelism (none are needed today; kept for the type)."""

    enable_async_tp: bool = False


@dataclass
class TorchContextParallelConfig:
    """Options of torch's context parallelism: how ranks exchange key/value shards.

    ``cp_comm_strategy`` is ``"allgather"`` (default) or ``"alltoall"``; ``None`` reads
    ``PARALLELISM_CONFIG_CP_COMM_STRATEGY``.
    """

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get(_ENV + "CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in _CP_STRATEGIES:
            raise ValueError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. "
                f"Use one of {', '.join(_CP_STRATEGIES)}."
            )


def _size_from_env(value: int | None, axis: str) -> int:
    if value is not None:
        return int(value)
    raw = os.environ.get(f"{_ENV}{axis.upper()}_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{_ENV}{axis.upper()}_SIZE={raw!r} is not an integer.") from None


@dataclass
class ParallelismConfig:
    """Sizes of the parallel axes of a run (each ``None`` -> environment -> 1).

    ``dp_replicate_size`` ranks hold full replicas (DDP); ``dp_shard_size`` ranks shard the model
    (FSDP); both > 1 is HSDP. ``tp_size``/``cp_size`` split tensors/sequence within a replica;
    ``sp_size`` is DeepSpeed's sequence parallelism. Product of all sizes = ``total_size``.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: Any = None
    device_mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for axis in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            size = _size_from_env(getattr(self, f"{axis}_size"), axis)
            if size < 1:
                raise ValueError(f"{axis}_size must be at least 1, got {size}.")
            setattr(self, f"{axis}_size", size)
        if self.cp_backend is None:
            self.cp_backend = os.environ.get(_ENV + "CP_BACKEND", "torch")
        if self.cp_backend != "torch":
            raise ValueError(f"cp_backend must be 'torch', got {self.cp_backend!r}.")
        if self.sp_backend is None:
            self.sp_backend = os.environ.get(_ENV + "SP_BACKEND", "deepspeed")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend must be 'deepspeed', got {self.sp_backend!r}.")
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1:
            if self.cp_handler is None:
                self.cp_handler = TorchContextParallelConfig()
            elif not isinstance(self.cp_handler, TorchContextParallelConfig):
                raise ValueError(
                    f"cp_handler must be a TorchContextParallelConfig, got {type(self.cp_handler)}."
                )
        if self.sp_size > 1 and self.sp_handler is None:
            from nbaccel.training.config.unsupported_stacks import DeepSpeedSequenceParallelConfig

            self.sp_handler = DeepSpeedSequenceParallelConfig()  # refuses: DeepSpeed only
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError("cp_size and sp_size cannot both be > 1: choose one of them.")
        pure_replication = self.dp_replicate_size > 1 and self.dp_shard_size == 1
        if (self.tp_size > 1 or self.cp_size > 1) and pure_replication:
            raise ValueError(
                "tp_size/cp_size > 1 need a sharded data-parallel axis: set dp_shard_size > 1 "
                "(FSDP + TP/CP, or HSDP + TP/CP with dp_replicate_size > 1)."
            )

    # -- sizes -----------------------------------------------------------------------------
    @property
    def _sizes(self) -> dict[str, int]:
        return {axis: getattr(self, f"{axis}_size") for axis in _AXES}

    def _set_size(self, axis: str, size: int) -> None:
        if axis not in _AXES:
            raise ValueError(f"Unknown parallel axis {axis!r}: one of {', '.join(_AXES)}.")
        setattr(self, f"{axis}_size", size)

    @property
    def total_size(self) -> int:
        """Number of ranks the layout needs (product of every size)."""
        total = 1
        for size in self._sizes.values():
            total *= size
        return total

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: ``dp_replicate_size * dp_shard_size``."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that see the same batch: ``tp_size * cp_size * sp_size``."""
        return self.tp_size * self.cp_size * self.sp_size

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    # -- axis names ------------------------------------------------------------------------
    def _enabled(self, *axes: str) -> list[str]:
        return [a for a in axes if getattr(self, f"{a}_size") > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled data-parallel axes (different batches)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled axes whose ranks receive the same batch."""
        return self._enabled("tp", "cp", "sp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled axes that FSDP shards the model over (flattened as ``dp_shard_cp``)."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled axes the loss is averaged over (flattened as ``dp_cp``)."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """Mesh axes FSDP2 is applied over (replication first, then the joint shard axis)."""
        return self._enabled("dp_replicate") + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every enabled axis: data-parallel ones first."""
        return self.dp_dim_names + self.non_dp_dim_names

    # -- mesh ------------------------------------------------------------------------------
    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """``(axis names, axis sizes)`` of the enabled axes in mesh order; ``()`` when none."""
        active = set(self.active_mesh_dims)
        names = tuple(a for a in _AXES if a in active)
        if not names:
            return ()  # type: ignore[return-value]
        return names, tuple(getattr(self, f"{a}_size") for a in names)

    def build_device_mesh(self, device_type: str) -> Any:
        """Build the torch ``DeviceMesh`` (needs an initialised process group of
        ``total_size`` ranks) and flatten its joint axes; ``None`` when no axis is enabled."""
        if self.sp_enabled:
            return None  # DeepSpeed builds its own sequence-parallel groups
        from torch.distributed import device_mesh as dm

        layout = self._get_mesh()
        if not layout:
            return None
        names, shape = layout
        mesh = dm.init_device_mesh(device_type, shape, mesh_dim_names=names)
        for joint, axes in (
            ("dp", self.dp_dim_names),
            ("dp_shard_cp", self.dp_shard_cp_dim_names),
            ("dp_cp", self.dp_cp_dim_names),
        ):
            if axes:
                mesh[axes]._flatten(joint)
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh built once (``device_type`` needed the first time, and must not change)."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("Pass device_type (e.g. 'cpu', 'cuda') to build the device mesh.")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"The device mesh was built for {self.device_mesh.device_type!r}, "
                f"not {device_type!r}."
            )
        return self.device_mesh

    def to_json(self) -> dict[str, Any]:
        """The sizes and backends as a plain dict (the mesh itself is not serialisable)."""
        return {**{f"{a}_size": s for a, s in self._sizes.items()},
                "cp_backend": self.cp_backend, "sp_backend": self.sp_backend}  # fmt: skip

    @classmethod
    def from_tp_plugin(
        cls, plugin: Any, num_processes: int, config: ParallelismConfig | None = None
    ) -> ParallelismConfig:
        """The layout of a ``TorchTensorParallelPlugin(tp_size=N)``: ``tp_size=N`` and the other
        ranks sharding the data (FSDP2); an explicit ``config`` must agree on ``tp_size``."""
        tp = int(getattr(plugin, "tp_size", 1))
        if config is not None:
            if config.tp_size not in (1, tp):
                raise ValueError(
                    f"torch_tp_plugin says tp_size={tp} but parallelism_config says "
                    f"tp_size={config.tp_size}: pass one of them."
                )
            config.tp_size = tp
            if tp > 1 and config.tp_handler is None:
                config.tp_handler = TorchTensorParallelConfig()
            return config
        if num_processes % tp:
            raise ValueError(
                f"TorchTensorParallelPlugin(tp_size={tp}) does not divide the {num_processes} "
                f"ranks of the run: use a tp_size that divides {num_processes}."
            )
        return cls(tp_size=tp, dp_shard_size=num_processes // tp)

    def describe(self) -> str:
        """``dp_shard_size=2 x tp_size=2 = 4`` (the enabled axes; ``1`` when none)."""
        sizes = [f"{a}_size={s}" for a, s in self._sizes.items() if s > 1]
        return f"{' x '.join(sizes) or 'every size 1'} = {self.total_size}"

    def _validate_accelerator(self, accelerator: Any) -> None:
        """Check the layout against the run (a 1-rank layout becomes plain DDP over all ranks)."""
        num = accelerator.num_processes
        if self.total_size == 1:
            if num > 1:
                self._set_size("dp_replicate", num)
            return
        if not self.sp_enabled and self.total_size != num:
            raise ValueError(
                f"ParallelismConfig needs {self.total_size} ranks ({self.describe()}) but the "
                f"run has {num}: make the product of dp_replicate_size, dp_shard_size, tp_size "
                f"and cp_size equal {num}, or launch {self.total_size} processes."
            )
        for axis, size in self._sizes.items():
            if size == 1 and getattr(self, f"{axis}_handler", None) is not None:
                warnings.warn(
                    f"ParallelismConfig.{axis}_handler is set but {axis}_size is 1: it is ignored.",
                    UserWarning,
                    stacklevel=3,
                )
