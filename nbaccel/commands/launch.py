"""``nbaccel launch``: run a training script on N ranks, as ``accelerate launch`` does.

``nbaccel launch --num_processes 2 train.py --lr 3e-4`` runs ``train.py`` on 2 ranks through
the public :func:`nbaccel.notebook_launcher`: each rank executes the script as ``__main__`` (or a
module with ``-m``) with ``sys.argv`` set to the script and its arguments, and the distributed
environment set, so a script written for ``accelerate launch`` runs with one word changed.
Output comes back as rank-labelled lines. The exit code is the script's: 0 when every rank
finished, the code of the first failing rank's ``sys.exit(code)``, 1 for an uncaught exception
(its traceback printed, naming the rank), 130 on Ctrl-C.

Options not given come from the config file (``--config_file``, else the default one that ``nbaccel
config`` writes, else the one ``accelerate config`` wrote, named in one line; see
:mod:`nbaccel.commands.config.config_args`). Every rank gets the variables ``accelerate launch``
sets for the same settings (:mod:`nbaccel.launch.options.accelerate_env`), so transformers'
``Trainer`` (which builds Accelerate's own ``Accelerator``) runs as under ``accelerate launch``; a
setting that Accelerator cannot carry out on these ranks (FSDP on CPU) is said in one line.
``--num_processes`` is the total over all machines; ``--num_machines``/``--machine_rank``/
``--main_process_ip``/``--main_process_port`` start one node of a multi-node run. A config with
``mpirun_hostfile`` runs the script under ``mpirun``. ``--use_deepspeed`` (or a DEEPSPEED config)
tells each rank's ``Accelerator()`` to run DeepSpeed ZeRO as the DeepSpeed options say, checked
before anything starts. ``--use_megatron_lm`` (or a MEGATRON_LM config, its ``megatron_lm_config:``
keys) does the same for ``MegatronLMPlugin``, on CPU ranks (gloo) or GPUs. SageMaker configs are
refused with a clear error before anything starts.
``--detach`` hands the run to this user's supervisor and returns at once, printing the run's id
(follow it with ``nbaccel runs logs ID --follow``; see ``nbaccel runs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
from typing import Any

from nbaccel.commands._launch_parser import launch_command_parser
from nbaccel.launch.options.accelerate_env import launch_settings, settings_names

__all__ = ["launch_command", "launch_command_parser", "main", "register", "run", "run_script"]

logger = logging.getLogger(__name__)

_PARADIGMS = ("multi_gpu", "cpu", "tpu", "use_deepspeed", "use_fsdp")
_HANDLED_APART = ("compute_environment", "mixed_precision", "distributed_type")
_SECTION_PREFIX = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel launch`` to the command line."""
    parser = launch_command_parser(subparsers)
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


