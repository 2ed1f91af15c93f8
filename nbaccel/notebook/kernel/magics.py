"""IPython magics: ``%%distributed`` on a persistent pool, push/pull, status, auto mode.

``%load_ext nbaccel`` registers them. Every magic takes ``--help``. See
``nbaccel.notebook.kernel.pool`` for the pool itself (and its Python API).
"""

from __future__ import annotations

import ast
import atexit
import linecache
import re
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from nbaccel.distributed.host_info import check_fp8_launch
from nbaccel.launch.launchers.forkserver.launcher import warm_up
from nbaccel.launch.options.accelerate_env import accelerate_environment
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.wire.errors import LaunchTimeout, add_note
from nbaccel.notebook.kernel import pool as pool_module
from nbaccel.notebook.kernel.cell_renderer import CellRenderer, status_bundle
from nbaccel.notebook.kernel.detached_pool import pools
from nbaccel.notebook.kernel.rank_spec import parse_names, parse_ranks
from nbaccel.notebook.preload import POOL_PRELOAD
from nbaccel.values.booleans import parse_bool

__all__ = ["DistributedMagics", "load_ipython_extension", "unload_ipython_extension"]

_NAME_ERROR = re.compile(r"name '(\w+)' is not defined")
_KNOWN_LINES = 64  # parsed %%distributed lines kept (DistributedMagics._options)


def _launch_options(magic: Callable[..., Any]) -> Callable[..., Any]:
    """Declare the launch options that apply to ``%%distributed`` (``Front.MAGIC`` in
    :class:`~nbaccel.launch.request.LaunchRequest`), in their order there."""
    for flags, keywords in reversed(LaunchRequest.arguments(Front.MAGIC).values()):
        magic = argument(*flags, **keywords)(magic)
    return magic


