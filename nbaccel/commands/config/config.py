"""``nbaccel config``: a few questions, answered at the prompt, written as a config file.

Each question shows its default in brackets; Enter keeps it. The answers become a
:class:`~nbaccel.commands.config.config_args.ClusterConfig` saved as YAML (JSON when the path
ends in ``.json``), which ``nbaccel launch`` then reads by default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from nbaccel.commands.config.config_args import ClusterConfig, default_config_file
from nbaccel.commands.parser import command_parser
from nbaccel.values.booleans import parse_bool

__all__ = ["ask", "config_command", "config_command_parser", "get_user_input"]

_KINDS = {
    "no": "NO",
    "multi-cpu": "MULTI_CPU",
    "multi-gpu": "MULTI_GPU",
    "fsdp": "FSDP",
    "deepspeed": "DEEPSPEED",
    "xla": "XLA",
}


def ask(
    question: str,
    convert: Callable[[str], Any] = str,
    default: Any = None,
    choices: tuple[str, ...] | None = None,
    reader: Callable[[str], str] = input,
) -> Any:
    """Ask until the answer converts (and is one of ``choices``); Enter gives ``default``."""
    shown = f" [{default}]" if default is not None else ""
    options = f" ({'/'.join(choices)})" if choices else ""
    while True:
        answer = reader(f"{question}{options}{shown}: ").strip()
        if not answer and default is not None:
            return default
        if choices and answer not in choices:
            print(f"Please answer one of: {', '.join(choices)}.")
            continue
        try:
            return convert(answer)
        except ValueError:
            print(f"{answer!r} is not a valid answer; try again.")


def _yes(text: str) -> bool:
    return parse_bool(text, "answer")


def get_user_input(reader: Callable[[str], str] = input) -> ClusterConfig:
    """Ask the questions and return the config they describe."""
    kind = ask("Which kind of run", default="no", choices=tuple(_KINDS), reader=reader)
    distributed_type = _KINDS[kind]
    num_machines, machine_rank, ip, port = 1, 0, None, None
    if distributed_type in ("MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"):
        num_machines = ask("How many machines", int, 1, reader=reader)
        if num_machines > 1:
            machine_rank = ask("This machine's rank", int, 0, reader=reader)
            ip = ask("IP address of machine 0", str, "127.0.0.1", reader=reader)
            port = ask("Rendezvous port on machine 0", int, 29500, reader=reader)
    processes = 1
    if distributed_type != "NO":
        processes = ask("How many processes in total", int, 2, reader=reader)
    use_cpu = distributed_type == "MULTI_CPU" or (
        distributed_type == "NO" and ask("Run on the CPU only", _yes, False, reader=reader)
    )
    gpu_ids = None
    if distributed_type in ("MULTI_GPU", "FSDP"):
        gpu_ids = ask("Which GPUs (ids separated by commas, or all)", str, "all", reader=reader)
    precision = ask("Mixed precision", str, "no", ("no", "fp16", "bf16"), reader=reader)
    fsdp: dict[str, Any] = {}
    if distributed_type == "FSDP":
        fsdp = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": ask("Reshard after forward", _yes, True, reader=reader),
            "fsdp_offload_params": ask("Offload parameters to CPU", _yes, False, reader=reader),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    deepspeed = _deepspeed_answers(reader) if distributed_type == "DEEPSPEED" else {}
    return ClusterConfig(
        compute_environment="LOCAL_MACHINE", distributed_type=distributed_type,
        mixed_precision=precision, use_cpu=use_cpu, debug=False, num_processes=processes,
        num_machines=num_machines, machine_rank=machine_rank, main_process_ip=ip,
        main_process_port=port, gpu_ids=gpu_ids, fsdp_config=fsdp, deepspeed_config=deepspeed,
    )  # fmt: skip


def _deepspeed_answers(reader: Callable[[str], str]) -> dict[str, Any]:
    """The ``deepspeed_config`` section (Accelerate's keys): a config file, or the options."""
    path = ask("DeepSpeed config file (Enter: none)", str, "none", reader=reader)
    if path != "none":
        return {"deepspeed_config_file": path, "zero3_init_flag": ask(
            "Build transformers models partitioned (zero3_init_flag)", _yes, False, reader=reader
        )}  # fmt: skip
    devices = ("none", "cpu", "nvme")
    stage = ask("ZeRO stage", int, 2, ("0", "1", "2", "3"), reader=reader)
    answers: dict[str, Any] = {"zero_stage": stage, "offload_optimizer_device": ask(
        "Offload the optimizer state to", str, "none", devices, reader=reader)}  # fmt: skip
    if stage == 3:
        answers["offload_param_device"] = ask(
            "Offload the parameters to", str, "none", devices, reader=reader
        )
        answers["zero3_init_flag"] = ask(
            "Build transformers models partitioned (zero3_init_flag)", _yes, False, reader=reader
        )
    answers["gradient_accumulation_steps"] = ask(
        "Gradient accumulation steps", int, 1, reader=reader
    )
    return answers


def config_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``nbaccel config`` with its ``default`` and ``update`` subcommands."""
    from nbaccel.commands.config.default import default_command_parser
    from nbaccel.commands.config.update import update_command_parser

    description = "Write a launch config file by answering a few questions."
    parser = command_parser("config", subparsers, help=description, description=description)
    parser.add_argument(
        "--config_file", default=None,
        help=f"where to save it (default: {default_config_file})",
    )  # fmt: skip
    parser.set_defaults(handler=config_command)
    sub = parser.add_subparsers(dest="config_subcommand", metavar="<subcommand>")
    default_command_parser(sub)
    update_command_parser(sub)
    return parser


def config_command(args: argparse.Namespace) -> int:
    """Ask, then save; exit code 0 (2 when standard input ends before the answers)."""
    try:
        config = get_user_input()
    except EOFError:
        print(
            "\nnbaccel config: standard input ended before the questions were answered (no "
            "terminal?). Run it in a terminal, or write a config with the defaults and no "
            "questions: nbaccel config default",
            file=sys.stderr,
        )
        return 2
    path = args.config_file or default_config_file
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".json"):
        config.to_json_file(path)
    else:
        config.to_yaml_file(path)
    print(f"nbaccel configuration saved at {path}")
    return 0
