"""A DeepSpeed config: reading it, its ``"auto"`` values, and the contradictions refused early.

:class:`HfDeepSpeedConfig` is Accelerate's reader of a DeepSpeed config (a dict, a JSON file or
base64 JSON), with dotted-key access (``get_value("zero_optimization.stage")``). The functions
below fill ``"auto"`` entries (:func:`fill_auto`) and refuse configs that contradict themselves or
the run (:func:`check_config`), naming the keys and the fix, before any engine or rank starts.
Pure logic: DeepSpeed is not imported here.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "AUTO",
    "HfDeepSpeedConfig",
    "check_config",
    "config_precision",
    "fill_auto",
    "read_config",
]

AUTO = "auto"
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def read_config(config: Any) -> dict[str, Any]:
    """A config given as a dict, a path to a JSON file, or base64-encoded JSON, as a new dict."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, HfDeepSpeedConfig):
        return copy.deepcopy(config.config)
    if isinstance(config, os.PathLike) or (isinstance(config, str) and os.path.exists(config)):
        try:
            with open(config, encoding="utf-8") as handle:
                return json.load(handle)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"DeepSpeed config file {str(config)!r} is not valid JSON: {err}."
            ) from None
    if isinstance(config, str):
        try:
            return json.loads(base64.urlsafe_b64decode(config).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise ValueError(
                f"DeepSpeed config {config!r} is neither an existing JSON file nor base64 JSON: "
                "pass a dict, or the path of a JSON file that exists."
            ) from None
    raise ValueError(f"A DeepSpeed config must be a dict or a JSON file path, not {type(config)}.")


class HfDeepSpeedConfig:
    """A DeepSpeed config with dotted-key queries (Accelerate's and transformers' reader).

    Args:
        config_file_or_dict: a dict, a JSON file path, or base64-encoded JSON.
    """

    def __init__(self, config_file_or_dict: Any) -> None:
        self.config = read_config(config_file_or_dict)
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        """Read the ZeRO stage and whether anything is offloaded (after the config changed)."""
        self._stage = self.get_value("zero_optimization.stage", -1)
        self._offload = False
        if self.is_zero2() or self.is_zero3():
            devices = {
                self.get_value("zero_optimization.offload_optimizer.device"),
                self.get_value("zero_optimization.offload_param.device"),
            }
            self._offload = bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        """The dict holding the last part of ``ds_key_long`` (None when a parent is missing)."""
        node: Any = self.config
        *parents, key = ds_key_long.split(".")
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at ``ds_key_long`` ("a.b.c"), or ``default``."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Remove ``ds_key_long`` and what is under it."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
            return
        node.pop(key)

    def is_true(self, ds_key_long: str) -> bool:
        """True when the value is set and true (``"auto"`` is not)."""
        value = self.get_value(ds_key_long)
        return False if value is None or value == AUTO else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        """True when the value is set and false."""
        value = self.get_value(ds_key_long)
        return False if value is None or value == AUTO else not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


# ---------------------------------------------------------------------------- "auto" values
def _node(config: dict, dotted: str, create: bool = False) -> tuple[dict | None, str]:
    *parents, key = dotted.split(".")
    for parent in parents:
        if not isinstance(config.get(parent), dict):
            if not create:
                return None, key
            config[parent] = {}
        config = config[parent]
    return config, key


def get_value(config: dict, dotted: str, default: Any = None) -> Any:
    """The value at ``dotted`` in ``config`` ("a.b.c"), or ``default``."""
    node, key = _node(config, dotted)
    return default if node is None else node.get(key, default)


def is_auto(config: dict, dotted: str) -> bool:
    """True when ``dotted`` is ``"auto"`` in ``config``."""
    return get_value(config, dotted) == AUTO


def fill_auto(
    config: dict, values: Mapping[str, Any], must_match: Iterable[str] = (), add: bool = False
) -> list[str]:
    """Replace ``"auto"`` entries of ``config`` by ``values`` (dotted keys); with ``add`` also set
    keys that are missing. Returns the contradictions: keys in ``must_match`` whose set value
    differs from the one given, as ``"key=config (given)"`` lines."""
    wrong = []
    strict = set(must_match)
    for dotted, value in values.items():
        node, key = _node(config, dotted, create=add)
        if node is None:
            continue
        if key not in node:
            if add:
                node[key] = value
        elif node[key] == AUTO:
            node[key] = value
        elif dotted in strict and value is not None and node[key] != value:
            wrong.append(f"{dotted}={node[key]!r} (given: {value!r})")
    return wrong


def unfilled(config: Any, prefix: str = "") -> list[str]:
    """The dotted keys still ``"auto"``."""
    if isinstance(config, dict):
        return [k for key, v in config.items() for k in unfilled(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if config == AUTO else []


# ---------------------------------------------------------------------------- checks
def config_precision(config: dict) -> str | None:
    """The precision a config turns on ("fp16", "bf16"), "no" when it turns both off, None when
    it leaves it to the run ("auto" or absent)."""
    fp16 = get_value(config, "fp16.enabled")
    bf16 = get_value(config, "bf16.enabled", get_value(config, "bfloat16.enabled"))
    if fp16 is True and bf16 is True:
        raise ValueError(
            "The DeepSpeed config enables both fp16.enabled and bf16.enabled: keep one of them "
            "(or set both to 'auto' and choose with mixed_precision)."
        )
    if fp16 is True:
        return "fp16"
    if bf16 is True:
        return "bf16"
    if fp16 is False and bf16 in (False, None) or bf16 is False and fp16 is None:
        return "no"
    return None


def check_config(config: dict, world_size: int | None = None) -> None:
    """Refuse a config that contradicts itself, naming the keys and the fix (ValueError)."""
    config_precision(config)
    stage = get_value(config, "zero_optimization.stage", 0)
    if stage not in (0, 1, 2, 3, AUTO):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}.")
    for part in ("offload_optimizer", "offload_param"):
        device = get_value(config, f"zero_optimization.{part}.device", "none")
        if device == AUTO:
            continue
        if str(device).lower() not in OFFLOAD_DEVICES:
            raise ValueError(
                f"zero_optimization.{part}.device={device!r} is not an offload device DeepSpeed "
                f"has: use one of {', '.join(OFFLOAD_DEVICES)} ('cpu' keeps it in host memory)."
            )
        if str(device).lower() == "nvme":
            path = get_value(config, f"zero_optimization.{part}.nvme_path")
            if not path or not os.path.isdir(str(path)):
                raise ValueError(
                    f"zero_optimization.{part}.device='nvme' needs zero_optimization.{part}."
                    f"nvme_path set to a directory that exists on every rank (got {path!r})."
                )
    param_device = str(get_value(config, "zero_optimization.offload_param.device", "none"))
    if param_device.lower() not in ("none", AUTO) and stage not in (3, AUTO):
        raise ValueError(
            f"zero_optimization.offload_param.device={param_device!r} needs ZeRO stage 3 "
            f"(zero_optimization.stage is {stage}): set the stage to 3, or offload only the "
            "optimizer (zero_optimization.offload_optimizer)."
        )
    optimizer_device = str(get_value(config, "zero_optimization.offload_optimizer.device", "none"))
    if optimizer_device.lower() not in ("none", AUTO) and stage in (0,):
        raise ValueError(
            f"zero_optimization.offload_optimizer.device={optimizer_device!r} needs ZeRO stage "
            "1, 2 or 3 (zero_optimization.stage is 0)."
        )
    _check_batch_sizes(config, world_size)


def _check_batch_sizes(config: dict, world_size: int | None) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values = {k: config.get(k) for k in keys}
    for key, value in values.items():
        if value not in (None, AUTO) and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} must be a positive integer or 'auto', got {value!r}.")
        if isinstance(value, int) and value < 1:
            raise ValueError(f"{key} must be a positive integer or 'auto', got {value!r}.")
    total, micro, steps = (values[k] for k in keys)
    known = world_size and all(isinstance(v, int) for v in (total, micro, steps))
    if known and total != micro * steps * world_size:
        raise ValueError(
            f"The DeepSpeed config gives two batch sizes: train_batch_size={total}, but "
            f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={steps} x "
            f"{world_size} processes = {micro * steps * world_size}. Set train_batch_size "
            "to 'auto' (or to that product)."
        )
