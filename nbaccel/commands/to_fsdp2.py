"""``nbaccel to-fsdp2``: convert a config file's FSDP1 options to FSDP2.

Options FSDP2 removed (backward prefetch, original parameters, module-state sync) are dropped,
``fsdp_sharding_strategy`` becomes ``fsdp_reshard_after_forward``, options not yet in FSDP2
(forward prefetch) are dropped with a warning, and ``fsdp_version`` becomes 2. Other keys are
kept. The result goes to ``--output_file``, or over the input with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from nbaccel.commands.parser import command_parser

__all__ = ["convert_config_to_fsdp2", "load_config", "register", "to_fsdp2_command",
           "to_fsdp2_command_parser"]  # fmt: skip

logger = logging.getLogger(__name__)

_REMOVED = ("fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states")
_NOT_YET = ("fsdp_forward_prefetch",)
# FSDP1 sharding strategy -> FSDP2 reshard_after_forward.
_RESHARD = {
    "FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False,
    "HYBRID_SHARD_ZERO2": False, "NO_SHARD": False,
}  # fmt: skip


def to_fsdp2_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``to-fsdp2`` parser (added to ``subparsers`` when given, else standalone)."""
    parser = command_parser(
        "to-fsdp2", subparsers, help="convert a config's FSDP1 options", description=__doc__
    )
    parser.add_argument("--config_file", required=True, help="the config file to convert")
    parser.add_argument("--output_file", default=None, help="where to write the result")
    parser.add_argument("--overwrite", action="store_true", help="write over --config_file")
    parser.set_defaults(handler=_handler)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel to-fsdp2`` to the command line."""
    to_fsdp2_command_parser(subparsers)


def load_config(config_file: str) -> dict[str, Any]:
    """The raw mapping of a YAML/JSON config file."""
    from nbaccel.commands.config.config_args import read_config_dict

    return read_config_dict(config_file)


def convert_config_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` whose ``fsdp_config`` holds FSDP2 options."""
    fsdp = dict(config.get("fsdp_config") or {})
    converted: dict[str, Any] = {}
    for key, value in fsdp.items():
        if key in _REMOVED:
            continue
        if key in _NOT_YET:
            logger.warning("%s is not available in FSDP2 yet; it was dropped.", key)
            continue
        if key == "fsdp_sharding_strategy":
            reshard = _RESHARD.get(str(value).upper())
            if reshard is None:
                raise ValueError(f"Unknown fsdp_sharding_strategy {value!r}: expected one of "
                                 f"{', '.join(_RESHARD)}.")  # fmt: skip
            converted["fsdp_reshard_after_forward"] = reshard
            continue
        converted[key] = value
    converted["fsdp_version"] = 2
    return {**config, "fsdp_config": converted}


def to_fsdp2_command(args: argparse.Namespace) -> None:
    """Convert ``args.config_file``; checks come before any file is read or written."""
    import yaml

    source = Path(args.config_file)
    if not source.exists():
        raise FileNotFoundError(f"Config file `{args.config_file}` not found.")
    if not args.overwrite and args.output_file is None:
        raise ValueError("If --overwrite is not set, --output_file must be provided.")
    target = source if args.overwrite else Path(args.output_file)
    if not args.overwrite and target.exists():
        raise FileExistsError(
            f"Output file `{args.output_file}` already exists and --overwrite is not set."
        )
    config = load_config(str(source))
    if (config.get("fsdp_config") or {}).get("fsdp_version", 1) == 2:
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        return
    converted = convert_config_to_fsdp2(config)
    with open(target, "w", encoding="utf-8") as handle:
        yaml.safe_dump(converted, handle, sort_keys=True)
    print(f"FSDP2 config written to {target}")


def _handler(args: argparse.Namespace) -> int:
    to_fsdp2_command(args)
    return 0
