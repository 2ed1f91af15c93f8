"""``FullyShardedDataParallelPlugin``: the options of FSDP2 model sharding, validated up front.

Pass one to ``Accelerator(fsdp_plugin=...)``;
``nbaccel.training.strategies.fsdp.strategy.shard_model`` reads it. Only
FSDP2 (torch's ``fully_shard``) is implemented; every option is checked here so that a typo fails
when the plugin is built, not in the middle of ``prepare`` on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from nbaccel.values.booleans import env_flag, parse_bool

__all__ = [
    "FullyShardedDataParallelPlugin",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
]

STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


# FSDP1's sharding strategies (names or numbers) as FSDP2's one switch, reshard_after_forward
_RESHARD_BY_STRATEGY = {
    "FULL_SHARD": True, "1": True, "NO_SHARD": True, "3": True, "HYBRID_SHARD": True, "4": True,
    "SHARD_GRAD_OP": False, "2": False, "_HYBRID_SHARD_ZERO2": False, "5": False,
}  # fmt: skip


def enable_fsdp_ram_efficient_loading() -> None:
    """Turn on ``cpu_ram_efficient_loading`` for plugins built from now on (and tell Hugging
    Face transformers that FSDP is in use), through the environment."""
    os.environ.setdefault("ACCELERATE_USE_FSDP", "True")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Turn ``cpu_ram_efficient_loading`` off for plugins built from now on."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def _to_dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(
        f"{what}={value!r} is not a dtype; use a torch.dtype or one of {list(_DTYPES)}."
    )


@dataclass
class FullyShardedDataParallelPlugin:
    """How ``Accelerator.prepare`` shards a model with FSDP2 (torch's ``fully_shard``).

    Args:
        fsdp_version: must be 2; FSDP1 (``FullyShardedDataParallel``) is not supported.
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3, the default)
            or keep them until backward (ZeRO-2-like, more memory, less communication).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        mixed_precision_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict of its
            fields (dtypes may be strings such as ``"bf16"``), a dtype string for both param and
            reduce dtypes, or None (``Accelerator(mixed_precision="bf16")`` then fills it in).
        auto_wrap_policy: ``"TRANSFORMER_BASED_WRAP"``, ``"SIZE_BASED_WRAP"``, ``"NO_WRAP"``, or a
            callable ``policy(module) -> bool`` choosing the submodules that get their own shard
            group. None picks transformer-based when layer class names are known, size-based when
            ``min_num_params`` is set, and otherwise only the root is sharded.
        transformer_cls_names_to_wrap: layer class names (list or comma-separated string); the
            model's ``_no_split_modules`` is used when this is None and transformer wrapping is on.
        min_num_params: size threshold for ``SIZE_BASED_WRAP`` (default 100 million).
        activation_checkpointing: recompute the activations of every wrapped block in backward.
        state_dict_type: ``"FULL_STATE_DICT"`` (gathered on rank 0) or ``"SHARDED_STATE_DICT"``
            (one ``torch.distributed.checkpoint`` directory, each rank writing its shard).
        cpu_ram_efficient_loading: only rank 0 holds real weights before sharding; the others
            may build the model on the ``meta`` device and receive rank 0's values while sharding.
        state_dict_config: torch's ``FullStateDictConfig`` / ``ShardedStateDictConfig``
            matching ``state_dict_type``; None fills in Accelerate's defaults (full: offloaded to
            CPU, on rank 0 only, which is how nbaccel gathers a full state dict).
        optim_state_dict_config: the same for the optimizer (torch's ``Optim`` variants).
    """

    fsdp_version: int = 2
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    mixed_precision_policy: Any = None
    auto_wrap_policy: str | Callable[[torch.nn.Module], bool] | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None
    activation_checkpointing: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    cpu_ram_efficient_loading: bool = False
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    #: set by ``set_mixed_precision("fp8")``: FP8 layers wanted (bf16 for the FSDP gathers)
    fp8_requested: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        launched = os.environ.get("FSDP_VERSION", "").strip()
        if launched:  # a launch's FSDP_VERSION=1 is Accelerate's default: FSDP2 here (said)
            self.fsdp_version = 2 if launched == "1" else int(launched)
        if self.fsdp_version == 1:
            raise NotImplementedError(
                "fsdp_version=1 (FullyShardedDataParallel) is not supported by nbaccel: only FSDP2 "
                "(torch.distributed.fsdp.fully_shard) is. Use fsdp_version=2."
            )
        if self.fsdp_version != 2:
            raise ValueError(f"fsdp_version must be 2 (FSDP2), not {self.fsdp_version!r}.")
        for name in ("reshard_after_forward", "cpu_offload", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, not {getattr(self, name)!r}.")
        flag = env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
        if flag is not None:
            self.cpu_ram_efficient_loading = flag
        self.state_dict_type = self._check_state_dict_type(self.state_dict_type)
        self._set_state_dict_configs()
        self.transformer_cls_names_to_wrap = self._check_cls_names(
            self.transformer_cls_names_to_wrap
        )
        if self.min_num_params is not None and (
            not isinstance(self.min_num_params, int) or self.min_num_params < 0
        ):
            raise ValueError(
                f"min_num_params must be a non-negative int, not {self.min_num_params!r}."
            )
        self.auto_wrap_policy = self._check_auto_wrap(self.auto_wrap_policy)
        self.mixed_precision_policy = self._check_mixed_precision(self.mixed_precision_policy)

    # -- validation -----------------------------------------------------------------------------
    def _set_state_dict_configs(self) -> None:
        """Check the state dict configs against ``state_dict_type``; fill in the defaults."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
        )

        full = self.state_dict_type == "FULL_STATE_DICT"
        kinds = {
            "state_dict_config": (FullStateDictConfig if full else ShardedStateDictConfig),
            "optim_state_dict_config": (
                FullOptimStateDictConfig if full else ShardedOptimStateDictConfig
            ),
        }
        for name, kind in kinds.items():
            value = getattr(self, name)
            if value is None:
                value = kind(offload_to_cpu=True, rank0_only=True) if full else kind()
            elif isinstance(value, dict):
                value = kind(**value)
            elif not isinstance(value, kind):
                raise TypeError(
                    f"{name} must be a torch.distributed.fsdp.{kind.__name__} for "
                    f"state_dict_type={self.state_dict_type!r}, not {type(value).__name__}."
                )
            setattr(self, name, value)

    @staticmethod
    def _check_state_dict_type(value: Any) -> str:
        text = getattr(value, "name", value)  # accepts torch's StateDictType enum too
        text = str(text).upper()
        if text == "LOCAL_STATE_DICT":
            raise NotImplementedError(
                "state_dict_type='LOCAL_STATE_DICT' is an FSDP1 format; with FSDP2 use "
                "'SHARDED_STATE_DICT' (torch.distributed.checkpoint) or 'FULL_STATE_DICT'."
            )
        if text not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type must be one of {STATE_DICT_TYPES}, not {value!r}.")
        return text

    @staticmethod
    def _check_cls_names(value: Any) -> list[str] | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
            raise TypeError(
                "transformer_cls_names_to_wrap must be a list of class names or a comma-separated "
                f"string, not {value!r}."
            )
        return list(value)

    def _check_auto_wrap(self, value: Any) -> str | Callable | None:
        if value is None:
            if self.transformer_cls_names_to_wrap:
                return "TRANSFORMER_BASED_WRAP"
            if self.min_num_params is not None:
                return "SIZE_BASED_WRAP"
            return None
        if callable(value):
            return value
        text = str(value).upper()
        aliases = {"TRANSFORMER": "TRANSFORMER_BASED_WRAP", "SIZE": "SIZE_BASED_WRAP"}
        text = aliases.get(text, text)
        if text not in AUTO_WRAP_POLICIES:
            raise ValueError(
                f"auto_wrap_policy must be one of {AUTO_WRAP_POLICIES} or a callable, "
                f"not {value!r}."
            )
        if text == "SIZE_BASED_WRAP" and self.min_num_params is None:
            self.min_num_params = 100_000_000
        return text

    @staticmethod
    def _check_mixed_precision(value: Any) -> Any:
        if value is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if isinstance(value, MixedPrecisionPolicy):
            return value
        if isinstance(value, str | torch.dtype):
            dtype = _to_dtype(value, "mixed_precision_policy")
            return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        if isinstance(value, dict):
            known = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
            unknown = set(value) - known
            if unknown:
                raise ValueError(
                    f"Unknown mixed_precision_policy keys {sorted(unknown)}; use {sorted(known)}."
                )
            kwargs = {
                k: (v if k == "cast_forward_inputs" else _to_dtype(v, k)) for k, v in value.items()
            }
            return MixedPrecisionPolicy(**kwargs)
        raise TypeError(
            "mixed_precision_policy must be a MixedPrecisionPolicy, a dict of its fields or a "
            f"dtype, not {type(value).__name__}."
        )

    # -- helpers used by shard_model ------------------------------------------------------------
    def set_mixed_precision(
        self,
        mixed_precision: str | torch.dtype,
        buffer_autocast: bool = False,
        override: bool = False,
    ) -> None:
        """Set ``mixed_precision_policy`` from ``Accelerator(mixed_precision=...)`` (the FSDP
        strategy calls it): parameters are gathered in that dtype for forward and backward,
        gradients reduced in float32. A policy the plugin already has is kept unless
        ``override``; ``"no"`` sets none. ``buffer_autocast`` is FSDP1's and has no effect.
        ``"fp8"`` (Accelerate's mapping) gathers parameters in bf16 and asks for FP8 training: the
        Accelerator then turns FP8 layers on (the recipe's, or torchao's default) or refuses."""
        if isinstance(mixed_precision, str) and mixed_precision.lower() == "fp8":
            self.fp8_requested = True
            mixed_precision = "bf16"
        if self.mixed_precision_policy is not None and not override:
            return
        dtype = _to_dtype(mixed_precision, "mixed_precision") if mixed_precision != "no" else None
        self.mixed_precision_policy = self._check_mixed_precision(
            None if dtype is None else {"param_dtype": dtype, "reduce_dtype": torch.float32}
        )

    @classmethod
    def from_environment(cls) -> FullyShardedDataParallelPlugin | None:
        """The plugin a launcher asked for through the environment, or None.

        ``nbaccel launch --use_fsdp --fsdp_...`` (and ``accelerate launch``) tell the ranks
        ``ACCELERATE_USE_FSDP=true`` and ``FSDP_<OPTION>`` variables; a script that builds a
        plain ``Accelerator()`` then shards its model as the command line said.
        """
        if not any(env_flag(name) for name in ("ACCELERATE_USE_FSDP", "NBACCEL_USE_FSDP")):
            return None
        options: dict[str, Any] = {}
        reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD") or os.environ.get(
            "FSDP_SHARDING_STRATEGY"
        )
        if reshard:
            # FSDP1's strategy names map onto FSDP2's one switch
            strategy = reshard.strip().upper()
            options["reshard_after_forward"] = _RESHARD_BY_STRATEGY.get(strategy)
            if options["reshard_after_forward"] is None:
                options["reshard_after_forward"] = parse_bool(reshard, "FSDP_RESHARD_AFTER_FORWARD")
        for field_name, env_name in (
            ("cpu_offload", "FSDP_OFFLOAD_PARAMS"),
            ("activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING"),
        ):
            flag = env_flag(env_name, None)
            if flag is not None:
                options[field_name] = flag
        for field_name, env_name in (
            ("auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY"),
            ("transformer_cls_names_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP"),
            ("state_dict_type", "FSDP_STATE_DICT_TYPE"),
        ):
            if os.environ.get(env_name):
                options[field_name] = os.environ[env_name]
        if os.environ.get("FSDP_MIN_NUM_PARAMS"):
            options["min_num_params"] = int(os.environ["FSDP_MIN_NUM_PARAMS"])
        return cls(**options)

    @property
    def is_sharded_state_dict(self) -> bool:
        return self.state_dict_type == "SHARDED_STATE_DICT"
