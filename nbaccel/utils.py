"""The import path ``accelerate.utils`` users already type: ``from nbaccel.utils import ...``.

A re-export module only; every name lives in the module that owns its concept.
"""

from nbaccel.environment import is_torch_xla_available
from nbaccel.ops import (
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
from nbaccel.seed import set_seed
from nbaccel.state import DistributedType

# -- training configuration classes (issue 6) --
# -- big-model utilities (issue 8) --

__all__ = [
    "DistributedType",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "find_batch_size",
    "gather",
    "gather_object",
    "is_torch_xla_available",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "set_seed",
]
