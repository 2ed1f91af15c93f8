"""``nbaccel merge-weights``: merge a sharded FSDP checkpoint into one weights file.

``nbaccel merge-weights ckpt/pytorch_model_fsdp_0 out/`` writes ``out/model.safetensors``
(``pytorch_model.bin`` with ``--unsafe_serialization``), loadable into the plain model.
"""

from __future__ import annotations

import argparse
from typing import Any

from nbaccel.commands.parser import command_parser

__all__ = ["merge_command", "merge_command_parser", "register"]


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser (added to ``subparsers`` when given, else standalone)."""
    parser = command_parser(
        "merge-weights", subparsers, help="merge a sharded FSDP checkpoint", description=__doc__
    )
    parser.add_argument("checkpoint_directory", help="the sharded checkpoint folder")
    parser.add_argument("output_path", help="folder (or .safetensors/.bin file) to write")
    parser.add_argument(
        "--unsafe_serialization", action="store_true", help="write pytorch_model.bin (pickle)"
    )
    parser.add_argument(
        "--remove_checkpoint_dir", action="store_true", help="delete the shards afterwards"
    )
    parser.set_defaults(handler=_handler)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel merge-weights`` to the command line."""
    merge_command_parser(subparsers)


def merge_command(args: argparse.Namespace) -> str:
    """Merge; return the written file's path."""
    from nbaccel.training.strategies.fsdp.checkpoint import merge_fsdp_weights

    return merge_fsdp_weights(
        args.checkpoint_directory,
        args.output_path,
        safe_serialization=not args.unsafe_serialization,
        remove_checkpoint_dir=args.remove_checkpoint_dir,
    )


def _handler(args: argparse.Namespace) -> int:
    print(f"Merged weights written to {merge_command(args)}")
    return 0
