"""``nbaccel env``: versions, devices and the detected environment, for bug reports."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

__all__ = ["collect", "register", "render_text"]

# Distribution names, in the order a reader wants them.
PACKAGES = (
    "torch",
    "torch-xla",
    "ipykernel",
    "ipywidgets",
    "ipython",
    "cloudpickle",
    "safetensors",
    "numpy",
    "psutil",
    "tqdm",
    "jupyterlab",
    "notebook",
    "accelerate",
)
# Variables that change how nbaccel runs; never the whole environment (it may hold secrets).
VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "PJRT_DEVICE",
    "TPU_NAME",
    "XLA_FLAGS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "OMP_NUM_THREADS",
)
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "AUTH")
_GIB = 1024**3


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel env`` to the command line."""
    parser = subparsers.add_parser(
        "env",
        help="print versions, devices and the detected environment (paste it into bug reports)",
        description=__doc__,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit code 0."""
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render_text(info))
    return 0


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _versions() -> dict[str, str | None]:
    import nbaccel

    versions: dict[str, str | None] = {
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "nbaccel": f"{nbaccel.__version__} ({os.path.dirname(nbaccel.__file__)})",
    }
    versions.update({name: _version(name) for name in PACKAGES})
    return versions


def _devices() -> dict[str, Any]:
    import psutil
    import torch
    import torch.distributed as dist

    memory = psutil.virtual_memory()
    cuda: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            cuda.append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_gib": round(props.total_memory / _GIB, 2),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "ram_total_gib": round(memory.total / _GIB, 2),
        "ram_available_gib": round(memory.available / _GIB, 2),
        "torch_cuda_build": torch.version.cuda,
        "torch_hip_build": getattr(torch.version, "hip", None),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": len(cuda),
        "cuda_devices": cuda,
        "mps_available": mps,
        "distributed_backends": [
            name
            for name, available in (
                ("gloo", dist.is_available() and dist.is_gloo_available()),
                ("nccl", dist.is_available() and dist.is_nccl_available()),
                ("mpi", dist.is_available() and dist.is_mpi_available()),
            )
            if available
        ],
    }


def _environment() -> dict[str, Any]:
    from dataclasses import asdict

    from nbaccel.distributed.environment import detect_launch_environment, detect_platform

    try:
        launch: dict[str, Any] = asdict(detect_launch_environment())
    except ValueError as exc:  # a bad variable is worth reporting, not a crash
        launch = {"error": str(exc)}
    names = [*VARIABLES, *sorted(n for n in os.environ if n.startswith("NBACCEL_"))]
    variables = {
        name: os.environ[name]
        for name in names
        if name in os.environ and not any(word in name.upper() for word in _SECRET_WORDS)
    }
    return {"detected": detect_platform(), "launch": launch, "variables": variables}


def collect() -> dict[str, Any]:
    """Everything ``nbaccel env`` reports, as plain JSON-serialisable data."""
    return {
        "os": platform.platform(),
        "executable": sys.executable,
        "versions": _versions(),
        "devices": _devices(),
        "environment": _environment(),
    }


_LABELS = {
    "colab": "Colab",
    "kaggle": "Kaggle",
    "slurm": "SLURM",
    "torchrun": "torchrun",
    "mpi": "MPI",
    "tpu": "TPU",
    "xla": "XLA requested",
    "nbaccel_worker": "nbaccel worker",
}


def _section(title: str, rows: list[tuple[str, Any]]) -> list[str]:
    width = max((len(key) for key, _ in rows), default=0)
    return [f"{title}:", *(f"  {key.ljust(width)}  {value}" for key, value in rows), ""]


def render_text(info: dict[str, Any]) -> str:
    """The report as readable text."""
    versions = [(k, v or "not installed") for k, v in info["versions"].items()]
    dev = info["devices"]
    devices: list[tuple[str, Any]] = [
        ("CPUs", f"{dev['cpu_count']} ({dev['usable_cpus']} usable by this process)"),
        ("RAM", f"{dev['ram_total_gib']} GiB ({dev['ram_available_gib']} GiB available)"),
        ("torch CUDA build", dev["torch_cuda_build"] or "none (CPU build)"),
        ("CUDA devices", dev["cuda_device_count"] if dev["cuda_available"] else "none"),
    ]
    devices += [
        (f"  cuda:{d['index']}", f"{d['name']}, {d['memory_gib']} GiB, sm {d['capability']}")
        for d in dev["cuda_devices"]
    ]
    devices += [
        ("MPS", "available" if dev["mps_available"] else "no"),
        ("torch.distributed", ", ".join(dev["distributed_backends"]) or "unavailable"),
    ]
    env = info["environment"]
    detected = [(_LABELS.get(k, k), "yes" if v else "no") for k, v in env["detected"].items()]
    launch = env["launch"]
    if "error" in launch:
        detected.append(("launch", f"ERROR: {launch['error']}"))
    else:
        detected.append(
            (
                "launch",
                f"{launch['source']}: rank {launch['rank']} of {launch['world_size']}, "
                f"local rank {launch['local_rank']} of {launch['local_world_size']}",
            )
        )
    lines = [
        "Copy and paste the text below into your bug report.",
        "",
        *_section("System", [("OS", info["os"]), ("executable", info["executable"])]),
        *_section("Versions", versions),
        *_section("Devices", devices),
        *_section("Environment", detected),
        *_section("Variables", list(env["variables"].items()) or [("(none set)", "")]),
    ]
    return "\n".join(lines).rstrip() + "\n"