def _apply_config(args: argparse.Namespace, config: Any) -> bool:
    """Fill the options not given on the command line from ``config``; True when the
    precision came from the file (one that names none gives "no", and False)."""
    from nbaccel.distributed.state import DistributedType

    kind = config.distributed_type
    explicit = ("multi_gpu", "tpu", "tpu_use_cluster", "use_deepspeed", "use_fsdp",
                "use_megatron_lm")  # fmt: skip
    if not any(getattr(args, name, False) for name in explicit):
        multi = {"MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                 "MULTI_HPU", "MULTI_NEURON"}  # fmt: skip
        args.multi_gpu = getattr(kind, "value", kind) in multi
        args.tpu = kind == DistributedType.XLA
        args.use_fsdp = kind == DistributedType.FSDP
        args.use_deepspeed = kind == DistributedType.DEEPSPEED
        args.use_megatron_lm = kind == DistributedType.MEGATRON_LM
        args.tpu_use_cluster = bool(getattr(config, "tpu_use_cluster", False)) and args.tpu
        args.use_parallelism_config = bool(getattr(config, "parallelism_config", {}))
    if args.gpu_ids is None:
        args.gpu_ids = getattr(config, "gpu_ids", None) or "all"
    given = getattr(args, "nondefault", set())
    if str(getattr(config.compute_environment, "value", "")) == "LOCAL_MACHINE":
        known = set(vars(args)) | settings_names() | _ALSO_ACCEPTED
        for name, value in vars(config).items():
            if isinstance(value, dict):
                prefix = _SECTION_PREFIX.get(name, "")
                for key, item in value.items():
                    key = key if key.startswith(prefix) else prefix + key
                    if key not in known and not key.startswith("megatron_lm_"):
                        _refuse_key(name, key, known)
                    if key not in given:
                        setattr(args, key, item)
            elif name not in _HANDLED_APART and getattr(args, name, None) is None:
                setattr(args, name, value)
    args.debug = bool(args.debug or config.debug)
    if args.mixed_precision is None:
        args.mixed_precision = config.mixed_precision or "no"
        return getattr(config, "precision_in_file", True)
    return False


# keys Accelerate's config writes that no launch setting here takes (IPEX left Accelerate)
_ALSO_ACCEPTED = frozenset({"mpirun_ccl", "ipex"})
_SECTION_WORDS = {"fsdp_config": "fsdp_", "deepspeed_config": "", "dynamo_config": "dynamo_",
                  "fp8_config": "fp8_", "parallelism_config": "parallelism_config_",
                  "mpirun_config": "mpirun_"}  # fmt: skip


def _refuse_key(section: str, key: str, known: set[str]) -> None:
    """A config key that names no setting: refused, naming the ones its section takes."""
    if section == "deepspeed_config":
        from nbaccel.launch.options.accelerate_env import CONTRACT

        accepted = sorted(
            {r.setting for r in CONTRACT if r.group == "deepspeed"} - {"use_deepspeed"}
            | {"gradient_accumulation_steps", "deepspeed_hostfile", "deepspeed_multinode_launcher",
               "deepspeed_exclusion_filter", "deepspeed_inclusion_filter"}
        )  # fmt: skip
    else:
        start = _SECTION_WORDS.get(section, section.removesuffix("_config") + "_")
        accepted = sorted(k for k in known if k.startswith(start))
    raise ValueError(
        f"The config file's {section} key {key!r} names no setting: use one of "
        f"{', '.join(accepted) or '(none)'}."
    )


def _validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, bool]:
    """Check the options and fill the missing ones (config file, then defaults); returns
    ``(args, config or None, precision_from_config)``. Errors name the fix."""
    import torch

    from nbaccel.commands.config.config_args import default_launch_config, load_config_from_file
    from nbaccel.distributed.environment_patch import get_int_from_env

    chosen = [f"--{name}" for name in _PARADIGMS if getattr(args, name, False)]
    if len(chosen) > 1:
        raise ValueError(f"Use only one of {', '.join(chosen)} at a time.")
    if args.multi_gpu and args.num_processes is not None and args.num_processes < 2:
        raise ValueError("--multi_gpu needs at least 2 processes (--num_processes 2 or more).")
    config, from_config, notes = None, False, []
    config_file, which = args.config_file, ""
    if config_file is None and not args.cpu:
        config_file, which = default_launch_config()
    if config_file is not None:
        config = load_config_from_file(config_file)
        if which and not args.quiet:
            print(f"nbaccel launch: settings from {which}, {config_file}.", file=sys.stderr)
        from_config = _apply_config(args, config)
        if args.num_processes == -1:
            raise ValueError("This config file leaves the process count open: pass "
                             "--num_processes.")  # fmt: skip
    else:
        # with --hosts (or a cluster launcher) the hosts' ranks are the count
        elsewhere = getattr(args, "hosts", None) or getattr(args, "launcher", None) in _CLUSTERS
        if args.num_processes is None and not elsewhere:
            args.num_processes = max(torch.cuda.device_count(), 1)
            notes.append(f"--num_processes {args.num_processes}")
        if args.num_machines is None:
            args.num_machines = 1
        if args.mixed_precision is None:
            args.mixed_precision = "no"
        args.use_cpu = args.cpu
    args.num_machines = args.num_machines or 1
    args.machine_rank = args.machine_rank or 0
    args.dynamo_backend = args.dynamo_backend or "no"
    multi = args.multi_gpu and args.num_machines <= 1 and str(args.gpu_ids or "all") != "all"
    if multi and len(str(args.gpu_ids).split(",")) < 2:
        raise ValueError("--multi_gpu with --gpu_ids needs two ids or more (or --gpu_ids all).")
    if args.num_cpu_threads_per_process is None and not (
        config is not None and str(config.compute_environment.value) == "AMAZON_SAGEMAKER"
    ):
        threads = get_int_from_env(["OMP_NUM_THREADS"], 0)
        if threads == 0 and getattr(args, "use_cpu", False) and (args.num_processes or 0) >= 1:
            import psutil

            local = max((args.num_processes or 1) // args.num_machines, 1)
            threads = (psutil.cpu_count(logical=False) or 1) // local
        args.num_cpu_threads_per_process = max(threads, 1)
    if notes and not args.quiet:
        logger.warning("nbaccel launch used defaults for: %s (set them, or run `nbaccel "
                       "config`).", ", ".join(notes))  # fmt: skip
    return args, config, from_config


_CLUSTERS = ("slurm", "ray")  # launchers whose allocation says how many ranks


def _refuse_unsupported(args: argparse.Namespace, config: Any) -> None:
    if config is not None and str(config.compute_environment.value) == "AMAZON_SAGEMAKER":
        raise NotImplementedError(
            "nbaccel does not start Amazon SageMaker jobs: launch the script inside the job "
            "with `nbaccel launch`, or use a LOCAL_MACHINE config."
        )
    if args.tpu and not args.cpu:
        from nbaccel.distributed.environment import is_torch_xla_available

        if not is_torch_xla_available():
            raise ValueError("--tpu (or distributed_type: XLA) needs torch-xla on a TPU host: "
                             "pip install torch-xla, or drop --tpu.")  # fmt: skip
    if getattr(args, "use_megatron_lm", False):
        others = [f"--{n}" for n in ("use_deepspeed", "use_fsdp", "tpu") if getattr(args, n, 0)]
        if others:
            raise ValueError(f"Use --use_megatron_lm or {', '.join(others)}, not both.")


def _check_target(args: argparse.Namespace) -> tuple[str, int | None]:
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
    elif not args.no_python:
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
    from nbaccel.launch.wire.errors import RankCrashed

    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else 1
    if isinstance(exc, RankCrashed) and exc.returncode:
        return exc.returncode if exc.returncode > 0 else 128 - exc.returncode
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def _report(exc: BaseException) -> None:
    from nbaccel.launch.wire.errors import remote_traceback, where_raised

    where = where_raised(exc) or "the launch"
    if isinstance(exc, SystemExit):
        print(f"nbaccel launch: {where} exited with code {_exit_code(exc)}.", file=sys.stderr)
        return
    remote = remote_traceback(exc)
    if remote:
        print(remote, file=sys.stderr)
    print(f"nbaccel launch: {where} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def _with_environment(env: dict[str, str], call: Any) -> Any:
    """Run ``call()`` with ``env`` as this process's environment (the ranks inherit it)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        return call()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _request(args: argparse.Namespace, per_machine: int | None, port: int | None) -> Any:
    """The launch options of ``args`` as a ``LaunchRequest`` (checked there): the flags
    derived from it, with what the config file and Accelerate's conventions decided (processes
    per machine, not in total; the port prepared for a world)."""
    from nbaccel.launch.request import Front, LaunchRequest

    # ranks on other hosts (ssh, slurm, ray) form their world themselves: no port of ours
    remote = getattr(args, "hosts", None) is not None or getattr(args, "launcher", None)
    return LaunchRequest.from_parsed(
        args,
        Front.CLI,
        num_processes=per_machine,
        use_port=None if remote else port if port is not None else args.main_process_port,
        cpu=bool(args.cpu or getattr(args, "use_cpu", False)),
        rdzv_conf=args.rdzv_conf or None,
    )


def _launch(args: argparse.Namespace) -> int:
    """Validate, then run; returns the exit code (raises on bad options)."""
    from nbaccel.launch.command_env import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args, config, precision_from_config = _validate_launch_command(args)
    _refuse_unsupported(args, config)
    if args.use_fsdp and str(args.fsdp_version or 1) == "1" and not args.quiet:
        print("nbaccel launch: fsdp_version 1: Accelerate's Accelerator gets FSDP_VERSION=1 "
              "as under accelerate launch; nbaccel's own Accelerator runs FSDP2 instead "
              "(convert the config with `nbaccel to-fsdp2`).", file=sys.stderr)  # fmt: skip
    if args.use_deepspeed:  # which DeepSpeed fields the config file set (Accelerate's rule)
        fields = list(config.deepspeed_config) if config is not None else []
        fields += ["mixed_precision"] if precision_from_config else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    target, per_machine = _check_target(args)
    if getattr(args, "mpirun_hostfile", None) or args.no_python:
        if args.no_python and (args.num_processes or 1) > 1 and not args.mpirun_hostfile:
            raise ValueError("--no_python runs one process; use --num_processes 1 (or mpirun).")
        cmd, env = prepare_simple_launcher_cmd_env(args)
        return subprocess.run(cmd, env=env).returncode
    world = (args.num_processes or 1) > 1 or args.num_machines > 1
    env = prepare_multi_gpu_env(args) if world else prepare_simple_launcher_cmd_env(args)[1]
    if args.use_deepspeed:  # checked here (the config file too), before any rank starts
        from nbaccel.training.strategies.deepspeed.launch import deepspeed_environment

        env.update(deepspeed_environment(args, args.num_processes))
    request = _request(args, per_machine, int(args.master_port) if world else None)
    request = dataclasses.replace(request, settings=launch_settings(vars(args)))
    if request.use_megatron_lm:  # the plugin is built once here: refusals before any rank
        from nbaccel.training.strategies.megatron.launch import megatron_check

        env.update(megatron_check(request.megatron_environment(), args.num_processes))
    call = (target, list(args.training_script_args), args.module, os.getcwd(),
            args.num_cpu_threads_per_process)  # fmt: skip

    def start() -> Any:
        from nbaccel.notebook.kernel.launcher import launch_request

        return launch_request(run_script, call, request)

    try:
        _with_environment(env, start)  # with --detach: the run is started, its id printed
    except BaseException as exc:  # every failure becomes an exit code
        _report(exc)
        return _exit_code(exc)
    return 0


def launch_command(args: argparse.Namespace) -> None:
    """Run the launch ``args`` describe; a failed run raises ``CalledProcessError`` with its
    exit code (bad options raise ValueError/NotImplementedError before anything starts)."""
    code = _launch(args)
    if code:
        raise subprocess.CalledProcessError(code, ["nbaccel", "launch", args.training_script])


def run(args: argparse.Namespace) -> int:
    """The command-line handler: the script's exit code; bad options print their error."""
    try:
        return _launch(args)
    except (ValueError, NotImplementedError, OSError) as exc:
        print(f"nbaccel launch: {exc}", file=sys.stderr)
        return 2


def main() -> None:
    """``python -m nbaccel.commands.launch ...``: the same as ``nbaccel launch ...``."""
    sys.exit(run(launch_command_parser().parse_args()))


if __name__ == "__main__":  # pragma: no cover
    main()
