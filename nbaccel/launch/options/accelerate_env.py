"""Accelerate's launch contract: the rank variables each launch setting becomes.

transformers' ``Trainer``, PEFT and TRL build Accelerate's own ``Accelerator``, which takes its
settings from the environment ``accelerate launch`` prepares (``ACCELERATE_MIXED_PRECISION``,
``ACCELERATE_USE_FSDP`` + ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED`` + ``ACCELERATE_DEEPSPEED_*``,
...). Every nbaccel front (``notebook_launcher``, ``%%distributed``, ``nbaccel launch`` and its
config files, hosts, detached runs) derives its ranks' variables from :data:`CONTRACT`, the one
table here, so a setting means one thing to Accelerate's ``Accelerator`` and to nbaccel's.

Settings are named as Accelerate's launch flags and config keys are (``mixed_precision``,
``use_fsdp``, ``fsdp_state_dict_type``, ``zero_stage``, ``parallelism_config_tp_size``...);
values are written in the format ``accelerate launch`` writes them (``bf16``, ``true``/``false``
for the FSDP switches, ``True``/``False`` for the dynamo ones). A group of variables (FSDP,
DeepSpeed, Megatron-LM, ParallelismConfig) is written when its switch is on, with Accelerate's
defaults for the settings not given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbaccel.values.booleans import parse_bool

__all__ = [
    "CONTRACT",
    "CONTRACT_PREFIXES",
    "ContractRow",
    "accelerate_environment",
    "check_fsdp_settings",
    "contract_notices",
    "is_contract_variable",
    "launch_settings",
    "settings_names",
]

#: the rank variables of the contract start with one of these
CONTRACT_PREFIXES = (
    "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "MEGATRON_LM_",
)  # fmt: skip


def is_contract_variable(name: str) -> bool:
    """Whether ``name`` is one of the variables Accelerate's launch contract sets."""
    return name.startswith(CONTRACT_PREFIXES)


# ---------------------------------------------------------------------------- value formats
def _text(value: Any) -> str:
    return str(getattr(value, "value", value))


def _lower(value: Any) -> str:
    """``true``/``false`` for booleans (and words meaning them), else the text lowered."""
    try:
        return "true" if parse_bool(value) else "false"
    except (TypeError, ValueError):
        return _text(value).lower()


def _python_bool(value: Any) -> str:
    """``True``/``False``: what ``str()`` of a parsed flag gives (the dynamo switches)."""
    return str(bool(parse_bool(value)))


def _upper(value: Any) -> str:
    return _text(value).upper()


def _on(value: Any) -> bool:
    try:
        return bool(parse_bool(value))
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------- groups
def _deepspeed(s: Mapping[str, Any]) -> bool:
    return _on(s.get("use_deepspeed"))


def _dynamo(s: Mapping[str, Any]) -> bool:
    """Accelerate's DeepSpeed launch writes no dynamo variables; one asked for is kept."""
    if "dynamo_backend" not in s:
        return False
    return not _deepspeed(s) or _upper(s.get("dynamo_backend") or "no") != "NO"


_PC_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def _parallelism(s: Mapping[str, Any]) -> bool:
    return _on(s.get("use_parallelism_config")) or any(
        s.get(f"parallelism_config_{axis}_size") is not None for axis in _PC_SIZES
    )


def _above_one(name: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda s: int(s.get(name) or 1) > 1


#: group -> whether a launch's settings turn it on (rows without a group: when given)
GROUPS: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "cpu": lambda s: _on(s.get("cpu")) and not _deepspeed(s),
    "debug": lambda s: _on(s.get("debug")),
    "dynamo": _dynamo,
    "fsdp": lambda s: _on(s.get("use_fsdp")),
    "deepspeed": _deepspeed,
    "megatron": lambda s: _on(s.get("use_megatron_lm")),
    "parallelism": _parallelism,
    "fp8": lambda s: _text(s.get("mixed_precision") or "no").lower() == "fp8",
}


@dataclass(frozen=True)
class ContractRow:
    """One launch setting and the rank variable ``accelerate launch`` sets for it.

    ``group``: the switch that turns the row on (a key of :data:`GROUPS`); within an active
    group a setting not given takes ``default`` (None: not written). Without a group the
    variable is written when the setting is given. ``when``: a further condition.
    """

    setting: str
    variable: str
    form: Callable[[Any], str] = _text
    group: str | None = None
    default: Any = None
    when: Callable[[Mapping[str, Any]], bool] | None = None


_R = ContractRow
_PC, _DS, _ML = "PARALLELISM_CONFIG_", "ACCELERATE_DEEPSPEED_", "MEGATRON_LM_"

