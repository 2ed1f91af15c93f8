"""``nbaccel env``: versions, devices and the detected environment, for bug reports."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from shutil import which
from typing import Any

from nbaccel.commands.parser import command_parser

__all__ = ["collect", "env_command", "env_command_parser", "register", "render_text"]

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
    "NBACCEL_PRELOAD",
    "NBACCEL_KEEP_FREED_MEMORY",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
)
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "AUTH")
_GIB = 1024**3


def env_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``env`` parser (added to ``subparsers`` when given, else standalone)."""
    parser = command_parser(
        "env",
        subparsers,
        help="print versions, devices and the detected environment (paste it into bug reports)",
        description=__doc__,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--config_file", default=None, help="a launch config file to include in the report"
    )
    parser.set_defaults(handler=run)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel env`` to the command line."""
    env_command_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit code 0."""
    info = collect()
    config = _config(getattr(args, "config_file", None))
    if config is not None:
        info["config"] = config
    print(json.dumps(info, indent=2) if args.json else render_text(info))
    return 0


def _config(path: str | None) -> dict[str, Any] | str | None:
    """The launch config (the given file, else the default one when it exists)."""
    from nbaccel.commands.config.config_args import default_config_file, load_config_from_file

    path = path or (default_config_file if os.path.isfile(default_config_file) else None)
    if path is None:
        return None
    try:
        return load_config_from_file(path).to_dict()
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"


def env_command(args: argparse.Namespace) -> dict[str, Any]:
    """Accelerate's ``env`` summary: print it as a bulleted list and return it as a dict."""
    import torch

    versions = _versions()
    config = _config(getattr(args, "config_file", None))
    info: dict[str, Any] = {
        "`nbaccel` version": versions["nbaccel"],
        "Platform": platform.platform(),
        "`nbaccel` bash location": which("nbaccel") or "Not found",
        "Python version": platform.python_version(),
        "Numpy version": versions.get("numpy") or "not installed",
        "PyTorch version": f"{torch.__version__} (cuda: {torch.cuda.is_available()})",
        "System RAM": f"{_devices()['ram_total_gib']} GiB",
    }
    if torch.cuda.is_available():
        info["GPU type"] = torch.cuda.get_device_name()
    info["`nbaccel` configs"] = config if config is not None else "Not found"
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    for key, value in info.items():
        if isinstance(value, dict):
            value = "\n" + "\n".join(f"\t- {k}: {v}" for k, v in value.items())
        print(f"- {key}: {value}")
    return info


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
        "preload": _preload(),
    }


def _preload() -> dict[str, Any]:
    """What ranks start with: the preload setting and, in a process that runs a fork server
    (a notebook kernel calling :func:`collect`), what the server imported and kept out."""
    from nbaccel.launch.launchers.forkserver.launcher import preload_report

    return preload_report()


def _preload_rows(report: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [("setting", report["setting"])]
    if "server_pid" in report:
        rss = report.get("server_rss")
        memory = f", {rss / 2**20:.0f} MiB resident" if rss else ""
        rows.append(("fork server", f"pid {report['server_pid']}{memory}"))
        rows.append(
            (
                "preloaded",
                f"{', '.join(report['preloaded']) or 'nothing beyond torch'} "
                f"({report['import_seconds']} s of imports)",
            )
        )
    else:
        rows.append(("fork server", "none in this process (a notebook's kernel runs one)"))
    for module, why in report["refused"].items():
        rows.append((f"kept out: {module}", why))
    return rows


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
    preload = info.get("preload")
    lines = [
        "Copy and paste the text below into your bug report.",
        "",
        *_section("System", [("OS", info["os"]), ("executable", info["executable"])]),
        *_section("Versions", versions),
        *_section("Devices", devices),
        *_section("Environment", detected),
        *_section("Variables", list(env["variables"].items()) or [("(none set)", "")]),
        *(_section("Ranks start with", _preload_rows(preload)) if preload else ()),
    ]
    return "\n".join(lines).rstrip() + "\n"
