"""``nbaccel config update``: rewrite an existing config file with today's fields.

A file written by an older version (a single ``fp16: true`` key, ``dynamo_backend`` at the top,
missing keys) is read, completed with the current defaults and written back in place.
"""

from __future__ import annotations

import argparse

from nbaccel.commands.config.config_args import default_config_file, load_config_from_file
from nbaccel.commands.parser import command_parser

__all__ = ["update_command_parser", "update_config", "update_config_command"]


def update_config(config_file: str | None = None) -> str:
    """Rewrite ``config_file`` (default: the default config file); return its path."""
    path = config_file or default_config_file
    config = load_config_from_file(path)
    if str(path).endswith(".json"):
        config.to_json_file(path)
    else:
        config.to_yaml_file(path)
    return str(path)


def update_command_parser(
    parser: argparse.ArgumentParser | None = None, parents: list | None = None
) -> argparse.ArgumentParser:
    """The parser of ``nbaccel config update``."""
    description = "Rewrite a config file with the current fields (older files are upgraded)."
    target = command_parser(
        "update", parser, prog="nbaccel config update", help=description,
        description=description, parents=parents or [],
    )  # fmt: skip
    target.add_argument(
        "--config_file", default=None,
        help=f"the file to update (default: {default_config_file})",
    )  # fmt: skip
    target.set_defaults(handler=update_config_command)
    return target


def update_config_command(args: argparse.Namespace) -> int:
    """Update the file; exit code 0."""
    path = update_config(args.config_file)
    print(f"Successfully updated the configuration file at {path}.")
    return 0