#: every launch setting of Accelerate's contract and the variable it becomes
CONTRACT: tuple[ContractRow, ...] = (
    _R("mixed_precision", "ACCELERATE_MIXED_PRECISION", lambda v: _text(v).lower(), default="no"),
    _R("cpu", "ACCELERATE_USE_CPU", _python_bool, "cpu"),
    _R("debug", "ACCELERATE_DEBUG_MODE", _lower, "debug"),
    _R("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    # torch.compile
    _R("dynamo_backend", "ACCELERATE_DYNAMO_BACKEND", _upper, "dynamo", "no"),
    _R("dynamo_mode", "ACCELERATE_DYNAMO_MODE", _text, "dynamo", "default"),
    _R("dynamo_use_fullgraph", "ACCELERATE_DYNAMO_USE_FULLGRAPH", _python_bool, "dynamo", False),
    _R("dynamo_use_dynamic", "ACCELERATE_DYNAMO_USE_DYNAMIC", _python_bool, "dynamo", False),
    _R("dynamo_use_regional_compilation", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
       _python_bool, "dynamo", False),
    # FSDP (flags, or a config file's distributed_type: FSDP and fsdp_config:)
    _R("use_fsdp", "ACCELERATE_USE_FSDP", _lower, "fsdp", True),
    _R("fsdp_version", "FSDP_VERSION", _text, "fsdp", 1),
    _R("fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY", _text, "fsdp", "FULL_SHARD"),
    _R("fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD", _lower, "fsdp", True),
    _R("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", _lower, "fsdp", False),
    _R("fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS", lambda v: str(int(v)), "fsdp", 10**8),
    _R("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", _text, "fsdp"),
    _R("fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP", _text, "fsdp"),
    _R("fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH", _text, "fsdp"),
    _R("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", _text, "fsdp"),
    _R("fsdp_forward_prefetch", "FSDP_FORWARD_PREFETCH", _lower, "fsdp", False),
    _R("fsdp_use_orig_params", "FSDP_USE_ORIG_PARAMS", _lower, "fsdp", True),
    _R("fsdp_cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING", _lower, "fsdp", True),
    _R("fsdp_sync_module_states", "FSDP_SYNC_MODULE_STATES", _lower, "fsdp", True),
    _R("fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", _lower, "fsdp", False),
    _R("fsdp_activation_checkpointing_offload", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", _lower,
       "fsdp", False),
    _R("fsdp_ignored_modules", "FSDP_IGNORED_MODULES", _text, "fsdp"),
    # DeepSpeed (flags, or distributed_type: DEEPSPEED and deepspeed_config:)
    _R("use_deepspeed", "ACCELERATE_USE_DEEPSPEED", _lower, "deepspeed", True),
    _R("deepspeed_fields_from_accelerate_config", "ACCELERATE_CONFIG_DS_FIELDS", _lower,
       "deepspeed", ""),
    _R("zero_stage", _DS + "ZERO_STAGE", _text, "deepspeed"),
    _R("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", _lower, "deepspeed"),
    _R("offload_optimizer_device", _DS + "OFFLOAD_OPTIMIZER_DEVICE", _lower, "deepspeed"),
    _R("offload_param_device", _DS + "OFFLOAD_PARAM_DEVICE", _lower, "deepspeed"),
    _R("offload_optimizer_nvme_path", _DS + "OFFLOAD_OPTIMIZER_NVME_PATH", _text, "deepspeed"),
    _R("offload_param_nvme_path", _DS + "OFFLOAD_PARAM_NVME_PATH", _text, "deepspeed"),
    _R("zero3_init_flag", _DS + "ZERO3_INIT", _lower, "deepspeed"),
    _R("zero3_save_16bit_model", _DS + "ZERO3_SAVE_16BIT_MODEL", _lower, "deepspeed"),
    _R("deepspeed_config_file", _DS + "CONFIG_FILE", _text, "deepspeed"),
    _R("deepspeed_moe_layer_cls_names", _DS + "MOE_LAYER_CLS_NAMES", _text, "deepspeed"),
    # ParallelismConfig (parallelism_config: in a config file, the parallelism_config_* options)
    _R("use_parallelism_config", "ACCELERATE_USE_PARALLELISM_CONFIG", _lower, "parallelism",
       True),
    *(_R(f"parallelism_config_{axis}_size", f"{_PC}{axis.upper()}_SIZE", _text, "parallelism", 1)
      for axis in _PC_SIZES[:4]),
    _R("parallelism_config_cp_backend", _PC + "CP_BACKEND", _text, "parallelism", "torch"),
    _R("parallelism_config_sp_size", _PC + "SP_SIZE", _text, "parallelism", 1),
    _R("parallelism_config_sp_backend", _PC + "SP_BACKEND", _text, "parallelism", "deepspeed"),
    _R("parallelism_config_cp_comm_strategy", _PC + "CP_COMM_STRATEGY", _text, "parallelism",
       "allgather", _above_one("parallelism_config_cp_size")),
    _R("parallelism_config_sp_seq_length", _PC + "SP_SEQ_LENGTH", _text, "parallelism", None,
       _above_one("parallelism_config_sp_size")),
    _R("parallelism_config_sp_seq_length_is_variable", _PC + "SP_SEQ_LENGTH_IS_VARIABLE", _text,
       "parallelism", True, _above_one("parallelism_config_sp_size")),
    _R("parallelism_config_sp_attn_implementation", _PC + "SP_ATTN_IMPLEMENTATION", _text,
       "parallelism", "sdpa", _above_one("parallelism_config_sp_size")),
    # Megatron-LM (distributed_type: MEGATRON_LM, megatron_lm_config:); the others by prefix
    _R("use_megatron_lm", "ACCELERATE_USE_MEGATRON_LM", _lower, "megatron", True),
    _R("megatron_lm_tp_degree", _ML + "TP_DEGREE", _text, "megatron", 1),
    _R("megatron_lm_use_custom_fsdp", _ML + "USE_CUSTOM_FSDP", _text, "megatron", False),
    *(_R(f"megatron_lm_{name}", _ML + name.upper(), _text, "megatron", False)
      for name in ("no_load_optim", "eod_mask_loss", "no_save_optim", "optimizer_cpu_offload",
                   "use_precision_aware_optimizer", "overlap_cpu_optimizer_d2h_h2d")),
    _R("megatron_lm_pp_degree", _ML + "PP_DEGREE", _text, "megatron", 1),
    _R("megatron_lm_gradient_clipping", _ML + "GRADIENT_CLIPPING", _text, "megatron", 1.0),
)  # fmt: skip

#: settings written by prefix, every one given: (setting prefix, variable prefix, group)
FAMILIES = (("megatron_lm_", _ML, "megatron"), ("fp8_", "ACCELERATE_FP8_", "fp8"))


#: Accelerate's FP8 settings (``fp8_config:`` in a config file; written with mixed_precision fp8)
FP8_SETTINGS = (
    "fp8_backend", "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format",
    "fp8_amax_history_length", "fp8_amax_compute_algorithm", "fp8_override_linear_precision",
    "fp8_opt_level", "fp8_optimization_level", "fp8_enable_fsdp_float8_all_gather",
    "fp8_pad_inner_dim",
)  # fmt: skip


def settings_names() -> frozenset[str]:
    """Every setting name the contract knows (table rows and FP8's)."""
    return frozenset(row.setting for row in CONTRACT) | frozenset(FP8_SETTINGS)


def launch_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The contract's settings out of a front's parsed values (``vars()`` of ``nbaccel
    launch``'s arguments after its config file): table names and the Megatron-LM / FP8
    families; ``use_cpu`` (a config file's) counts as ``cpu``."""
    prefixes = tuple(prefix for prefix, _, _ in FAMILIES)
    known = settings_names()
    out = {k: v for k, v in values.items() if (k in known or k.startswith(prefixes))}
    out["cpu"] = bool(values.get("cpu") or values.get("use_cpu"))
    return out


def accelerate_environment(settings: Mapping[str, Any]) -> dict[str, str]:
    """The variables ``accelerate launch`` would give a rank for ``settings`` (Accelerate's
    setting names; None means not given), as :data:`CONTRACT` says."""
    active = {name: test(settings) for name, test in GROUPS.items()}
    env: dict[str, str] = {}
    for row in CONTRACT:
        if row.group is not None and not active[row.group]:
            continue
        value = settings.get(row.setting)
        if value is None:
            if row.group is None or row.default is None:
                continue
            value = row.default
        if row.when is not None and not row.when(settings):
            continue
        env[row.variable] = row.form(value)
    tabled = {row.setting for row in CONTRACT}
    for prefix, variable, group in FAMILIES:
        if not active[group]:
            continue
        for name, value in settings.items():
            if name.startswith(prefix) and name not in tabled and value is not None:
                if name == "fp8_override_linear_precision":
                    for part, item in zip(("FPROP", "DGRAD", "WGRAD"), value, strict=True):
                        env[f"{variable}OVERRIDE_{part}"] = str(item)
                else:
                    env[variable + name[len(prefix) :].upper()] = str(value)
    return env


def check_fsdp_settings(settings: Mapping[str, Any]) -> None:
    """Refuse FSDP settings Accelerate refuses, before any rank starts."""
    if not GROUPS["fsdp"](settings):
        return
    loading = settings.get("fsdp_cpu_ram_efficient_loading")
    syncing = settings.get("fsdp_sync_module_states")
    if _on(True if loading is None else loading) and not _on(True if syncing is None else syncing):
        raise ValueError(
            "fsdp_cpu_ram_efficient_loading: true needs fsdp_sync_module_states: true (rank 0 "
            "loads the weights and sends them to the others): set it, or turn the loading off."
        )


def contract_notices(env: Mapping[str, str], accelerators: int) -> list[str]:
    """One line for each setting of ``env`` that Accelerate's ``Accelerator`` (transformers'
    ``Trainer``, PEFT, TRL) cannot carry out on ranks with ``accelerators`` devices (0: CPU),
    naming what runs instead."""
    lines = []
    if accelerators == 0 and _on(env.get("ACCELERATE_USE_FSDP")):
        lines.append(
            "FSDP (use_fsdp / distributed_type: FSDP) on CPU ranks: Accelerate's Accelerator "
            "(Trainer, PEFT, TRL) runs FSDP on accelerators only, so it trains DDP here "
            f"(precision {env.get('ACCELERATE_MIXED_PRECISION', 'no')} kept); nbaccel's own "
            "Accelerator shards with FSDP2."
        )
    return lines
