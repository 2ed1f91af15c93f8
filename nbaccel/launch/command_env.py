"""The command line and environment of a script launch, from ``nbaccel launch``'s arguments.

``nbaccel launch`` runs scripts on nbaccel's own engine, which takes the rank environment this
module computes (precision, CPU, debug mode, ``torch.compile`` and FSDP options, threads); runs
that need an outside launcher (``mpirun`` on a host file, ``--no_python`` executables) also use
the command line built here. The names are Accelerate's (``accelerate.utils.launch``):
:func:`prepare_simple_launcher_cmd_env` for one machine's processes, :func:`prepare_multi_gpu_env`
for a torchrun-style multi-process world, :func:`prepare_tpu` for torch-xla.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from shutil import which
from typing import Any

from nbaccel.launch.options.accelerate_env import (
    accelerate_environment,
    check_fsdp_settings,
    launch_settings,
)
from nbaccel.launch.prepare_for_launch import PrepareForLaunch  # accelerate.utils.launch's too
from nbaccel.values.booleans import literal_bool

__all__ = [
    "PrepareForLaunch",
    "convert_nargs_to_dict",
    "launch_environment",
    "prepare_multi_gpu_env",
    "prepare_simple_launcher_cmd_env",
    "prepare_tpu",
]

_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def _check_local(address: str) -> None:
    """A one-machine launch's --main_process_ip must be this machine (see master_address)."""
    from nbaccel.launch.host.master_address import check_local_master_addr

    check_local_master_addr(
        address, name="--main_process_ip", several="--num_machines and --machine_rank"
    )