@contextmanager
def _bad_input_is_usage() -> Iterator[None]:
    """Turn a ValueError from option parsing into IPython's UsageError (a clean message)."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@magics_class
class DistributedMagics(Magics):
    """``%%distributed``, ``%dist_push``, ``%dist_pull``, ``%dist_status``, ``%dist_restart``,
    ``%dist_shutdown``, ``%dist_attach``, ``%dist_mode`` and ``%%local``."""

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell, **kwargs)
        #: ``%dist_mode``'s state and the input transformer that acts on it
        self.auto_mode = AutoMode()
        #: %%distributed lines seen lately, parsed: a warm cell parses nothing (see _options)
        self._known_lines: dict[str, tuple[Namespace, LaunchRequest, list[str]]] = {}

    def _options(self, line: str) -> tuple[Namespace, LaunchRequest, list[str]] | None:
        """``%%distributed``'s line parsed: its flags, its launch request and its --push names
        (None after printing the help). A line always parses the same way, so the answer for
        the last lines is kept: re-running cells costs no argument parsing."""
        known = self._known_lines.get(line)
        if known is None:
            args = self._parse(self.distributed, line)
            if args is None:
                return None
            with _bad_input_is_usage():
                request = LaunchRequest.from_parsed(args, Front.MAGIC)
                known = (args, request, parse_names(args.push))
            if len(self._known_lines) >= _KNOWN_LINES:
                self._known_lines.clear()
            self._known_lines[line] = known
        return known

    def _parse(self, magic: Any, line: str) -> Namespace | None:
        """Parsed options, or None after printing the help for ``-h``/``--help``."""
        if {"-h", "--help"} & set(arg_split(line)):
            text = magic.parser.format_help().replace("::\n\n  %", "usage: %", 1)
            if magic.__name__ in ("distributed", "local"):
                text = text.replace("usage: %", "usage: %%", 1)
            print(text.rstrip())
            return None
        return magic.parser.parse_argstring(line)

    def _renderer(self, quiet: bool = False) -> CellRenderer:
        return CellRenderer(quiet=quiet)

    def _pool(self) -> pool_module.Pool:
        pool = pool_module.get_pool()
        if pool is None:
            raise UsageError("no pool is running: start one with a %%distributed -n N cell.")
        return pool

    def _check_syntax(self, cell: str, filename: str) -> None:
        """Refuse a cell that is not plain Python before it reaches the ranks.

        Line numbers are the notebook's (the magic's line is line 1). ``!cmd`` and ``%magic``
        lines are IPython syntax, run by the notebook's shell; the ranks run plain Python.
        """
        __tracebackhide__ = True
        try:
            compile("\n" + cell, filename, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError:
            transform = getattr(self.shell, "transform_cell", None)
            for number, text in enumerate(cell.splitlines(), start=2):
                if transform is None or not text.strip():
                    continue
                if "get_ipython()" in transform(text) and "get_ipython()" not in text:
                    raise UsageError(
                        f"line {number}: {text.strip()!r} is IPython syntax (a shell command or "
                        "a magic), which the ranks cannot run: a %%distributed cell is plain "
                        "Python. Use subprocess.run(...) or os.system(...) for shell commands "
                        "on the ranks, and run magics in a cell of their own."
                    ) from None
            raise

    def _notebook_values(self, names: list[str]) -> dict[str, Any]:
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}.")
        return {name: self.shell.user_ns[name] for name in names}

    # ------------------------------------------------------------------ %%distributed
    @magic_arguments()
    @_launch_options  # -n, --mixed_precision, --backend, --timeout, --hosts ...: LaunchRequest's
    @argument(
        "--slurm",
        dest="launcher",
        action="store_const",
        const="slurm",
        help="the same as --launcher slurm: the ranks on this SLURM allocation's nodes.",
    )
    @argument("--ranks", metavar="SPEC", help="run on these ranks only: 0, 0,2 or 1-3.")
    @argument(
        "--push",
        action="append",
        metavar="NAMES",
        help="notebook variables to send to the ranks first (comma-separated).",
    )
    @argument(
        "--quiet",
        action="store_true",
        help="hide printed output, displays and values (stderr and errors still show).",
    )
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> None:
        """Run the cell on every rank (or --ranks) of a persistent pool of worker processes.

        The first cell starts the pool; names defined on the ranks stay there for the next
        %%distributed cell. Output is labelled by rank, and so is the last expression's value.
        """
        __tracebackhide__ = True
        options = self._options(line)
        if options is None:
            return
        if cell is None:
            raise UsageError(
                "%%distributed is a cell magic: put it (with two %) on the first line of a cell."
            )
        args, request, names = options
        check_fp8_launch(request.mixed_precision, request.cpu)  # before a pool starts or runs
        push = self._notebook_values(names)
        filename = self._register_source(line, cell)
        self._check_syntax(cell, filename)
        renderer = self._renderer(args.quiet)
        pool = self._ensure_pool(request, renderer)
        with _bad_input_is_usage():
            ranks = parse_ranks(args.ranks, pool.num_processes)
        env = self._cell_environment(args, request) or None
        ok = False
        try:
            values = pool.run_cell(cell, ranks, push, request.timeout, filename, 2, env, renderer)
            ok = True
        except Exception as exc:
            _show_values(renderer, getattr(exc, "rank_results", {}))
            if isinstance(exc, NameError):
                self._hint_push(exc)
            if getattr(exc, "rank", None) is None and not isinstance(exc, LaunchTimeout):
                raise
            # the pool's frames are noise; re-raising the handled exception keeps its chain
            raise exc.with_traceback(None)  # noqa: B904
        except KeyboardInterrupt as exc:
            if getattr(exc, "rank", None) is not None:  # raised by the rank's code: its error
                _show_values(renderer, getattr(exc, "rank_results", {}))
                raise exc.with_traceback(None)  # noqa: B904 - its own chain kept
            raise KeyboardInterrupt from None
        finally:
            renderer.finish(ok)
        _show_values(renderer, values)

    @staticmethod
    def _cell_environment(args: Namespace, request: LaunchRequest) -> dict[str, str]:
        """Accelerate's launch variables for what this cell's line asked (``--mixed_precision``,
        ``--parallelism_config_*``): set on the pool's ranks for this cell only."""
        settings = {
            name: value
            for name, value in request.accelerate_settings().items()
            if name.startswith("parallelism_config_") or name.startswith("megatron_lm_")
        }
        if args.mixed_precision:
            settings["mixed_precision"] = request.mixed_precision
        return accelerate_environment(settings)

    def _register_source(self, line: str, cell: str) -> str:
        """Put the cell in the notebook's linecache so the ranks' tracebacks show its lines."""
        count = self.shell.execution_count - 1  # IPython counts the running cell already
        filename = f"<rank-cell-{max(count, 0)}>"
        text = f"%%distributed {line}".rstrip() + "\n" + cell
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        return filename

    def _ensure_pool(self, request: LaunchRequest, renderer: CellRenderer) -> pool_module.Pool:
        """The running pool when it serves this cell (``pool_module.start_pool`` decides), else
        a fresh one, timed."""
        running = pool_module.get_pool()
        started = time.perf_counter()
        with _bad_input_is_usage():
            pool = pool_module.start_pool(request, renderer)
        if pool is not running and not renderer.quiet:  # news, not a warning: stdout
            print(f"[nbaccel] pool ready in {time.perf_counter() - started:.1f} s.", flush=True)
        return pool

    def _hint_push(self, exc: NameError) -> None:
        match = _NAME_ERROR.search(str(exc))
        if match and match.group(1) in self.shell.user_ns:
            name = match.group(1)
            add_note(
                exc,
                f"{name!r} exists in the notebook: send it to the ranks with %dist_push {name} (or "
                f"--push {name} on this cell).",
            )

    # ------------------------------------------------------------------ names
    @magic_arguments()
    @argument("names", nargs="*", metavar="NAME", help="notebook variables to send.")
    @argument("--ranks", metavar="SPEC", help="only these ranks: 0, 0,2 or 1-3.")
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_magic
    def dist_push(self, line: str) -> None:
        """Send notebook variables to the ranks (large CPU tensors through shared memory)."""
        __tracebackhide__ = True
        args = self._parse(self.dist_push, line)
        if args is None:
            return
        with _bad_input_is_usage():
            names = parse_names(args.names)
        if not names:
            raise UsageError("name at least one notebook variable: %dist_push x [y ...]")
        values = self._notebook_values(names)
        pool = self._pool()
        with _bad_input_is_usage():
            ranks = parse_ranks(args.ranks, pool.num_processes)
        pool.push(values, ranks=ranks, renderer=self._renderer())

    @magic_arguments()
    @argument("names", nargs="*", metavar="NAME", help="names defined on the ranks.")
    @argument("--rank", type=int, default=0, metavar="R", help="the rank to read (default 0).")
    @argument("--all", action="store_true", help="a list with every rank's value, by rank.")
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_magic
    def dist_pull(self, line: str) -> None:
        """Bring values from a rank (or --all ranks) into the notebook namespace."""
        __tracebackhide__ = True
        args = self._parse(self.dist_pull, line)
        if args is None:
            return
        with _bad_input_is_usage():
            names = parse_names(args.names)
        if not names:
            raise UsageError("name at least one variable: %dist_pull x [--rank R | --all]")
        pool = self._pool()
        with _bad_input_is_usage():
            ranks = pool.ranks if args.all else parse_ranks(str(args.rank), pool.num_processes)
        for name in names:
            values = pool.pull(name, ranks=ranks, renderer=self._renderer())
            self.shell.user_ns[name] = [values[r] for r in ranks] if args.all else values[ranks[0]]

    # ------------------------------------------------------------------ lifecycle
    @magic_arguments()
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_magic
    def dist_status(self, line: str) -> None:
        """The pool's ranks: pid, device, memory, busy/idle and uptime."""
        if self._parse(self.dist_status, line) is None:
            return
        from IPython.display import display

        pool = pool_module.get_pool()
        if pool is None:
            print("No pool is running.")
        else:
            header = f"Pool of {pool.describe()}"
            display(status_bundle(pool.status(), header), raw=True)
        found = pools()
        if found:
            print("Detached pools of this user:")
            display(found)

    @magic_arguments()
    @argument("pool_id", nargs="?", metavar="ID", help="the pool (default: the newest).")
    @argument("--takeover", action="store_true", help="take it from the kernel that holds it.")
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_magic
    def dist_attach(self, line: str) -> None:
        """Make a detached pool (%%distributed --detach) this kernel's pool, names intact."""
        args = self._parse(self.dist_attach, line)
        if args is None:
            return
        try:
            pool = pool_module.attach_pool(args.pool_id, args.takeover)
        except (ValueError, RuntimeError) as exc:
            raise UsageError(str(exc)) from None
        info, welcome = pool.info(), pool.welcome
        last = f"; last cell: {info.last_cell}" if info.last_cell else ""
        print(f"Attached to the detached pool {pool.id}: {pool.describe()}{last}.")
        taken = welcome.get("taken_from")
        if taken:
            print(f"[nbaccel] took it over from kernel pid {taken.get('pid')}.", file=sys.stderr)
        if welcome.get("lost"):
            print(f"[nbaccel] {welcome['lost']}", file=sys.stderr)

    @magic_arguments()
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_magic
    def dist_restart(self, line: str) -> None:
        """Restart the pool with the same settings; names defined on the ranks are lost."""
        if self._parse(self.dist_restart, line) is None:
            return
        pool = self._pool()
        started = time.perf_counter()
        pool.restart(self._renderer())
        print(
            f"Restarted the pool of {pool.describe()} in {time.perf_counter() - started:.1f} s; "
            "names defined on the ranks are gone."
        )

    @magic_arguments()
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_magic
    def dist_shutdown(self, line: str) -> None:
        """Stop the pool's worker processes (a detached pool attached here ends too)."""
        if self._parse(self.dist_shutdown, line) is None:
            return
        print("Pool shut down." if pool_module.shutdown_pool() else "No pool is running.")

    # ------------------------------------------------------------------ auto mode
    @magic_arguments()
    @argument("mode", nargs="?", metavar="on|off", help="on: every cell runs distributed.")
    @argument("-h", "--help", action="store_true", help="show this help.")
    @line_magic
    def dist_mode(self, line: str) -> None:
        """Auto mode: with "on", every following cell runs on the ranks as if it began with
        %%distributed. Cells that start with % or ! stay in the kernel; so does a %%local cell."""
        args = self._parse(self.dist_mode, line)
        if args is None:
            return
        if args.mode is not None:
            with _bad_input_is_usage():
                self.auto_mode.on = parse_bool(args.mode, "%dist_mode")
        print(f"Auto mode is {'on' if self.auto_mode.on else 'off'}.")

    @magic_arguments()
    @argument("-h", "--help", action="store_true", help="show this help.")
    @cell_magic
    def local(self, line: str, cell: str) -> None:
        """Run this cell in the notebook kernel, even in auto mode."""
        if self._parse(self.local, line) is None:
            return
        self.shell.run_cell(cell, store_history=False)


