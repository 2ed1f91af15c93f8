"""``nbaccel runs``: this user's detached runs from a shell.

::

    nbaccel runs                      list them: id, name, state, ranks, hosts, started, last line
    nbaccel runs logs ID [--follow]   print a run's output (then live until it ends)
    nbaccel runs result ID            wait; print each rank's result (exit 1 if it failed)
    nbaccel runs stop ID              stop it as the stop button stops a launch
    nbaccel runs resume ID            launch its function and arguments again on fresh ranks
    nbaccel runs rm ID... | --older-than DAYS   remove ended runs' folders

An ID may be any unique start of a run's id. The runs live in ``$NBACCEL_RUNS_DIR``, else
``~/.nbaccel/runs`` (see ``nbaccel.launch.detached``).
"""

from __future__ import annotations

import argparse
import sys

from nbaccel.commands.parser import command_parser

__all__ = ["register", "runs_command", "runs_command_parser"]


def runs_command_parser(
    subparsers: argparse._SubParsersAction | None = None,
) -> argparse.ArgumentParser:
    """The parser of ``nbaccel runs``."""
    parser = command_parser(
        "runs", subparsers, help="list, follow, stop, resume or remove detached runs",
        description=__doc__.split("::")[0].strip(),
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", metavar="<action>")
    logs = actions.add_parser("logs", help="print a run's output")
    logs.add_argument("run_id", metavar="ID")
    logs.add_argument("--follow", "-f", action="store_true", help="live until the run ends")
    helps = {
        "result": "wait for a run; print its per-rank results",
        "stop": "stop a run (every rank, no orphans)",
        "resume": "relaunch a run's function and arguments on fresh ranks",
    }
    for name, text in helps.items():
        action = actions.add_parser(name, help=text)
        action.add_argument("run_id", metavar="ID")
    remove = actions.add_parser("rm", help="remove ended runs' folders")
    remove.add_argument("run_ids", nargs="*", metavar="ID")
    remove.add_argument(
        "--older-than", "--older_than", type=float, metavar="DAYS", dest="older_than",
        help="every run ended more than DAYS days ago",
    )  # fmt: skip
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel runs`` to the command line."""
    runs_command_parser(subparsers).set_defaults(handler=runs_command)


def runs_command(args: argparse.Namespace) -> int:
    """Do what ``args`` asks; the exit code."""
    from nbaccel.launch.detached.folder import remove_runs
    from nbaccel.launch.detached.handle import DetachedRun, RunStopped, current_runs
    from nbaccel.launch.detached.listing import listing_text
    from nbaccel.launch.wire.errors import failure_text, remote_traceback

    action = getattr(args, "action", None)
    if action is None:
        print(listing_text([info.row() for info in current_runs()], "no detached runs"))
        return 0
    if action == "rm":
        if not args.run_ids and args.older_than is None:
            raise ValueError("name the runs to remove, or give --older-than DAYS.")
        for run_id in remove_runs(args.run_ids, args.older_than):
            print(f"removed {run_id}")
        return 0
    try:
        run = DetachedRun(args.run_id)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    if action == "logs":
        try:
            run.follow(follow=args.follow)
        except KeyboardInterrupt:
            return 130
        return 0
    if action == "stop":
        info = run.stop()
        print(f"run {info.id}: {info.state}")
        return 0
    if action == "resume":
        run.resume()
        print(f"run {run.id} resumed: nbaccel runs logs {run.id} --follow")
        return 0
    try:  # result
        report = run.report()
    except RunStopped as exc:
        print(str(exc), file=sys.stderr)
        return 1
    failure = report.exception()
    if failure is not None:
        print(f"run {run.id} failed: {failure_text(failure)}", file=sys.stderr)
        remote = remote_traceback(failure)
        if remote:
            print(remote, file=sys.stderr)
        return 1
    for rank, value in enumerate(report.values()):
        print(f"[rank {rank}] {value!r}")
    return 0
