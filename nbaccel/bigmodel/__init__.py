"""Big-model inference: empty init, device maps, dispatch, CPU/disk offload.

By role: ``planning/`` (sizes, memory budgets, device maps), ``hooks/`` (hooks around forward),
``loading/`` (checkpoints and single weights on disk), ``quantization/``; at the top ``empty``,
``dispatch``, ``offload``, ``placement``, ``ties``, ``pipeline`` and ``memory_estimate``.

Same names and signatures as Accelerate's big-modeling API; see the module docstrings for what
nbaccel does beyond it (in-place safetensors disk offload, prefetching, linear-time planning,
tie-preserving loads, checked checkpoint keys).
"""

from nbaccel.bigmodel.dispatch import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
)
from nbaccel.bigmodel.empty import init_empty_weights, init_on_device
from nbaccel.bigmodel.hooks.align_devices import (
    AlignDevicesHook,
    align_module_device,
    get_state_dict_offloaded_model,
    has_offloaded_params,
)
from nbaccel.bigmodel.hooks.attachment import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
)
from nbaccel.bigmodel.hooks.cpu_offload import CpuOffload, UserCpuOffloadHook
from nbaccel.bigmodel.hooks.model_hook import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from nbaccel.bigmodel.loading.checkpoint import (
    CheckpointMismatchError,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from nbaccel.bigmodel.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    load_offload_index,
    load_offloaded_weights,
    offload_state_dict,
    save_offload_index,
)
from nbaccel.bigmodel.placement import set_module_tensor_to_device
from nbaccel.bigmodel.planning.device_map import (
    check_device_map,
    clean_device_map,
    get_device_map,
    infer_auto_device_map,
)
from nbaccel.bigmodel.planning.memory_budgets import (
    convert_file_size_to_int,
    get_balanced_memory,
    get_max_memory,
)
from nbaccel.bigmodel.planning.module_sizes import (
    calculate_maximum_sizes,
    compute_module_sizes,
    dtype_byte_size,
    get_max_layer_size,
    named_module_tensors,
)
from nbaccel.bigmodel.ties import find_tied_parameters, retie_parameters

__all__ = [
    "AlignDevicesHook",
    "CheckpointMismatchError",
    "CpuOffload",
    "ModelHook",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "align_module_device",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "calculate_maximum_sizes",
    "check_device_map",
    "clean_device_map",
    "compute_module_sizes",
    "convert_file_size_to_int",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_device_map",
    "get_max_layer_size",
    "get_max_memory",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "load_offload_index",
    "load_offloaded_weights",
    "named_module_tensors",
    "offload_state_dict",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "retie_parameters",
    "save_offload_index",
    "set_module_tensor_to_device",
]