def _show_values(renderer: CellRenderer, values: dict[int, Any]) -> None:
    for rank, bundle in sorted(values.items()):
        if bundle:
            renderer.show(rank, bundle["data"], bundle["metadata"])


class AutoMode:
    """``%dist_mode`` of one kernel's magics, and the input transformer it drives: ``%%local``
    cells run as plain code; while ``on``, other cells get ``%%distributed`` prepended (cells
    that start with ``%`` or ``!`` are left alone)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, lines: list[str]) -> list[str]:
        first = next((i for i, text in enumerate(lines) if text.strip()), None)
        if first is None:
            return lines
        head = lines[first].lstrip()
        if head.strip() == "%%local":
            return lines[first + 1 :]
        if _help_alone(head, lines[first + 1 :]):  # IPython refuses a cell magic with no body
            return [head[1:]]
        if not self.on or head.startswith(("%", "!")):
            return lines
        return ["%%distributed\n", *lines[first:]]


def _help_alone(head: str, rest: list[str]) -> bool:
    """``%%distributed --help`` (or ``-h``) with nothing below: shown as the line magic's help."""
    words = head.split()
    return (
        bool(words)
        and words[0] == "%%distributed"
        and bool({"-h", "--help"} & set(words[1:]))
        and not any(text.strip() for text in rest)
    )


class _Extension:
    """What loading the extension did once per kernel: the pool's stop registered at exit."""

    atexit_registered = False


_extension = _Extension()


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbaccel``: register the magics and their auto-mode transformer."""
    magics = DistributedMagics(ipython)
    ipython.register_magics(magics)
    _drop_auto_modes(ipython)  # a reload's magics replace the earlier ones, mode included
    ipython.input_transformers_cleanup.append(magics.auto_mode)
    if not _extension.atexit_registered:
        atexit.register(pool_module.release_pool)  # a detached pool goes on
        _extension.atexit_registered = True
    try:
        warm_up(POOL_PRELOAD)  # the fork server imports torch while the user types
    except Exception as exc:  # only a head start: the first cell starts the server otherwise
        print(f"[nbaccel] could not start the fork server early: {exc}", file=sys.stderr)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbaccel``: stop the pool (let go of a detached one), leave auto mode."""
    _drop_auto_modes(ipython)
    pool_module.release_pool()


def _drop_auto_modes(ipython: Any) -> None:
    transformers = ipython.input_transformers_cleanup
    transformers[:] = [t for t in transformers if not isinstance(t, AutoMode)]
