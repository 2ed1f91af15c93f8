"""The argument parser of ``nbaccel launch`` (Accelerate's ``accelerate launch`` flags).

Every option is accepted with underscores or hyphens (``--num_processes`` or
``--num-processes``); the help lists the underscore spelling only. The parser records which
options were given on the command line in ``args.nondefault`` so that a config file fills in
only the others.
"""

from __future__ import annotations

import argparse
from typing import Any

from nbaccel.commands.parser import command_parser
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.values.booleans import parse_bool

__all__ = ["launch_command_parser", "to_bool"]

_DESCRIPTION = """Run a training script on N ranks on nbaccel's engine, as `accelerate launch` does.

Options come from the command line, else from the config file (--config_file, or the default
one written by `nbaccel config`), else from defaults. Example, two CPU ranks:
  nbaccel launch --num-processes 2 --cpu train.py --lr 3e-4
Output comes back as rank-labelled lines; the exit code is the script's.
"""


def to_bool(value: Any) -> bool:
    """``"true"``/``"1"``/``"yes"`` -> True, ``"false"``/``"0"``/``"no"`` -> False."""
    try:
        return parse_bool(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}") from None


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option once: the hyphenated twin of an underscore option is hidden."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if action.option_strings:
            shown = [s for s in action.option_strings if not (s.startswith("--") and "-" in s[2:])]
            if shown and len(shown) != len(action.option_strings):
                action = argparse.Action(shown, action.dest, nargs=action.nargs,
                                         metavar=action.metavar)  # fmt: skip
        return super()._format_action_invocation(action)


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    class Recording(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
            given = getattr(namespace, "nondefault", None)
            if given is None:
                given = set()
                namespace.nondefault = given
            given.add(self.dest)
            super().__call__(parser, namespace, values, option)

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


_ACTIONS = {
    "store": _recording(argparse._StoreAction),
    "store_true": _recording(argparse._StoreTrueAction),
    "store_false": _recording(argparse._StoreFalseAction),
    "append": _recording(argparse._AppendAction),
}


def _option(group: Any, name: str, *extra: str, **kwargs: Any) -> None:
    """``--name`` and its hyphenated twin (plus ``extra`` spellings), recording when given."""
    names = [f"--{name}", *extra]
    if "_" in name:
        names.append(f"--{name.replace('_', '-')}")
    kwargs["action"] = _ACTIONS[kwargs.get("action", "store")]
    group.add_argument(*names, **kwargs)


def _launch_option(group: Any, name: str) -> None:
    """The flag of ``LaunchRequest``'s option ``name`` (its help, type, checks are there),
    recording when given."""
    flags, kwargs = LaunchRequest.arguments(Front.CLI)[name]
    kwargs = {**kwargs, "action": _ACTIONS[kwargs.get("action", "store")]}
    group.add_argument(*flags, **kwargs)


#: the launch options placed in Accelerate's groups; the others go in nbaccel's own group
_PLACED = {
    "Hardware": ("cpu",),
    "Resources": ("mixed_precision", "num_processes", "num_nodes"),
    "Distributed": ("node_rank", "master_addr", "use_port", "rdzv_backend", "rdzv_conf",
                    "max_restarts", "monitor_interval"),
    "Paradigm": ("use_deepspeed", "use_megatron_lm"),
    "Megatron-LM": tuple(n for n in LaunchRequest.options(Front.CLI) if "megatron_lm_" in n),
}  # fmt: skip


def _nbaccel_options(parser: argparse.ArgumentParser) -> None:
    """nbaccel's launch options beyond Accelerate's flags (timeout, hosts, ...)."""
    group = parser.add_argument_group(
        "nbaccel", "How the ranks start, for how long, and on which hosts (over ssh or SLURM)."
    )
    placed = {name for names in _PLACED.values() for name in names}
    for name in LaunchRequest.options(Front.CLI):
        if name not in placed:
            _launch_option(group, name)


def _hardware_and_resources(parser: argparse.ArgumentParser) -> None:
    hardware = parser.add_argument_group("Hardware", "Which devices the ranks use.")
    _launch_option(hardware, "cpu")
    _option(hardware, "multi_gpu", action="store_true", help="one rank per GPU (the default "
            "when several GPUs are visible and num_processes > 1)")  # fmt: skip
    _option(hardware, "tpu", action="store_true", help="run on TPU cores through torch-xla")
    res = parser.add_argument_group("Resources", "How many processes, which precision.")
    for name in _PLACED["Resources"]:
        _launch_option(res, name)  # --num_processes is the total over all machines here
    _option(res, "num_cpu_threads_per_process", type=int, default=None,
            help="threads per rank (OMP_NUM_THREADS)")  # fmt: skip
    _option(res, "enable_cpu_affinity", action="store_true", help="pin ranks to CPU cores")
    _option(res, "dynamo_backend", type=str.lower, default=None,
            help="torch.compile backend (no, inductor, eager, ...)")  # fmt: skip
    _option(res, "dynamo_mode", default="default", help="torch.compile mode")
    _option(res, "dynamo_use_fullgraph", action="store_true", help="compile whole graphs only")
    _option(res, "dynamo_use_dynamic", action="store_true", help="compile with dynamic shapes")
    _option(res, "dynamo_use_regional_compilation", action="store_true",
            help="compile repeated blocks once")  # fmt: skip


def _paradigms_and_world(parser: argparse.ArgumentParser) -> None:
    paradigm = parser.add_argument_group("Paradigm", "How the model is spread over the ranks.")
    _option(paradigm, "use_fsdp", action="store_true", help="shard the model with FSDP")
    _launch_option(paradigm, "use_deepspeed")
    _launch_option(paradigm, "use_megatron_lm")
    _option(paradigm, "use_parallelism_config", action="store_true",
            help="ParallelismConfig from the --parallelism_config_* options (accepted; "
            "the sizes alone turn it on, with or without --use_fsdp)")  # fmt: skip
    world = parser.add_argument_group("Distributed", "Where the ranks meet.")
    _option(world, "gpu_ids", default=None, help="GPU ids to use, comma separated, or all")
    _option(world, "same_network", action="store_true", help="machines share a local network")
    for name in _PLACED["Distributed"]:
        _launch_option(world, name)  # Accelerate's spellings: --machine_rank, --main_process_ip
    _option(world, "tee", default="0", help="accepted for compatibility")
    _option(world, "log_dir", default=None, help="accepted for compatibility")
    _option(world, "role", default="default", help="accepted for compatibility")
    _option(world, "module", "-m", action="store_true",
            help="the script is a module name, run like python -m")  # fmt: skip
    _option(world, "no_python", action="store_true",
            help="the script is an executable, run without python")  # fmt: skip
    _option(world, "mpirun_hostfile", default=None, help="run under mpirun with this host file")


def _tpu_and_stacks(parser: argparse.ArgumentParser) -> None:
    tpu = parser.add_argument_group("TPU", "TPU pods.")
    _option(tpu, "tpu_cluster", action="store_true", dest="tpu_use_cluster",
            help="run on every host of a TPU pod")  # fmt: skip
    _option(tpu, "no_tpu_cluster", action="store_false", dest="tpu_use_cluster",
            help="run on this TPU host only")  # fmt: skip
    _option(tpu, "tpu_use_sudo", action="store_true", help="run the pod command with sudo")
    _option(tpu, "vm", type=str, action="append", help="TPU VM names of the pod")
    _option(tpu, "env", type=str, action="append", help="KEY=VALUE variables for the pod")
    _option(tpu, "main_training_function", default=None, help="function run on TPU cores")
    deepspeed = parser.add_argument_group("DeepSpeed", "Options of a --use_deepspeed launch.")
    _deepspeed_options(deepspeed)
    for name in ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
                 "deepspeed_multinode_launcher"):  # fmt: skip
        _option(deepspeed, name, default=None,
                help="accepted for compatibility (nbaccel forms the world itself)")  # fmt: skip
    _option(deepspeed, "gradient_accumulation_steps", type=int, default=None,
            help="gradient accumulation steps of the Accelerator")  # fmt: skip
    megatron = parser.add_argument_group(
        "Megatron-LM", "Options of a --use_megatron_lm launch (MegatronLMPlugin's fields)."
    )
    for name in _PLACED["Megatron-LM"]:
        _launch_option(megatron, name)
    fsdp = parser.add_argument_group("FSDP", "Options of a --use_fsdp launch.")
    _option(fsdp, "fsdp_version", choices=["1", "2"], default=None,
            help="2 (nbaccel runs FSDP2 only; convert FSDP1 configs with to-fsdp2)")  # fmt: skip
    _option(fsdp, "fsdp_offload_params", type=to_bool, default=False, help="offload to CPU")
    _option(fsdp, "fsdp_min_num_params", type=int, default=int(1e8),
            help="size policy: parameters per wrapped module")  # fmt: skip
    _option(fsdp, "fsdp_sharding_strategy", default="FULL_SHARD", help="FSDP1 sharding")
    _option(fsdp, "fsdp_reshard_after_forward", default="true", help="FSDP2 resharding")
    _option(fsdp, "fsdp_auto_wrap_policy", default=None, help="TRANSFORMER_BASED_WRAP, ...")
    _option(fsdp, "fsdp_transformer_layer_cls_to_wrap", default=None, help="layer class names")
    _option(fsdp, "fsdp_backward_prefetch", default=None, help="BACKWARD_PRE, BACKWARD_POST")
    _option(fsdp, "fsdp_state_dict_type", default=None, help="FULL_STATE_DICT, ...")
    for name, default in (
        ("fsdp_forward_prefetch", False), ("fsdp_use_orig_params", True),
        ("fsdp_cpu_ram_efficient_loading", True), ("fsdp_sync_module_states", True),
        ("fsdp_activation_checkpointing", False), ("fsdp_activation_checkpointing_offload", False),
    ):  # fmt: skip
        _option(fsdp, name, type=to_bool, default=default, help=f"true/false ({default})")


