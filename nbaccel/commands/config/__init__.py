"""``nbaccel config``: launch config files (questions, ``default``, ``update``) and their
format (:mod:`~nbaccel.commands.config.config_args`)."""

from __future__ import annotations

import argparse
from typing import Any

from nbaccel.commands.config.config import config_command, config_command_parser
from nbaccel.commands.config.config_args import default_config_file, load_config_from_file
from nbaccel.commands.config.default import default_config_command, write_basic_config
from nbaccel.commands.config.update import update_config_command

__all__ = [
    "config_command",
    "config_command_parser",
    "default_config_command",
    "default_config_file",
    "get_config_parser",
    "load_config_from_file",
    "register",
    "update_config_command",
    "write_basic_config",
]


def get_config_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``config`` parser (under ``subparsers`` when given)."""
    return config_command_parser(subparsers)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel config`` to the command line."""
    config_command_parser(subparsers)