def _get(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def launch_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables every rank of this launch gets on top of the current environment:
    Accelerate's launch contract for ``args`` (:mod:`nbaccel.launch.options.accelerate_env`), the
    threads and the visible GPUs."""
    precision = str(_get(args, "mixed_precision", "no")).lower()
    if precision not in _PRECISIONS:
        raise ValueError(
            f"Unknown mixed_precision {precision!r}: choose one of {', '.join(_PRECISIONS)}."
        )
    settings = launch_settings(vars(args))
    settings.setdefault("dynamo_backend", "no")
    check_fsdp_settings(settings)
    env = accelerate_environment(settings)
    if settings["cpu"]:
        # Intel OpenMP: pin threads and let them sleep soon, as CPU training wants.
        env["KMP_AFFINITY"] = "granularity=fine,compact,1,0"
        env["KMP_BLOCKTIME"] = "1"
    gpu_ids = _get(args, "gpu_ids", "all")
    if str(gpu_ids) != "all":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    threads = getattr(args, "num_cpu_threads_per_process", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _mpirun_flags() -> tuple[str, str, str, str, str | None]:
    """The MPI launcher here and its flag names: (program, host file, processes, processes per
    node, binding or None). Open MPI spells them differently from Intel MPI and MVAPICH."""
    programs = [name for name in ("mpirun", "mpiexec") if which(name)]
    if not programs:
        raise OSError(
            "--mpirun_hostfile needs mpirun or mpiexec on PATH: install Open MPI, Intel MPI or "
            "MVAPICH, or leave mpirun_hostfile out to launch on this machine."
        )
    program = programs[0]
    if b"Open MPI" in subprocess.check_output([program, "--version"]):
        return program, "--hostfile", "-n", "--npernode", "--bind-to"
    return program, "-f", "-n", "-ppn", None


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command that runs the script (under ``mpirun`` when ``mpirun_hostfile`` is set) and
    its full environment."""
    if _get(args, "no_python", False) and _get(args, "module", False):
        raise ValueError("--module and --no_python cannot be used together: pick one.")
    processes = getattr(args, "num_processes", None)
    machines = _get(args, "num_machines", 1)
    cmd: list[str] = []
    hostfile = getattr(args, "mpirun_hostfile", None)
    if hostfile is not None:
        program, host_flag, count_flag, per_node_flag, bind_flag = _mpirun_flags()
        per_node = str(processes // machines) if processes and machines else "1"
        cmd += [program, host_flag, str(hostfile), per_node_flag, per_node]
        if processes:
            cmd += [count_flag, str(processes)]
        if bind_flag:
            cmd += [bind_flag, "socket"]
    if not _get(args, "no_python", False):
        cmd.append(sys.executable)
        if _get(args, "module", False):
            cmd.append("-m")
    cmd.append(str(args.training_script))
    cmd.extend(str(a) for a in _get(args, "training_script_args", []))

    env = dict(os.environ)
    env.update(launch_environment(args))
    if machines > 1 and (args.main_process_ip is None or args.main_process_port is None):
        raise ValueError(
            "A launch over several machines needs --main_process_ip and --main_process_port "
            "(machine 0's address and a port open on it)."
        )
    if (processes is not None and processes > 1) or machines > 1:
        env["MASTER_ADDR"] = str(_get(args, "main_process_ip", "127.0.0.1"))
        if machines <= 1:
            _check_local(env["MASTER_ADDR"])
        env["MASTER_PORT"] = str(_get(args, "main_process_port", 29500))
    return cmd, env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of a multi-process world, with torchrun's fields set on ``args``
    (``nproc_per_node``, ``nnodes``, ``node_rank``, ``master_addr``, ``master_port`` as strings).
    Port 0 (or none on one machine) means a free port chosen here."""
    from nbaccel.launch.host.ports import free_port

    machines = _get(args, "num_machines", 1)
    processes = _get(args, "num_processes", 1)
    port = getattr(args, "main_process_port", None)
    if port in (None, 0, "0") and machines <= 1:
        port = free_port()
    elif port in (None, 0, "0"):
        raise ValueError("A launch over several machines needs --main_process_port (not 0).")
    args.nproc_per_node = str(processes // machines if machines > 1 else processes)
    args.nnodes = str(machines)
    args.node_rank = str(_get(args, "machine_rank", 0))
    args.master_addr = str(_get(args, "main_process_ip", "127.0.0.1"))
    if machines <= 1:
        _check_local(args.master_addr)
    args.master_port = str(port)
    env = dict(os.environ)
    env.update(launch_environment(args))
    env["MASTER_ADDR"] = args.master_addr
    env["MASTER_PORT"] = args.master_port
    return env


def prepare_tpu(
    args: argparse.Namespace, current_env: dict[str, str], pod: bool = False
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Add the torch-xla variables of a TPU launch to ``current_env`` (bf16 becomes
    ``XLA_USE_BF16``); returns ``args`` and the environment."""
    if str(_get(args, "mixed_precision", "no")).lower() == "bf16":
        current_env["XLA_USE_BF16"] = "1"
    if _get(args, "debug", False):
        current_env["ACCELERATE_DEBUG_MODE"] = "true"
    current_env.setdefault("PJRT_DEVICE", "TPU")
    if pod:
        args.vm = _get(args, "vm", [])
        args.tpu_name = getattr(args, "tpu_name", None)
    return args, current_env


def _typed(text: str) -> Any:
    """``"3"`` -> 3, ``"5e-5"`` -> 5e-05, ``"False"`` -> False; anything else stays a string."""
    written = literal_bool(text)
    if written is not None:
        return written
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def convert_nargs_to_dict(nargs: list[str]) -> dict[str, Any]:
    """A script's ``--name value`` arguments as a typed mapping (for job services that take
    hyperparameters as a dict). A flag without a value cannot be expressed: ValueError."""
    if not nargs:
        return {}
    out: dict[str, Any] = {}
    items = list(nargs)
    index = 0
    while index < len(items):
        item = items[index]
        if not item.startswith("-"):
            raise ValueError(f"Expected an option (--name) in the script arguments, got {item!r}.")
        name, eq, value = item.lstrip("-").partition("=")
        if not eq:
            following = items[index + 1] if index + 1 < len(items) else None
            if following is None or following.startswith("--"):
                raise ValueError(
                    f"The script argument {item!r} has no value: flags without values are not "
                    f"supported here; pass it as {item} True (and parse it as a bool)."
                )
            value = following
            index += 1
        out[name] = _typed(value)
        index += 1
    return out


# Accelerate's name for it (``accelerate.utils.launch._convert_nargs_to_dict``).
_convert_nargs_to_dict = convert_nargs_to_dict
