"""Where are we running? Read the launch environment and the platform, without side effects.

Every launcher (torchrun / torch elastic, SLURM ``srun``, Open MPI ``mpirun``, nbaccel's own
``notebook_launcher`` and persistent pool) leaves a different set of environment variables. This
module turns them into one :class:`LaunchEnvironment` so that :class:`nbaccel.PartialState` does
not care who started the process.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LaunchEnvironment",
    "detect_launch_environment",
    "detect_platform",
    "is_torch_xla_available",
    "is_tpu_requested",
]


@dataclass(frozen=True)
class LaunchEnvironment:
    """Who this process is in the world, as the launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "single"  # single | torchrun | nbaccel | slurm | mpi

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int | None:
    port = _int(env, "MASTER_PORT", 0)
    if not 0 <= port <= 65535:
        raise ValueError(f"environment variable MASTER_PORT={port} is not a TCP port (1-65535)")
    return port or None


def _checked(launch: LaunchEnvironment, rank_var: str, size_var: str) -> LaunchEnvironment:
    """Reject a world the launcher could not have meant (a clear error instead of a hang)."""
    if launch.world_size < 1:
        raise ValueError(f"environment variable {size_var}={launch.world_size} must be >= 1")
    if not 0 <= launch.rank < launch.world_size:
        raise ValueError(
            f"environment variable {rank_var}={launch.rank} is outside 0..{launch.world_size - 1} "
            f"({size_var}={launch.world_size})"
        )
    if launch.local_rank < 0 or launch.local_world_size < 1:
        raise ValueError(
            f"local rank {launch.local_rank} / local world size {launch.local_world_size} from "
            f"the {launch.source} variables must be >= 0 / >= 1"
        )
    return launch


def detect_launch_environment(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Read rank and world from torchrun/nbaccel, SLURM or MPI variables (in that order).

    SLURM and MPI variables are only trusted when ``MASTER_ADDR`` is set too: a notebook that
    happens to run inside a SLURM allocation is still a single process.
    """
    env = os.environ if env is None else env
    source = env.get("NBACCEL_LAUNCHER")
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE", 1)
        launch = LaunchEnvironment(
            rank=_int(env, "RANK", 0),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_port(env),
            source=source or ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"),
        )
        return _checked(launch, "RANK", "WORLD_SIZE")
    if env.get("MASTER_ADDR"):
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            world = _int(env, "SLURM_NTASKS", 1)
            nodes = max(_int(env, "SLURM_NNODES", 1), 1)
            launch = LaunchEnvironment(
                rank=_int(env, "SLURM_PROCID", 0),
                world_size=world,
                local_rank=_int(env, "SLURM_LOCALID", 0),
                local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", max(world // nodes, 1)),
                master_addr=env["MASTER_ADDR"],
                master_port=_port(env),
                source="slurm",
            )
            return _checked(launch, "SLURM_PROCID", "SLURM_NTASKS")
        for prefix in ("OMPI_COMM_WORLD_", "PMI_"):
            if f"{prefix}RANK" in env and f"{prefix}SIZE" in env:
                world = _int(env, f"{prefix}SIZE", 1)
                launch = LaunchEnvironment(
                    rank=_int(env, f"{prefix}RANK", 0),
                    world_size=world,
                    local_rank=_int(env, f"{prefix}LOCAL_RANK", _int(env, "MPI_LOCALRANKID", 0)),
                    local_world_size=_int(env, f"{prefix}LOCAL_SIZE", world),
                    master_addr=env["MASTER_ADDR"],
                    master_port=_port(env),
                    source="mpi",
                )
                return _checked(launch, f"{prefix}RANK", f"{prefix}SIZE")
    return LaunchEnvironment()


def is_torch_xla_available() -> bool:
    """True when torch-xla can be imported (it is an optional extra)."""
    return importlib.util.find_spec("torch_xla") is not None


def is_tpu_requested(env: Mapping[str, str] | None = None) -> bool:
    """True on a TPU host (Colab, Kaggle, GCE) or when PJRT is told to use an XLA device."""
    env = os.environ if env is None else env
    return bool(env.get("PJRT_DEVICE") or env.get("TPU_NAME") or env.get("COLAB_TPU_ADDR"))


def _is_tpu_host(env: Mapping[str, str]) -> bool:
    """A real TPU (``PJRT_DEVICE=CPU``, the XLA-on-CPU test lane, is not one)."""
    pjrt = env.get("PJRT_DEVICE", "").upper()
    return pjrt == "TPU" or bool(
        env.get("TPU_NAME") or env.get("COLAB_TPU_ADDR") or env.get("TPU_ACCELERATOR_TYPE")
    )


def detect_platform(env: Mapping[str, str] | None = None) -> dict[str, bool]:
    """Which hosted notebook or cluster environment this is, for ``nbaccel env`` and launchers."""
    env = os.environ if env is None else env
    return {
        "colab": "COLAB_GPU" in env or "COLAB_RELEASE_TAG" in env or "COLAB_TPU_ADDR" in env,
        "kaggle": "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env,
        "slurm": "SLURM_JOB_ID" in env,
        "torchrun": "TORCHELASTIC_RUN_ID" in env,
        "mpi": "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env,
        "tpu": _is_tpu_host(env),
        "xla": is_tpu_requested(env),
        "nbaccel_worker": "NBACCEL_LAUNCHER" in env,
    }
