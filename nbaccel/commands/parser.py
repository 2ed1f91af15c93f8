"""How each command builds its parser: standalone (``python -m nbaccel.commands.X``, or a test
calling ``X_command_parser()``, as Accelerate's API allows) or as a subcommand of ``nbaccel``."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["command_parser"]


def command_parser(
    name: str, subparsers: Any = None, *, prog: str | None = None, help: str | None = None,
    **options: Any,
) -> argparse.ArgumentParser:  # fmt: skip
    """The parser of command ``name``: added to ``subparsers`` (with its one-line ``help``)
    when given, else a standalone parser named ``prog`` (default ``nbaccel NAME``).
    ``options`` (description, parents, formatter_class...) go to both."""
    if subparsers is not None:
        return subparsers.add_parser(name, help=help, **options)
    return argparse.ArgumentParser(prog or f"nbaccel {name}", **options)
