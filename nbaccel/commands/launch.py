"""``nbaccel launch``: run a training script on N ranks, as ``accelerate launch`` does.

``nbaccel launch --num_processes 2 train.py --lr 3e-4`` runs ``train.py`` on 2 ranks through the
public :func:`nbaccel.notebook_launcher`: each rank executes the script as ``__main__`` (or a
module with ``-m``) with ``sys.argv`` set to the script and its arguments, and the distributed
environment set, so a script written for ``accelerate launch`` runs with one word changed.
Output comes back as rank-labelled lines. The exit code is the script's: 0 when every rank
finished, the code of the first failing rank's ``sys.exit(code)``, 1 for an uncaught exception
(its traceback printed, naming the rank), 130 on Ctrl-C.

Flags follow ``accelerate launch``: ``--num_processes`` is the total over all machines, and
``--num_machines``/``--machine_rank``/``--main_process_ip``/``--main_process_port`` start one
node of a multi-node run (the same command on every machine, with its own ``--machine_rank``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["register", "run", "run_script"]

_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel launch`` to the command line."""
    parser = subparsers.add_parser(
        "launch",
        help="run a script on N ranks (like `accelerate launch`)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--num_processes",
        "--num-processes",
        type=int,
        default=None,
        help="total number of ranks over all machines (default: every GPU, or 1)",
    )
    parser.add_argument("--mixed_precision", "--mixed-precision", choices=_PRECISIONS, default="no")
    parser.add_argument("--cpu", action="store_true", help="run on CPU ranks (gloo)")
    parser.add_argument(
        "--main_process_port", "--main-process-port", type=int, default=None,
        help="rendezvous port (default: a free one; required with several machines)",
    )  # fmt: skip
    parser.add_argument("--num_machines", "--num-machines", type=int, default=1)
    parser.add_argument("--machine_rank", "--machine-rank", type=int, default=0)
    parser.add_argument(
        "--main_process_ip", "--main-process-ip", default="127.0.0.1",
        help="address of machine 0 (multi-node)",
    )  # fmt: skip
    parser.add_argument(
        "--num_cpu_threads_per_process", "--num-cpu-threads-per-process", type=int, default=None,
        help="OMP_NUM_THREADS on each rank",
    )  # fmt: skip
    parser.add_argument(
        "--multi_gpu", "--multi-gpu", action="store_true",
        help="accepted for compatibility (several GPUs are used when num_processes > 1)",
    )  # fmt: skip
    parser.add_argument(
        "-m", "--module", action="store_true",
        help="the target is a module name, run like `python -m`",
    )  # fmt: skip
    parser.add_argument("training_script", help="the script (or module with -m) to run")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments of the script"
    )
    parser.set_defaults(handler=run)


def run_script(
    target: str,
    argv: list[str],
    module: bool,
    cwd: str,
    omp_threads: int | None = None,
) -> None:
    """What each rank runs: ``target`` as ``__main__`` with ``sys.argv`` set. A
    ``sys.exit(0)`` (or ``sys.exit()``) is a normal end, not a failure."""
    import runpy

    os.chdir(cwd)
    if omp_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(omp_threads)
        import torch

        torch.set_num_threads(omp_threads)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [target, *argv]
    sys.path.insert(0, cwd if module else os.path.dirname(target))
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _check(args: argparse.Namespace) -> tuple[str, int | None]:
    """The script's absolute path (or module name) and processes per machine; clear errors
    before anything starts."""
    target = args.training_script
    if args.module:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        finally:
            sys.path.pop(0)
        if found is None:
            raise SystemExit(f"nbaccel launch: no module named {target!r} (run from its parent).")
    else:
        target = os.path.abspath(target)
        if not os.path.isfile(target):
            raise SystemExit(f"nbaccel launch: no such script: {args.training_script!r}.")
    machines = args.num_machines
    if machines < 1 or not 0 <= args.machine_rank < machines:
        raise SystemExit(
            f"nbaccel launch: --machine_rank {args.machine_rank} must be in 0..{machines - 1} "
            f"(--num_machines {machines})."
        )
    per_machine = args.num_processes
    if per_machine is not None:
        if per_machine < 1:
            raise SystemExit("nbaccel launch: --num_processes must be >= 1.")
        if per_machine % machines:
            raise SystemExit(
                f"nbaccel launch: --num_processes {per_machine} is the total over "
                f"{machines} machines and must divide by it."
            )
        per_machine //= machines
    if machines > 1 and args.main_process_port is None:
        raise SystemExit(
            "nbaccel launch: a multi-machine run needs --main_process_port (the same on every "
            "machine) and --main_process_ip (machine 0's address)."
        )
    return target, per_machine


def _exit_code(exc: BaseException) -> int:
    """The code this command ends with: the rank's own ``sys.exit`` code, 128 + N for a rank
    killed by signal N (as a shell reports it), 130 for Ctrl-C, 1 for an exception."""
    from nbaccel.launch.errors import RankCrashed

    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else 1
    if isinstance(exc, RankCrashed) and exc.returncode:
        return exc.returncode if exc.returncode > 0 else 128 - exc.returncode
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def _report(exc: BaseException) -> None:
    rank = getattr(exc, "rank", None)
    where = f"rank {rank}" if rank is not None else "the launch"
    if isinstance(exc, SystemExit):
        print(f"nbaccel launch: {where} exited with code {_exit_code(exc)}.", file=sys.stderr)
        return
    cause = exc.__cause__
    if cause is not None and str(cause):
        print(str(cause), file=sys.stderr)
    print(f"nbaccel launch: {where} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Launch the script; return its exit code."""
    from nbaccel import notebook_launcher

    target, per_machine = _check(args)
    call: tuple[Any, ...] = (
        target,
        list(args.training_script_args),
        args.module,
        os.getcwd(),
        args.num_cpu_threads_per_process,
    )
    try:
        notebook_launcher(
            run_script,
            call,
            num_processes=per_machine,
            mixed_precision=args.mixed_precision,
            use_port=args.main_process_port,
            master_addr=args.main_process_ip,
            node_rank=args.machine_rank,
            num_nodes=args.num_machines,
            cpu=args.cpu,
        )
    except BaseException as exc:  # every failure becomes an exit code
        _report(exc)
        return _exit_code(exc)
    return 0
