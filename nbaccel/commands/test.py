"""``nbaccel test``: launch nbaccel's end-to-end check script with your config.

Runs ``nbaccel launch [--config_file FILE] .../testing/scripts/test_script.py`` and says whether
the setup works (exit code 0) or fails (the script's exit code, with its output above).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from nbaccel.commands.parser import command_parser

__all__ = ["register", "test_command", "test_command_parser"]


def test_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``test`` parser (added to ``subparsers`` when given, else standalone)."""
    parser = command_parser(
        "test", subparsers, help="check that launches work here", description=__doc__
    )
    parser.add_argument("--config_file", default=None, help="config file to launch with")
    parser.set_defaults(handler=_handler)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel test`` to the command line."""
    test_command_parser(subparsers)


def test_command(args: argparse.Namespace) -> int:
    """Launch the check script; raise ``CalledProcessError`` when it fails."""
    from nbaccel.testing.subprocesses import path_in_nbaccel_package

    script = path_in_nbaccel_package("test_utils", "scripts", "test_script.py")
    cmd = [sys.executable, "-m", "nbaccel", "launch"]
    if args.config_file is not None:
        cmd += ["--config_file", str(args.config_file)]
    cmd.append(str(script))
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd)
    print("Test is a success! You are ready for your distributed training!")
    return 0


test_command.__test__ = False  # a command, not a pytest test


def _handler(args: argparse.Namespace) -> int:
    try:
        return test_command(args)
    except subprocess.CalledProcessError as exc:
        print(f"nbaccel test: the check script failed (exit code {exc.returncode}).",
              file=sys.stderr)  # fmt: skip
        return exc.returncode
