"""The import path ``accelerate.utils`` users already type: ``from nbaccel.utils import ...``.

A re-export module only; every name lives in the module that owns its concept.
"""

from nbaccel.bigmodel import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    align_module_device,
    calculate_maximum_sizes,
    check_device_map,
    clean_device_map,
    compute_module_sizes,
    convert_file_size_to_int,
    dtype_byte_size,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    has_offloaded_params,
    infer_auto_device_map,
    load_checkpoint_in_model,
    load_offloaded_weights,
    named_module_tensors,
    offload_state_dict,
    retie_parameters,
    save_offload_index,
    set_module_tensor_to_device,
)
from nbaccel.distributed.collectives import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
)
from nbaccel.distributed.environment import is_torch_xla_available
from nbaccel.distributed.random import set_seed, synchronize_rng_state, synchronize_rng_states
from nbaccel.distributed.state import DistributedType
from nbaccel.storage.weights import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from nbaccel.training.batch_size import find_executable_batch_size, release_memory
from nbaccel.training.configuration import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    PrecisionType,
    ProjectConfiguration,
    RNGType,
)
from nbaccel.training.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from nbaccel.training.precision import convert_outputs_to_fp32, convert_to_fp32
from nbaccel.training.strategies.fsdp_checkpoint import merge_fsdp_weights
from nbaccel.training.strategies.fsdp_plugin import FullyShardedDataParallelPlugin
from nbaccel.training.strategies.wrappers import extract_model_from_parallel
from nbaccel.training.trackers import GeneralTracker, LoggerType

__all__ = [
    "align_module_device",
    "AutocastKwargs",
    "broadcast",
    "broadcast_object_list",
    "calculate_maximum_sizes",
    "check_device_map",
    "clean_device_map",
    "compute_module_sizes",
    "concatenate",
    "convert_file_size_to_int",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "dtype_byte_size",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_executable_batch_size",
    "find_tied_parameters",
    "FullyShardedDataParallelPlugin",
    "gather",
    "gather_object",
    "GeneralTracker",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "GradientAccumulationPlugin",
    "GradScalerKwargs",
    "has_offloaded_params",
    "infer_auto_device_map",
    "InitProcessGroupKwargs",
    "is_torch_xla_available",
    "KwargsHandler",
    "load_checkpoint_in_model",
    "load_offloaded_weights",
    "LoggerType",
    "merge_fsdp_weights",
    "named_module_tensors",
    "offload_state_dict",
    "OffloadedWeightsLoader",
    "pad_across_processes",
    "PrecisionType",
    "PrefixedDataset",
    "ProfileKwargs",
    "ProjectConfiguration",
    "recursively_apply",
    "reduce",
    "release_memory",
    "retie_parameters",
    "RNGType",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "save_offload_index",
    "send_to_device",
    "set_module_tensor_to_device",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
]
