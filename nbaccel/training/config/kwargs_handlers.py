"""Kwargs handlers: options for the torch objects ``Accelerator`` creates on the user's behalf.

Pass instances in ``Accelerator(kwargs_handlers=[...])``. Each handler only forwards the fields the
user changed (``to_kwargs``), so torch's own defaults stay in charge of everything else.
"""

from __future__ import annotations

import datetime
import enum
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "sort_handlers",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
]


class KwargsHandler:
    """Base class: ``to_kwargs()`` returns the fields whose value differs from the default."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclass
class AutocastKwargs(KwargsHandler):
    """Options for ``torch.autocast`` under mixed precision."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Options for ``torch.amp.GradScaler`` (fp16 training)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")


class DDPCommunicationHookType(str, enum.Enum):
    """DDP communication hooks (Accelerate's names): gradients compressed to fp16/bf16 for the
    all-reduce, or PowerSGD low-rank compression (per tensor or batched)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


def _hook_type(value: Any, what: str) -> DDPCommunicationHookType:
    text = str(getattr(value, "value", value)).lower()
    if text not in COMM_HOOKS:
        raise ValueError(f"{what} must be one of {COMM_HOOKS}, not {value!r}.")
    return DDPCommunicationHookType(text)


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options for ``torch.nn.parallel.DistributedDataParallel`` and its communication hook.

    ``comm_hook`` is a :class:`DDPCommunicationHookType` (or its string): ``"no"``, ``"fp16"``,
    ``"bf16"`` (compress gradients for the all-reduce), ``"power_sgd"`` or
    ``"batched_power_sgd"``. ``comm_wrapper`` (``"fp16"``/``"bf16"``) also compresses what a
    PowerSGD hook sends. ``comm_state_option`` is passed to the PowerSGD state (for example
    ``{"matrix_approximation_rank": 2, "start_powerSGD_iter": 10}``).
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper")
        if self.comm_wrapper not in ("no", "fp16", "bf16"):
            raise ValueError(
                f"comm_wrapper compresses what a hook sends: use 'fp16' or 'bf16', not "
                f"{self.comm_wrapper.value!r}."
            )
        powersgd = self.comm_hook in ("power_sgd", "batched_power_sgd")
        if self.comm_state_option and not powersgd:
            warnings.warn(
                "comm_state_option configures PowerSGD and is ignored with comm_hook="
                f"{self.comm_hook.value!r}: set comm_hook='power_sgd' or 'batched_power_sgd'.",
                stacklevel=3,
            )

    def ddp_kwargs(self) -> dict[str, Any]:
        """The changed options that DDP's constructor takes (the hook is registered separately)."""
        changed = self.to_kwargs()
        changed.pop("comm_hook", None)
        changed.pop("comm_wrapper", None)
        changed.pop("comm_state_option", None)
        return changed


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options for ``init_process_group`` (used when nbaccel creates the process group)."""

    backend: str | None = None
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """Options for ``Accelerator.profile()`` on ``torch.profiler``.

    Args:
        activities: ``"cpu"``, ``"cuda"``, ``"xpu"`` (default: CPU, plus CUDA when available).
        schedule_option: keys ``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first`` for
            ``torch.profiler.schedule``; call ``prof.step()`` in the loop.
        on_trace_ready: called with the profiler each time a trace is ready.
        output_trace_dir: write a Chrome trace per rank there (``profile_<i>.json``).
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> Any:
        """A ``torch.profiler.profile`` configured from these options."""
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        names = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
        if hasattr(ProfilerActivity, "XPU"):
            names["xpu"] = ProfilerActivity.XPU
        wanted = self.activities
        if wanted is None:
            wanted = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        unknown = [a for a in wanted if a not in names]
        if unknown:
            raise ValueError(f"Unknown profiler activities {unknown}; choose from {list(names)}.")
        return profile(
            activities=[names[a] for a in wanted],
            schedule=schedule(**self.schedule_option) if self.schedule_option else None,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


#: the handlers an Accelerator takes, one of each
_HANDLERS = (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)


def sort_handlers(
    handlers: list[KwargsHandler], extra_kinds: tuple[type, ...] = ()
) -> dict[type, KwargsHandler]:
    """``kwargs_handlers`` by kind (these and ``extra_kinds``, e.g. the FP8 recipes), refusing
    an unknown kind or two of one kind."""
    found: dict[type, KwargsHandler] = {}
    kinds = (*_HANDLERS, *extra_kinds)
    for handler in handlers:
        kind = next((k for k in kinds if isinstance(handler, k)), None)
        if kind is None:
            raise TypeError(
                f"Unsupported kwargs handler {type(handler).__name__}; nbaccel takes "
                f"{[k.__name__ for k in kinds]}."
            )
        if kind in found:
            raise ValueError(f"Only one {kind.__name__} may be passed in kwargs_handlers.")
        found[kind] = handler
    return found
