"""``DeepSpeedPlugin``: how an ``Accelerator`` runs DeepSpeed ZeRO (Accelerate's API).

Built from its fields (``zero_stage``, offload devices, clipping, ...) or from a DeepSpeed config
(``hf_ds_config``: dict, JSON file, ``HfDeepSpeedConfig``) whose ``"auto"`` values ``prepare``
fills from what it sees. Fields left unset fall back to the ``ACCELERATE_DEEPSPEED_*`` variables
``nbaccel launch --use_deepspeed`` sets for the ranks. Contradictions (a field against the file,
fp16 with bf16, an offload device that does not exist) are refused here, naming the keys.

Several plugins (``Accelerator(deepspeed_plugins={"student": ..., "teacher": ...})``) live in the
``AcceleratorState``; one is selected at a time (:meth:`DeepSpeedPlugin.select`), and its config is
the one transformers sees for ``zero.Init`` (``zero3_init_flag``). DeepSpeed itself is imported
only when a context or engine is built (:mod:`.deepspeed_runtime`).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nbaccel.training.strategies.deepspeed.config import (
    AUTO,
    HfDeepSpeedConfig,
    check_config,
    config_precision,
    fill_auto,
    get_value,
    unfilled,
)
from nbaccel.values.booleans import parse_bool

__all__ = ["DeepSpeedPlugin", "get_active_deepspeed_plugin"]

_ENV = "ACCELERATE_DEEPSPEED_"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _env(name: str, default: Any = None) -> Any:
    value = os.environ.get(name)
    return default if value is None or value.lower() in ("", "none") else value


def _env_flag(name: str) -> bool | None:
    value = _env(name)
    return None if value is None else parse_bool(value, name)


def _number(text: Any, kind: type) -> Any:
    if text is None or text == AUTO or isinstance(text, int | float):
        return text
    return kind(text)


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed ZeRO for ``Accelerator(deepspeed_plugin=...)``.

    Args:
        hf_ds_config: a DeepSpeed config (dict, JSON file path, ``HfDeepSpeedConfig``); when
            given, the fields below only fill its ``"auto"`` values and must agree with it.
        gradient_accumulation_steps: steps per optimizer step ("auto": the Accelerator's).
        gradient_clipping: max gradient norm the engine clips to (None: 1.0 where "auto").
        zero_stage: 0, 1, 2 or 3 (default 2).
        is_train_batch_min: with several dataloaders, the smallest batch size is the micro batch.
        offload_optimizer_device: where ZeRO keeps the optimizer state: "none", "cpu", "nvme".
        offload_param_device: where ZeRO-3 keeps the parameters: "none", "cpu" or "nvme".
        offload_optimizer_nvme_path: the NVMe directory of the offloaded optimizer state.
        offload_param_nvme_path: the NVMe directory of the offloaded parameters.
        zero3_init_flag: build transformers models partitioned (``deepspeed.zero.Init``).
        zero3_save_16bit_model: gather ZeRO-3 weights to 16 bits when saving.
        transformer_moe_cls_names: comma-separated MoE layer classes kept whole under ZeRO-3.
        enable_msamp: MS-AMP (not run by nbaccel: refused when True).
        msamp_opt_level: MS-AMP's level (unused).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool = False
    msamp_opt_level: str = "O1"
    deepspeed_config: dict = field(default_factory=dict, init=False, repr=False)
    selected: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.enable_msamp:
            raise ValueError("enable_msamp: MS-AMP is not run by nbaccel; leave it False.")
        if self.hf_ds_config is None:
            self.hf_ds_config = _env(_ENV + "CONFIG_FILE")
        given = self._given_values()
        if self.hf_ds_config is None:
            config = self._config_from_fields(given)
        else:
            config = HfDeepSpeedConfig(self.hf_ds_config).config
            wrong = fill_auto(config, given, must_match=given)
            if wrong:
                raise ValueError(
                    "The DeepSpeed config contradicts the DeepSpeedPlugin arguments (or the "
                    f"launch options): {', '.join(wrong)}. Change one of them, or set the "
                    "config's value to 'auto'."
                )
        config.setdefault("steps_per_print", 2**31 - 1)  # no periodic engine prints
        check_config(config)
        self.hf_ds_config = HfDeepSpeedConfig(config)
        self.deepspeed_config = self.hf_ds_config.config
        self.zero_stage = get_value(config, "zero_optimization.stage", 0)
        self.gradient_accumulation_steps = config.get("gradient_accumulation_steps", AUTO)
        if self.zero3_init_flag is None:
            self.zero3_init_flag = bool(_env_flag(_ENV + "ZERO3_INIT"))
        if self.zero3_init_flag and self.zero_stage != 3:
            warnings.warn(
                f"zero3_init_flag applies to ZeRO stage 3 only (zero_optimization.stage is "
                f"{self.zero_stage}): it is turned off.",
                stacklevel=2,
            )
            self.zero3_init_flag = False
        self.dschf: HfDeepSpeedConfig | None = None

    def _given_values(self) -> dict[str, Any]:
        """The fields (or launch variables) that were set, as dotted config keys."""
        stage = self.zero_stage if self.zero_stage is not None else _env(_ENV + "ZERO_STAGE")
        steps = self.gradient_accumulation_steps
        if steps is None:
            steps = _env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        clip = self.gradient_clipping
        clip = clip if clip is not None else _env("ACCELERATE_GRADIENT_CLIPPING")
        save16 = self.zero3_save_16bit_model
        save16 = save16 if save16 is not None else _env_flag(_ENV + "ZERO3_SAVE_16BIT_MODEL")
        values = {
            "zero_optimization.stage": _number(stage, int),
            "gradient_accumulation_steps": _number(steps, int),
            "gradient_clipping": _number(clip, float),
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": save16,
        }
        for part in ("optimizer", "param"):
            device = getattr(self, f"offload_{part}_device") or _env(
                _ENV + f"OFFLOAD_{part.upper()}_DEVICE"
            )
            path = getattr(self, f"offload_{part}_nvme_path") or _env(
                _ENV + f"OFFLOAD_{part.upper()}_NVME_PATH"
            )
            values[f"zero_optimization.offload_{part}.device"] = device
            values[f"zero_optimization.offload_{part}.nvme_path"] = path
        moe = self.transformer_moe_cls_names or _env(_ENV + "MOE_LAYER_CLS_NAMES")
        self.transformer_moe_cls_names = moe
        return {k: v for k, v in values.items() if v is not None}

    @staticmethod
    def _config_from_fields(given: dict[str, Any]) -> dict[str, Any]:
        config: dict[str, Any] = {
            "train_batch_size": AUTO,
            "train_micro_batch_size_per_gpu": AUTO,
            "gradient_accumulation_steps": given.get("gradient_accumulation_steps", AUTO),
            "zero_optimization": {"stage": given.get("zero_optimization.stage", 2)},
        }
        if "gradient_clipping" in given:
            config["gradient_clipping"] = given["gradient_clipping"]
        zero = config["zero_optimization"]
        for part in ("optimizer", "param"):
            device = given.get(f"zero_optimization.offload_{part}.device", "none")
            zero[f"offload_{part}"] = {"device": device}
            path = given.get(f"zero_optimization.offload_{part}.nvme_path")
            if device == "nvme" or path:
                zero[f"offload_{part}"]["nvme_path"] = path
        zero["stage3_gather_16bit_weights_on_model_save"] = given.get(
            "zero_optimization.stage3_gather_16bit_weights_on_model_save", False
        )
        return config

    # -- queries and filling (Accelerate's names) ---------------------------------------------
    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The config's value at ``ds_key_long`` ("zero_optimization.stage")."""
        return get_value(self.deepspeed_config, ds_key_long, default)

    def is_auto(self, ds_key_long: str) -> bool:
        """True when the config's value at ``ds_key_long`` is ``"auto"``."""
        return self.get_value(ds_key_long) == AUTO

    def fill_match(
        self, ds_key_long: str, mismatches: list | None = None, must_match: bool = True, **kwargs
    ) -> None:
        """Fill ``ds_key_long`` when "auto" with the value in ``kwargs`` (its last part)."""
        key = ds_key_long.split(".")[-1]
        if key not in kwargs:
            return
        wrong = fill_auto(self.deepspeed_config, {ds_key_long: kwargs[key]},
                          must_match=(ds_key_long,) if must_match else ())  # fmt: skip
        if mismatches is not None:
            mismatches.extend(wrong)
        elif wrong:
            raise ValueError(f"DeepSpeed config values that mismatch: {', '.join(wrong)}.")

    def deepspeed_config_process(self, must_match: bool = True, **kwargs: Any) -> None:
        """Fill every "auto" key named in ``kwargs`` (dotted keys); mismatches raise when
        ``must_match``."""
        wrong = fill_auto(self.deepspeed_config, kwargs, must_match=kwargs if must_match else ())
        if wrong:
            raise ValueError(
                f"Please correct the DeepSpeed config values that mismatch: {', '.join(wrong)}."
            )
        self.hf_ds_config.set_stage_and_offload()

    def set_mixed_precision(self, mixed_precision: str) -> str:
        """Settle the precision between the config and the Accelerator's ``mixed_precision``;
        returns the one the run uses. A contradiction raises naming both."""
        wanted = str(mixed_precision or "no").lower()
        if wanted == "fp8":
            raise ValueError("mixed_precision='fp8' is not run with DeepSpeed by nbaccel.")
        found = config_precision(self.deepspeed_config)
        if found is not None and wanted != "no" and found != wanted:
            raise ValueError(
                f"mixed_precision={wanted!r} contradicts the DeepSpeed config, which "
                f"{'turns both off' if found == 'no' else f'enables {found}'} "
                f"(fp16.enabled / bf16.enabled): make them agree, or set those keys to 'auto'."
            )
        chosen = found if found is not None and wanted == "no" else wanted
        config = self.deepspeed_config
        for kind in ("fp16", "bf16"):
            section = config.get(kind)
            if isinstance(section, dict) and section.get("enabled", AUTO) == AUTO:
                section["enabled"] = chosen == kind
            elif section is None and chosen == kind:
                config[kind] = {"enabled": True}
        return chosen

    def is_zero3_init_enabled(self) -> bool:
        """Whether models are built partitioned (``zero3_init_flag`` under ZeRO-3)."""
        return bool(self.zero3_init_flag) and self.zero_stage == 3

    def init_config(self) -> dict[str, Any]:
        """A copy of the config ``deepspeed.zero.Init`` can read: batch keys still "auto"
        replaced by values that agree (they do not matter for partitioning), other "auto"
        entries dropped."""
        config = copy.deepcopy(self.deepspeed_config)
        if config.get("train_batch_size") == AUTO:
            config.pop("train_batch_size")  # DeepSpeed derives it from the two below
        for key in _BATCH_KEYS[1:]:
            if config.get(key) == AUTO:
                config[key] = 1
        if "train_batch_size" in config:
            config.pop("train_micro_batch_size_per_gpu", None)
        reader = HfDeepSpeedConfig(config)
        for key in unfilled(config):
            reader.del_config_sub_tree(key)
        return reader.config

    def set_deepspeed_weakref(self) -> None:
        """Tell transformers which config to build models under (``zero.Init`` for ZeRO-3)."""
        from transformers.integrations import deepspeed as hf_deepspeed

        self.dschf = HfDeepSpeedConfig(self.init_config())
        hf_deepspeed.set_hf_deepspeed_config(self.dschf)

    @contextmanager
    def zero3_init_context_manager(self, enable: bool = False) -> Iterator[None]:
        """With ``enable``, models built inside are partitioned (``deepspeed.zero.Init``); without
        it, transformers' automatic ``zero.Init`` is off inside."""
        if enable:
            from nbaccel.training.strategies.deepspeed.runtime import import_deepspeed

            deepspeed = import_deepspeed(_run_device())
            with deepspeed.zero.Init(config_dict_or_path=self.init_config()):
                yield
            return
        saved = self.zero3_init_flag
        self.zero3_init_flag = False
        had = self.dschf
        if had is not None:
            from transformers.integrations import deepspeed as hf_deepspeed

            hf_deepspeed.unset_hf_deepspeed_config()
        try:
            yield
        finally:
            self.zero3_init_flag = saved
            if had is not None:
                self.set_deepspeed_weakref()

    def set_moe_leaf_modules(self, model: Any) -> None:
        """Keep the ``transformer_moe_cls_names`` layers whole under ZeRO-3."""
        names = [n.strip() for n in (self.transformer_moe_cls_names or "").split(",") if n.strip()]
        if not names:
            return
        from deepspeed.utils import set_z3_leaf_modules

        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        missing = sorted(set(names) - {c.__name__ for c in classes})
        if missing:
            raise ValueError(f"transformer_moe_cls_names {missing} are not layers of this model.")
        set_z3_leaf_modules(model, list(classes))

    # -- several plugins ----------------------------------------------------------------------
    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this the active plugin (``AcceleratorState.select_deepspeed_plugin``)."""
        self.selected = True
        if self.is_zero3_init_enabled():
            self.set_deepspeed_weakref()
        elif self.dschf is None:
            _unset_transformers_config()

    def _unselect(self) -> None:
        self.selected = False
        self.dschf = None


def _unset_transformers_config() -> None:
    import sys

    module = sys.modules.get("transformers.integrations.deepspeed")
    if module is not None:
        module.unset_hf_deepspeed_config()


def _run_device() -> Any:
    from nbaccel.distributed.state import PartialState

    state = PartialState.__new__(PartialState)
    state.__dict__ = PartialState._shared_state
    return state.__dict__.get("device", "cpu")


def get_active_deepspeed_plugin(state: Any) -> DeepSpeedPlugin:
    """The selected plugin of ``state`` (an ``AcceleratorState``); ValueError when DeepSpeed
    is not in use."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError(
            "DeepSpeed is not in use: build the Accelerator with deepspeed_plugin=... (or "
            "deepspeed_plugins={...}) first."
        )
    return plugin
