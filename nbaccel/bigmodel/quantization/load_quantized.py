"""``load_and_quantize_model``: fill a (usually empty) model from a checkpoint, quantizing its
linear layers tensor by tensor, and place it on a device map (CPU or GPU, with cpu/disk offload of
8-bit weights).

Order: every check first (config, backend installed and recent enough, checkpoint present,
device map a quantized model can follow), then the swap of the linears (bitsandbytes layers on
``meta``), then one pass over the checkpoint: each float weight of a quantized layer is cast to
``torch_dtype`` and quantized on the device that computes it (or quantized on the CPU and written
to the offload folder), every other tensor is cast and placed. Tensors are read as views of the
mapped checkpoint files (a tensor kept as stored is the file's bytes, not a copy). Every
quantized weight -- bitsandbytes 4-bit and 8-bit, in memory or offloaded, and torchao -- is
quantized on several threads at once (a backend quantizes one tensor on one core), and its
mapped pages released once quantized. A tensor bound for a GPU (a weight quantized there, or
one kept in float) is streamed through the load's pinned staging buffers
(:class:`~nbaccel.bigmodel.loading.host_to_device.HostToDevice`), never copied whole on the
host. Peak memory: the quantized model plus the few weights in flight. A load that fails leaves
every tensor it placed on ``meta``: no half-loaded model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.dispatch import OFFLOAD_INDEX_ATTR, dispatch_model
from nbaccel.bigmodel.loading.checkpoint import CheckpointMismatchError, _expected_tensors
from nbaccel.bigmodel.loading.tensor_copies import TensorCopies, load_threads
from nbaccel.bigmodel.loading.weight_files import offload_weight
from nbaccel.bigmodel.placement import _new_param, to_torch_device
from nbaccel.bigmodel.planning.device_map import _lookup
from nbaccel.bigmodel.quantization.bnb_layers import (
    get_keys_to_not_convert,
    is_quantized_layer,
    matches_module,
    quantize_weight,
    replace_with_bnb_layers,
)
from nbaccel.bigmodel.quantization.config import BnbQuantizationConfig, TorchAoConfig
from nbaccel.bigmodel.quantization.quantized_device_map import (
    check_quantized_placement,
    get_quantized_model_device_map,
    main_device,
)
from nbaccel.bigmodel.quantization.requirements import require_backend
from nbaccel.bigmodel.ties import find_tied_parameters
from nbaccel.storage.safetensors_file import SafetensorsFile
from nbaccel.storage.weights import checkpoint_files, open_weights

__all__ = ["load_and_quantize_model"]

logger = logging.getLogger(__name__)


def _declared_devices(device_map: Any) -> set[Any]:
    if isinstance(device_map, Mapping):
        return {d if isinstance(d, int) else str(d) for d in device_map.values()}
    if isinstance(device_map, int | torch.device) or device_map in ("cpu", "disk"):
        return {str(device_map) if not isinstance(device_map, int) else device_map}
    return {0} if torch.cuda.is_available() else {"cpu"}


def _tensors(
    weights_location: Any, in_memory: Mapping[str, torch.Tensor] | None, opened: list
) -> Iterator[tuple[str, torch.Tensor, str, Callable[[], None] | None]]:
    """(name, tensor, file, release of its mapped pages) for every tensor of the checkpoint (or
    the model's own tensors). Safetensors tensors are views of the mapped file (no copy); every
    file's header is checked before the first tensor is read, and each opened file is appended
    to ``opened``."""
    if in_memory is not None:
        for key, tensor in in_memory.items():
            yield key, tensor, "the model's own tensors", None
        return
    files = checkpoint_files(weights_location)
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"Checkpoint {str(weights_location)!r}: its index names {path}, which does not "
                "exist (a shard not downloaded or copied?)."
            )
        if path.endswith(".safetensors"):
            opened.append(open_weights(path))  # a truncated or corrupt header fails here
    safetensors = iter([h for h in opened if isinstance(h, SafetensorsFile)])
    for path, keys in files.items():
        handle = next(safetensors) if path.endswith(".safetensors") else open_weights(path)
        for key in keys if keys is not None else list(handle.keys()):
            if isinstance(handle, SafetensorsFile) and key not in handle.entries:
                raise CheckpointMismatchError(
                    f"Checkpoint {str(weights_location)!r}: its index puts {key!r} in {path}, "
                    "which does not hold it."
                )
            if isinstance(handle, SafetensorsFile):
                yield key, handle.view(key), path, _releaser(handle, key)
            else:
                yield key, handle[key], path, None


def _releaser(handle: SafetensorsFile, key: str) -> Callable[[], None]:
    """Drops a quantized weight's mapped pages from this process once it is quantized."""
    return lambda: handle.advise(key, populate=False)


class _QuantizedLoad:
    """One call: where each tensor goes, what it becomes, what was offloaded."""

    def __init__(self, model, config, device_map, quantized, keep_fp32, offload_folder) -> None:
        self.model, self.config, self.device_map = model, config, device_map
        self.quantized, self.keep_fp32 = quantized, keep_fp32
        self.offload_folder = offload_folder
        self.main = main_device(device_map)
        self.owners = _expected_tensors(model)
        self.ties = {n: g for g in find_tied_parameters(model) for n in g}
        self.disk_index: dict[str, dict] = {}
        self.cpu_state: dict[str, torch.Tensor] = {}
        self.placed: set[str] = set()
        self.unexpected: list[str] = []
        self.copies = TensorCopies()  # pinned streams to the GPUs that quantize
        self.lock = threading.Lock()
        self.quantized_on: dict[str, int] = {}  # thread name -> weights it quantized

    def _offloaded(self, device: Any) -> bool:
        return device == "disk" or (device == "cpu" and self.main != "cpu")

    def _float_dtype(self, owner: str) -> torch.dtype:
        return torch.float32 if matches_module(owner, self.keep_fp32) else self.config.torch_dtype

    def put(
        self, key: str, tensor: torch.Tensor, path: str, release: Callable[[], None] | None = None
    ) -> Callable[[], None] | None:
        """Place ``key``; a weight to quantize is returned as the work to run (on a thread)."""
        if key not in self.owners:
            self.unexpected.append(key)
            return None
        if key in self.placed:
            return None
        mod, leaf, is_param = self.owners[key]
        expected = (mod._parameters[leaf] if is_param else mod._buffers[leaf]).shape
        if tuple(tensor.shape) != tuple(expected) and not _packed(mod, leaf):
            raise CheckpointMismatchError(
                f"{key!r} has shape {list(tensor.shape)} in {path} but {list(expected)} in "
                f"{type(self.model).__name__}: use the checkpoint saved from this model."
            )
        names = [n for n in self.ties.get(key, [key]) if n in self.owners]
        self.placed.update(names)
        owner, _, leaf = key.rpartition(".")
        device = _lookup(key, self.device_map)
        if owner in self.quantized and leaf == "weight":
            return self._quantize_job(key, owner, tensor, path, release, device)
        dtype = self._float_dtype(owner) if tensor.is_floating_point() else tensor.dtype
        if self._offloaded(device) and is_param:  # buffers stay with the computing device
            tensor = tensor.to(dtype)
            with self.lock:
                if device == "disk":
                    offload_weight(tensor, key, self.offload_folder, index=self.disk_index)
                else:
                    self.cpu_state[key] = tensor.contiguous()
            value = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        else:  # the mapped view on the CPU, a cast, or a copy streamed to the GPU
            value = self.copies.place(
                tensor, self.main if device in ("disk", "cpu") else device, dtype
            )
        self._assign(names, value)
        return None

    def reset(self) -> None:
        """After a failure: every tensor this load placed back on ``meta`` (no data), so no
        half-loaded model can be used."""
        with contextlib.suppress(Exception):
            self.copies.finish()
        for name in self.placed:
            mod, leaf, is_param = self.owners[name]
            old = mod._parameters[leaf] if is_param else mod._buffers[leaf]
            if old is None or old.device.type == "meta":
                continue
            meta = torch.empty(old.shape, dtype=old.dtype, device="meta")
            if is_param:
                mod._parameters[leaf] = nn.Parameter(meta, requires_grad=False)
            else:
                mod._buffers[leaf] = meta

    def _assign(self, names: list[str], value: torch.Tensor) -> None:
        shared = None
        for name in names:
            mod, leaf, is_param = self.owners[name]
            if is_param:
                if shared is None:
                    shared = _new_param(mod._parameters[leaf], value)
                mod._parameters[leaf] = shared
            else:
                mod._buffers[leaf] = value

    def _quantize_job(
        self,
        key: str,
        owner: str,
        tensor: torch.Tensor,
        path: str,
        release: Callable[[], None] | None,
        device: Any,
    ) -> Callable[[], None]:
        """The work that quantizes ``key`` (run on a thread; every backend and placement): the
        float weight cast to ``torch_dtype`` and quantized where it will be used, its mapped
        pages released. A weight quantized on an accelerator is streamed there first, here, on
        the loading thread, through this load's pinned staging buffers; one offloaded is
        quantized on the CPU and handed over under the lock."""
        module = self.model.get_submodule(owner)
        dtype = self.config.torch_dtype
        offloaded = self.config.backend == "bitsandbytes" and self._offloaded(device)
        target = torch.device("cpu") if offloaded else to_torch_device(device)
        source = tensor
        if target.type != "cpu":
            source = self.copies.place(tensor, target, dtype)
            self.copies.ready(target)  # quantizing on the device waits for its copy

        def quantize() -> None:
            try:
                value = source.to(dtype)  # the mapped view itself when the dtype matches
                if self.config.backend == "torchao":
                    from nbaccel.bigmodel.quantization.torchao_weights import (
                        quantize_linear_torchao,
                    )

                    module._parameters["weight"] = nn.Parameter(value, requires_grad=False)
                    quantize_linear_torchao(module, self.config)
                elif offloaded:
                    self._offload_8bit(key, module, quantize_weight(module, value, target), device)
                else:
                    module._parameters["weight"] = quantize_weight(module, value, target)
                if release is not None:
                    release()
                with self.lock:
                    name = threading.current_thread().name
                    self.quantized_on[name] = self.quantized_on.get(name, 0) + 1
            except Exception as err:
                raise RuntimeError(f"Quantizing {key!r} from {path} failed: {err}") from err

        return quantize

    def _offload_8bit(self, key: str, module: nn.Module, param: Any, device: Any) -> None:
        """An 8-bit weight quantized on the CPU, kept off the computing device: written to the
        offload folder (``"disk"``) or kept in CPU memory, a placeholder left in the layer."""
        from nbaccel.bigmodel.quantization.quantized_offload import (
            offloaded_int8_placeholder,
            quantize_and_offload_8bit,
        )

        with self.lock:  # the index and the CPU state dict are shared by the threads
            if device == "disk":
                quantize_and_offload_8bit(
                    self.model, param.data, key, None, self.offload_folder, self.disk_index,
                    fp16_statistics=param.SCB,
                )  # fmt: skip
            else:
                self.cpu_state[key] = param.data
                module._parameters["weight"] = offloaded_int8_placeholder(param.shape, param.SCB)

    def check_complete(self, weights_location: Any) -> None:
        missing = [
            n
            for n, (mod, leaf, is_param) in self.owners.items()
            if n not in self.placed
            and (mod._parameters[leaf] if is_param else mod._buffers[leaf]).device.type == "meta"
        ]
        if missing:
            shown = ", ".join(missing[:20]) + (
                f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            )
            extra = (
                f"; unexpected keys: {', '.join(self.unexpected[:20])}" if self.unexpected else ""
            )
            raise CheckpointMismatchError(
                f"{weights_location!s} does not fill {type(self.model).__name__}: missing keys "
                f"{shown}{extra}. Use the checkpoint saved from this model."
            )


def load_and_quantize_model(
    model: nn.Module,
    bnb_quantization_config: BnbQuantizationConfig | TorchAoConfig,
    weights_location: str | os.PathLike | None = None,
    device_map: Mapping[str, int | str | torch.device] | str | None = None,
    no_split_module_classes: list[str] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_state_dict: bool = False,
) -> nn.Module:
    """Quantize ``model``'s linear layers (8-bit or 4-bit bitsandbytes, or torchao weight-only)
    while loading ``weights_location`` into it, on the CPU or GPUs following ``device_map``.

    ``model`` is usually built under ``init_empty_weights()``; a model with real weights is
    quantized from its own tensors when ``weights_location`` is None. 8-bit weights mapped to
    ``"disk"`` (or to ``"cpu"`` beside a GPU) are offloaded quantized and loaded back for each
    forward. Tensors are read one at a time, so ``offload_state_dict`` is accepted but unneeded.
    Returns the model, with ``is_loaded_in_8bit`` / ``is_loaded_in_4bit`` and ``hf_device_map``.
    """
    config = bnb_quantization_config
    if not isinstance(config, BnbQuantizationConfig | TorchAoConfig):
        raise TypeError(
            "bnb_quantization_config must be a BnbQuantizationConfig (bitsandbytes) or a "
            f"TorchAoConfig (torchao), not {type(config).__name__}."
        )
    on_meta = any(t.device.type == "meta" for t in model.state_dict(keep_vars=True).values())
    if weights_location is None and on_meta:
        raise ValueError(
            "The model has no weights (built on the meta device) and no weights_location was "
            "given: pass weights_location= (a checkpoint file or folder)."
        )
    if weights_location is not None:
        checkpoint_files(weights_location)  # a missing checkpoint is an error before any work
    require_backend(config, _declared_devices(device_map))
    if (
        isinstance(device_map, Mapping)
        and "disk" in _declared_devices(device_map)
        and offload_folder is None
    ):
        raise ValueError(
            "device_map sends modules to 'disk' but no offload_folder was given: pass "
            "offload_folder=... (the quantized weights are written there once)."
        )
    in_memory = None
    if weights_location is None:
        in_memory = {k: t.detach() for k, t in model.state_dict().items()}
    skip = config.skip_modules
    if skip is None:
        skip = get_keys_to_not_convert(model)
    keep_fp32 = list(
        config.keep_in_fp32_modules or getattr(model, "_keep_in_fp32_modules", None) or []
    )
    not_convert = list(skip) + keep_fp32
    if config.backend == "bitsandbytes":
        replace_with_bnb_layers(model, config, modules_to_not_convert=not_convert)
        quantized = {n for n, m in model.named_modules() if is_quantized_layer(m)}
    else:
        from nbaccel.bigmodel.quantization.torchao_weights import linears_to_quantize

        quantized = linears_to_quantize(model, not_convert)
    plan = get_quantized_model_device_map(
        model, config, device_map, max_memory, no_split_module_classes, quantized
    )
    check_quantized_placement(config, plan, quantized, offload_folder)
    load = _QuantizedLoad(model, config, plan, quantized, keep_fp32, offload_folder)
    try:
        _load_all(load, _tensors(weights_location, in_memory, opened := []), opened)
    except BaseException:
        load.reset()
        raise
    del in_memory
    load.check_complete(weights_location or "the model's own tensors")
    _mark(model, config)
    offloads = set(plan.values()) - {load.main}
    if offloads:
        if load.disk_index:
            setattr(model, OFFLOAD_INDEX_ATTR, dict(load.disk_index))
        return dispatch_model(
            model,
            plan,
            state_dict=load.cpu_state or None,
            offload_dir=offload_folder,
            offload_index=load.disk_index or None,
        )
    model.hf_device_map = dict(plan)
    return model


def _load_all(load: _QuantizedLoad, tensors: Iterator, opened: list) -> None:
    """Every tensor placed; the weights to quantize on :func:`load_threads` threads, a few
    in flight each (peak memory: the quantized model plus those weights' temporaries)."""
    threads = load_threads()
    with ThreadPoolExecutor(threads, thread_name_prefix="nbaccel-quantize") as pool:
        pending: deque[Future] = deque()
        try:
            for key, tensor, path, release in tensors:
                job = load.put(key, tensor, path, release)
                if job is None:
                    continue
                pending.append(pool.submit(job))
                while len(pending) > 2 * threads:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
            load.copies.finish()  # every streamed copy in place before the model is used
        finally:
            for future in pending:
                future.cancel()
    for handle in opened:
        handle.check_unchanged()  # rewritten while read: the weights may mix two files
    logger.debug(
        "%d weights quantized on %d of %d threads: %s",
        sum(load.quantized_on.values()), len(load.quantized_on), threads, load.quantized_on,
    )  # fmt: skip


def _packed(module: nn.Module, leaf: str) -> bool:
    """A weight whose placeholder is already quantized (its shape is the packed one)."""
    weight = module._parameters.get(leaf)
    return leaf == "weight" and getattr(weight, "quant_state", None) is not None


def _mark(model: nn.Module, config: Any) -> None:
    """The flags transformers and Accelerate read on a quantized model."""
    model.is_loaded_in_8bit = config.bits == 8 and config.backend == "bitsandbytes"
    model.is_loaded_in_4bit = config.bits == 4 and config.backend == "bitsandbytes"
    model.is_quantized = True
    model.quantization_method = config.backend
    model._nbaccel_quantization_config = config
