"""``nbaccel config default``: write a config file for this machine without any question."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from nbaccel.commands.config.config_args import ClusterConfig, default_config_file
from nbaccel.commands.parser import command_parser

__all__ = ["default_command_parser", "default_config_command", "write_basic_config"]

_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike = default_config_file
) -> Path | bool:
    """Write a config for every device of this machine (all GPUs, else one CPU process).

    Returns the path written, or ``False`` (writing nothing) when a file is already there.
    The file is JSON, which YAML readers read too (as Accelerate writes it).
    """
    import torch

    path = Path(save_location)
    if path.exists():
        print(
            f"Configuration already exists at {path}, will not override it. Delete it first, or "
            "edit it with `nbaccel config`."
        )
        return False
    precision = str(mixed_precision).lower()
    if precision not in _PRECISIONS:
        raise ValueError(
            f"mixed_precision must be one of {', '.join(_PRECISIONS)}, not {mixed_precision!r}."
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    config = ClusterConfig(
        compute_environment="LOCAL_MACHINE",
        distributed_type="MULTI_GPU" if gpus > 1 else "NO",
        mixed_precision=precision,
        use_cpu=gpus == 0,
        debug=False,
        num_processes=max(gpus, 1),
        gpu_ids="all" if gpus else None,
    )
    config.to_json_file(path)
    return path


def default_command_parser(
    parser: argparse.ArgumentParser | None = None, parents: list | None = None
) -> argparse.ArgumentParser:
    """The parser of ``nbaccel config default`` (added under ``parser``'s subcommands when
    given)."""
    description = "Write a config file for this machine: every GPU, else one CPU process."
    target = command_parser(
        "default", parser, prog="nbaccel config default", help=description,
        description=description, parents=parents or [],
    )  # fmt: skip
    target.add_argument(
        "--config_file", default=default_config_file,
        help=f"where to write it (default: {default_config_file})",
    )  # fmt: skip
    target.add_argument(
        "--mixed_precision", choices=_PRECISIONS, default="no",
        help="precision the launches default to",
    )  # fmt: skip
    target.set_defaults(handler=default_config_command)
    return target


def default_config_command(args: argparse.Namespace) -> int:
    """Write the file; exit code 0 when written, 1 when one was already there."""
    path = write_basic_config(args.mixed_precision, args.config_file)
    if path:
        print(f"nbaccel configuration saved at {path}")
        return 0
    return 1
