"""``nbaccel tpu-config``: run set-up commands on every host of a TPU pod through ``gcloud``.

The commands come from ``--command`` (repeatable), ``--command_file`` (one per line) or the
config file's ``commands``/``command_file``; they run from ``/usr/share`` on all workers, after
``pip install nbaccel`` when ``--install_nbaccel`` is given. ``--debug`` prints the ``gcloud``
command instead of running it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any

from nbaccel.commands.parser import command_parser

__all__ = ["register", "tpu_command_launcher", "tpu_command_parser"]


def tpu_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``tpu-config`` parser (added to ``subparsers`` when given, else standalone)."""
    parser = command_parser(
        "tpu-config", subparsers, help="run commands on a TPU pod", description=__doc__
    )
    config = parser.add_argument_group("Config", "Where the pod's settings come from.")
    config.add_argument("--config_file", default=None, help="config file with the pod's settings")
    config.add_argument("--tpu_name", default=None, help="the TPU's name (else the config's)")
    config.add_argument("--tpu_zone", default=None, help="the TPU's zone (else the config's)")
    pod = parser.add_argument_group("TPU", "What runs on the pod.")
    pod.add_argument("--use_alpha", action="store_true", help="use `gcloud alpha`")
    pod.add_argument("--command_file", default=None, help="file with one command per line")
    pod.add_argument("--command", action="append", nargs="+", help="a command (repeatable)")
    pod.add_argument("--install_nbaccel", action="store_true", help="pip install nbaccel first")
    pod.add_argument(
        "--nbaccel_version", default="latest", help="version to install (default: latest)"
    )
    pod.add_argument("--debug", action="store_true", help="print the command, do not run it")
    parser.set_defaults(handler=_handler)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel tpu-config`` to the command line."""
    tpu_command_parser(subparsers)


def _fill_from_config(args: argparse.Namespace) -> None:
    from nbaccel.commands.config.config_args import default_config_file, load_config_from_file

    path = args.config_file
    if path is None and os.path.isfile(default_config_file):
        path = default_config_file
    if path is None:
        return
    config = load_config_from_file(path)
    args.tpu_name = args.tpu_name or getattr(config, "tpu_name", None)
    args.tpu_zone = args.tpu_zone or getattr(config, "tpu_zone", None)
    if not args.command and not args.command_file:
        if getattr(config, "command_file", None):
            args.command_file = config.command_file
        elif getattr(config, "commands", None):
            args.command = [[c] for c in config.commands]


def _commands(args: argparse.Namespace) -> list[str]:
    commands: list[str] = []
    if args.command_file:
        with open(args.command_file, encoding="utf-8") as handle:
            commands += [line.strip() for line in handle if line.strip()]
    if args.command:
        commands += [" ".join(part) for part in args.command]
    if not commands:
        raise ValueError("No command to run: pass --command, --command_file or a config file "
                         "with commands.")  # fmt: skip
    setup = ["cd /usr/share"]
    if args.install_nbaccel:
        version = args.nbaccel_version
        if version == "latest":
            setup.append("pip install nbaccel -U")
        else:
            setup.append(f"pip install nbaccel=={version}")
    return setup + commands


def tpu_command_launcher(args: argparse.Namespace) -> None:
    """Build the ``gcloud ... tpu-vm ssh`` command and run it (print it with ``--debug``)."""
    _fill_from_config(args)
    if not args.tpu_name or not args.tpu_zone:
        raise ValueError("The TPU's name and zone are needed: pass --tpu_name and --tpu_zone, "
                         "or a config file with tpu_name and tpu_zone.")  # fmt: skip
    cmd = ["gcloud", *(["alpha"] if args.use_alpha else [])]
    cmd += ["compute", "tpus", "tpu-vm", "ssh", args.tpu_name, "--zone", args.tpu_zone]
    cmd += ["--command", "; ".join(_commands(args)), "--worker", "all"]
    if args.debug:
        print(f"Running {' '.join(cmd)}")
        return
    subprocess.run(cmd, check=True)
    print("Successfully set up the pod.")


def _handler(args: argparse.Namespace) -> int:
    tpu_command_launcher(args)
    return 0
