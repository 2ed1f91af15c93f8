"""``nbaccel pools``: this user's detached pools (``%%distributed --detach``) from a shell.

::

    nbaccel pools              list them: id, ranks, started, last cell, attached, memory
    nbaccel pools stop ID      end one now: its ranks and host end, nothing is left

An ID may be any unique start of a pool's id. The pools live under ``$NBACCEL_RUNS_DIR``
(else ``~/.nbaccel/runs``), in ``pools/``, and are served by the same supervisor as detached
runs (see ``nbaccel.launch.detached``).
"""

from __future__ import annotations

import argparse

from nbaccel.commands.parser import command_parser

__all__ = ["pools_command", "pools_command_parser", "register"]


def pools_command_parser(
    subparsers: argparse._SubParsersAction | None = None,
) -> argparse.ArgumentParser:
    """The parser of ``nbaccel pools``."""
    parser = command_parser(
        "pools", subparsers, help="list or stop detached pools (%%distributed --detach)",
        description=__doc__.split("::")[0].strip(),
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", metavar="<action>")
    stop = actions.add_parser("stop", help="end a detached pool now (every rank, no leftovers)")
    stop.add_argument("pool_id", metavar="ID")
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel pools`` to the command line."""
    pools_command_parser(subparsers).set_defaults(handler=pools_command)


def pools_command(args: argparse.Namespace) -> int:
    """Do what ``args`` asks; the exit code."""
    from nbaccel.launch.detached.listing import listing_text
    from nbaccel.launch.detached.pool_folder import list_pools

    if getattr(args, "action", None) is None:
        print(listing_text([info.row() for info in list_pools()], "no detached pools"))
        return 0
    from nbaccel.notebook.kernel.detached_pool import stop_detached_pool

    stopped = stop_detached_pool(args.pool_id)
    print(f"pool {args.pool_id}: {'stopped' if stopped else 'no supervisor holds it'}")
    return 0 if stopped else 1