def _deepspeed_options(group: Any) -> None:
    """The DeepSpeedPlugin's settings (Accelerate's flags and config-file keys); the ranks get
    them as ACCELERATE_DEEPSPEED_* variables, checked by building the plugin before they start."""
    from nbaccel.launch.options.deepspeed import OFFLOAD_DEVICES, yes_no

    _option(group, "deepspeed_config_file", default=None, metavar="FILE",
            help="DeepSpeed config (JSON); prepare fills its 'auto' values")  # fmt: skip
    _option(group, "zero_stage", type=int, default=None, help="ZeRO stage 0-3 (default 2)")
    for part, what in (("optimizer", "the optimizer state"), ("param", "the parameters (ZeRO-3)")):
        _option(group, f"offload_{part}_device", choices=OFFLOAD_DEVICES, default=None,
                type=str.lower, help=f"where ZeRO keeps {what}")  # fmt: skip
        _option(group, f"offload_{part}_nvme_path", default=None, metavar="DIR",
                help=f"NVMe directory of {what}")  # fmt: skip
    _option(group, "gradient_clipping", type=float, default=None,
            help="max gradient norm the DeepSpeed engine clips to")  # fmt: skip
    _option(group, "zero3_init_flag", type=yes_no, default=None, metavar="BOOL",
            help="build transformers models partitioned under ZeRO-3 (true/false)")  # fmt: skip
    _option(group, "zero3_save_16bit_model", type=yes_no, default=None, metavar="BOOL",
            help="gather ZeRO-3 weights to 16 bits when saving (true/false)")  # fmt: skip
    _option(group, "deepspeed_moe_layer_cls_names", default=None, metavar="NAMES",
            help="MoE layer classes kept whole under ZeRO-3 (comma separated)")  # fmt: skip


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``launch`` parser (added to ``subparsers`` when given, else standalone)."""
    options = {"description": _DESCRIPTION, "formatter_class": _Formatter, "allow_abbrev": False}
    parser = command_parser("launch", subparsers, help="run a script on N ranks", **options)
    _option(parser, "config_file", default=None, help="config file with the launch defaults")
    _option(parser, "quiet", "-q", action="store_true", help="no launcher messages")
    _option(parser, "debug", action="store_true", help="check collectives' shapes (slower)")
    _hardware_and_resources(parser)
    _paradigms_and_world(parser)
    _tpu_and_stacks(parser)
    _nbaccel_options(parser)
    parser.add_argument("training_script", help="the script (or module with -m) to run")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments of the script"
    )
    return parser
