"""The ``nbaccel`` command line: a small dispatcher over ``nbaccel/commands/``.

Every module in :mod:`nbaccel.commands` whose name does not start with ``_`` and that defines
``register(subparsers)`` is a subcommand (helpers such as ``commands/parser.py`` define none):
``register`` adds its parser and sets ``handler`` (a function taking the parsed arguments and
returning an exit code) with ``parser.set_defaults(handler=...)``.
A handler's ``ValueError``/``OSError``/``NotImplementedError`` (bad input) is printed as one
line naming the command, with exit code 2.
Adding a command means adding a file; this module does not change. Command modules import heavy
libraries (torch) inside their handlers, so ``nbaccel --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence

__all__ = ["build_parser", "main"]


def _broken_command(name: str, error: BaseException) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        print(f"nbaccel {name} is unavailable: {type(error).__name__}: {error}", file=sys.stderr)
        return 1

    return handler


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per module in ``nbaccel.commands``."""
    import nbaccel
    import nbaccel.commands

    parser = argparse.ArgumentParser(
        prog="nbaccel",
        description="Jupyter-native distributed training and big-model inference for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"nbaccel {nbaccel.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for info in sorted(pkgutil.iter_modules(nbaccel.commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"nbaccel.commands.{info.name}")
            if not hasattr(module, "register"):  # a helper of the commands, not a command
                continue
            module.register(subparsers)
        except Exception as exc:  # one broken command must not take `nbaccel env` down with it
            name = info.name.replace("_", "-")
            stub = subparsers.add_parser(name, help=f"(unavailable: {type(exc).__name__})")
            stub.set_defaults(handler=_broken_command(name, exc))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nbaccel <command> ...``; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 1
    try:
        return int(handler(args) or 0)
    except (ValueError, OSError, NotImplementedError) as exc:  # bad input: say it, no trace
        print(f"nbaccel {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
