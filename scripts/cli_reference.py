#!/usr/bin/env python3
"""The command line's reference page, generated from ``nbaccel``'s own argparse parser.

    python scripts/cli_reference.py     # print the Markdown page

The docs build calls :func:`render` (``scripts/docs_hooks.py``): every subcommand (nested ones,
such as ``nbaccel config default``, included) with its usage, description and every flag, its
default and help, exactly as ``nbaccel.cli.build_parser()`` defines them. A command or flag added
in ``nbaccel/commands/`` appears without editing the page.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["render"]


def _home_as_tilde(text: str) -> str:
    """Paths under this machine's home directory as ``~/...`` (the page is not this machine's)."""
    home = os.path.expanduser("~")
    return text.replace(home, "~") if home not in ("", "/") else text


def _cell(text: object) -> str:
    return _home_as_tilde(str(text)).replace("|", "\\|").replace("\n", " ")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of each subcommand of ``parser``, in order."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return ""
    if action.default in (None, argparse.SUPPRESS) or action.required:
        return ""
    return f"`{_cell(action.default)}`"


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        names = action.option_strings or [action.metavar or action.dest]
        spelled = ", ".join(f"`{n}`" for n in names)
        if action.option_strings and action.nargs != 0:
            metavar = action.metavar or (
                "{" + ",".join(map(str, action.choices)) + "}"
                if action.choices
                else action.dest.upper()
            )
            spelled += f" `{_cell(metavar)}`"
        what = _cell(action.help or "")
        if action.choices and not action.option_strings:
            what += f" (one of {', '.join(f'`{c}`' for c in action.choices)})"
        rows.append(f"| {spelled} | {_default(action)} | {what} |")
    if not rows:
        return []
    return ["| flag | default | what |", "|---|---|---|", *rows, ""]


def _command(name: str, summary: str, parser: argparse.ArgumentParser, depth: int) -> list[str]:
    lines = [f"{'#' * depth} `{name}`", ""]
    about = parser.description or summary
    if about:
        lines += [_home_as_tilde(about.strip()), ""]
    usage = parser.format_usage().strip().removeprefix("usage: ")
    lines += ["```text", _home_as_tilde(usage), "```", ""]
    lines += _flags(parser)
    for sub_name, sub_summary, sub in _subcommands(parser):
        lines += _command(f"{name} {sub_name}", sub_summary, sub, min(depth + 1, 6))
    return lines


def render() -> str:
    """The Markdown page: every command and flag of ``nbaccel``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from nbaccel.cli import build_parser

    parser = build_parser()
    lines = [
        "# Command line",
        "",
        "`nbaccel` is installed with the package (`python -m nbaccel` runs the same). This page "
        "is generated from its parser when the site is built, so it lists every command and "
        "flag there is. `nbaccel COMMAND --help` prints the same in a terminal. The launch "
        "flags are the [launch options](launch-options.md), which also lists what each is "
        "called in `notebook_launcher` and `%%distributed`; Accelerate's spellings "
        "(`--num_processes`) and hyphenated ones (`--num-processes`) both work.",
        "",
        "## Commands",
        "",
        "| command | what |",
        "|---|---|",
    ]
    commands = _subcommands(parser)
    lines += [f"| [`nbaccel {n}`](#nbaccel-{n}) | {_cell(s)} |" for n, s, _ in commands]
    lines += ["", "Top-level flags:", "", *_flags(parser)]
    for name, summary, sub in commands:
        lines += _command(f"nbaccel {name}", summary, sub, 2)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
