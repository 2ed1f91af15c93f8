"""FSDP2 model sharding on torch's ``fully_shard``: on GPUs with NCCL and on CPUs with gloo.

Entry points (the Accelerator calls these; each also works on its own with a plain optimizer):

- ``shard_model(model, plugin, device)``: wrap the chosen blocks (transformer layer classes, a
  size threshold or a callable policy), optionally with activation checkpointing, then the root.
  Parameters become ``DTensor`` shards: each of N ranks holds about 1/N of every tensor.
- ``rebind_optimizer(optimizer, model)``: an optimizer built *before* ``shard_model`` still
  points at the old full parameters; this re-points its param groups at the sharded ones (it
  refuses, with a clear error, an optimizer that already has state). It is
  :func:`nbaccel.training.strategies.repoint.repoint_optimizer`, the one re-pointer.
- ``is_fsdp_model(model)``.
- ``FSDPStrategy``: the strategy the Accelerator uses under ``fsdp_plugin=...``.

Checkpoint functions live in ``nbaccel.training.strategies.fsdp.checkpoint`` and are
re-exported here:

- ``save_fsdp_state(objects, output_dir)`` / ``load_fsdp_state(objects, input_dir)``: the seam
  ``save_state`` / ``load_state`` call on every rank (``objects`` has ``.models`` and
  ``.optimizers``); the format follows ``plugin.state_dict_type``.
- ``get_fsdp_state_dict(model)``: the full state dict gathered on rank 0 (``save_model``,
  ``get_state_dict``); every rank must call it.
- ``save_fsdp_model`` / ``load_fsdp_model``, ``save_fsdp_optimizer`` / ``load_fsdp_optimizer``
  (``SHARDED_STATE_DICT`` through ``torch.distributed.checkpoint``, ``FULL_STATE_DICT`` through
  rank 0), ``find_model_for_optimizer`` and ``merge_fsdp_weights``.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.fsdp.checkpoint import (
    find_model_for_optimizer,
    get_fsdp_state_dict,
    load_fsdp_model,
    load_fsdp_optimizer,
    load_fsdp_state,
    merge_fsdp_weights,
    save_fsdp_model,
    save_fsdp_optimizer,
    save_fsdp_state,
)
from nbaccel.training.strategies.fsdp.plugin import FullyShardedDataParallelPlugin
from nbaccel.training.strategies.repoint import remember_moves
from nbaccel.training.strategies.repoint import repoint_optimizer as rebind_optimizer

__all__ = [
    "FSDPStrategy",
    "FullyShardedDataParallelPlugin",
    "find_model_for_optimizer",
    "get_fsdp_state_dict",
    "is_fsdp_model",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "load_fsdp_state",
    "merge_fsdp_weights",
    "rebind_optimizer",
    "save_fsdp_model",
    "save_fsdp_optimizer",
    "save_fsdp_state",
    "shard_model",
    "sharded_fraction",
]


def is_fsdp_model(model: Any) -> bool:
    """True when ``model`` (or the module under ``torch.compile``) was sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", model)
    return isinstance(inner, FSDPModule)


def _ensure_process_group(device: torch.device) -> None:
    """FSDP2 needs a process group: join the launcher's world, or make a private one-rank group."""
    if dist.is_initialized():
        return
    from nbaccel.distributed.state import PartialState

    PartialState()  # initialises the group from torchrun / nbaccel launcher variables
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(minutes=30),
    )


def _class_names(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def _blocks_to_wrap(model: nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[nn.Module]:
    """The submodules that get their own FSDP unit, innermost first (never the root)."""
    policy = plugin.auto_wrap_policy
    if policy is None or policy == "NO_WRAP":
        return []
    if callable(policy):
        chosen = [m for m in model.modules() if m is not model and policy(m)]
    elif policy == "TRANSFORMER_BASED_WRAP":
        names = plugin.transformer_cls_names_to_wrap or list(
            getattr(model, "_no_split_modules", None) or []
        )
        if not names:
            raise ValueError(
                "auto_wrap_policy='TRANSFORMER_BASED_WRAP' needs transformer_cls_names_to_wrap "
                "(the model has no _no_split_modules to fall back on)."
            )
        missing = set(names) - _class_names(model)
        if missing:
            raise ValueError(
                f"transformer_cls_names_to_wrap names classes that are not in the model: "
                f"{sorted(missing)}. Classes in the model: {sorted(_class_names(model))}."
            )
        chosen = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    else:  # SIZE_BASED_WRAP: bottom-up, a block is wrapped once its unwrapped params reach the bar
        chosen = []
        threshold = plugin.min_num_params or 0
        covered: set[int] = set()

        def visit(module: nn.Module) -> None:
            for child in module.children():
                visit(child)
            if module is model:
                return
            own = sum(
                p.numel()
                for p in module.parameters()
                if id(p) not in covered and not isinstance(p, nn.parameter.UninitializedParameter)
            )
            if own >= threshold and own > 0:
                chosen.append(module)
                covered.update(id(p) for p in module.parameters())

        visit(model)
        return chosen
    # innermost first: fully_shard must see nested units before their parents
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(chosen, key=lambda m: -depth[id(m)])


def _apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Swap each block for a checkpoint wrapper around it (state-dict keys are unchanged)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if not blocks:
        raise ValueError(
            "activation_checkpointing=True needs blocks to checkpoint: set "
            "transformer_cls_names_to_wrap, min_num_params or a callable auto_wrap_policy."
        )
    wanted = {id(b) for b in blocks}
    wrapped: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in wanted:
                new = checkpoint_wrapper(child, preserve_rng_state=True)
                setattr(parent, name, new)
                wrapped[id(child)] = new
    return [wrapped.get(id(b), b) for b in blocks]


def _rank0_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's weights before sharding, broadcast into the shards (cpu_ram_efficient_loading)."""
    if dist.get_rank() != 0:
        return {}
    return {k: v for k, v in model.state_dict().items() if not v.is_meta}


def shard_model(
    model: nn.Module,
    plugin: FullyShardedDataParallelPlugin | None = None,
    device: torch.device | str | None = None,
    mesh: Any = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 and return it (it is now an ``FSDPModule``).

    Args:
        model: the module; on ``meta`` (except on rank 0) when ``cpu_ram_efficient_loading``.
        plugin: the options (defaults to ``FullyShardedDataParallelPlugin()``).
        device: where the shards live (``cuda:N`` with NCCL, ``cpu`` with gloo).
        mesh: the data-parallel mesh to shard over (1-D: FSDP; 2-D ``(replicate, shard)``:
            HSDP); default: every rank of the world.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    plugin = plugin or FullyShardedDataParallelPlugin()
    device = torch.device(device) if device is not None else torch.device("cpu")
    if is_fsdp_model(model):
        return model
    if device.type == "xla":
        raise NotImplementedError(
            "FSDP2 on XLA devices is not supported; on TPUs use the XLA data-parallel path "
            "(Accelerator() without fsdp_plugin)."
        )
    _ensure_process_group(device)
    old_params = dict(model.named_parameters(remove_duplicate=False))
    full_state = _rank0_full_state(model) if plugin.cpu_ram_efficient_loading else None
    if any(p.is_meta for p in model.parameters()):
        if full_state is None:
            raise ValueError(
                "The model has parameters on the meta device; set cpu_ram_efficient_loading=True "
                "in the FullyShardedDataParallelPlugin so rank 0's weights are broadcast, or "
                "build the model with real weights on every rank."
            )
    else:
        model.to(device)

    blocks = _blocks_to_wrap(model, plugin)
    if plugin.activation_checkpointing:
        blocks = _apply_activation_checkpointing(model, blocks)
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": plugin.reshard_after_forward}
    if plugin.mixed_precision_policy is not None:
        options["mp_policy"] = plugin.mixed_precision_policy
    options["offload_policy"] = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if plugin.cpu_offload
        else OffloadPolicy()
    )
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)

    if full_state is not None:
        _load_rank0_weights(model, full_state, device)
    remember_moves(model, old_params, dict(model.named_parameters(remove_duplicate=False)))
    del old_params
    return model


def _load_rank0_weights(model: nn.Module, state: dict[str, torch.Tensor], device: torch.device):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, dict(state), options=options)


def sharded_fraction(model: nn.Module) -> float:
    """Local elements over global elements of ``model``'s parameters (about 1/N when sharded)."""
    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return local / max(total, 1)


def _full_options(**extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


class FSDPStrategy(Strategy):
    """FSDP2: every rank holds a shard of each parameter (``fully_shard``), gloo or NCCL.

    State dicts are gathered into full tensors (on CPU) and scattered back on load; checkpoints
    use the plugin's ``state_dict_type`` (sharded ``torch.distributed.checkpoint`` directories or
    full files written by rank 0).
    """

    replaces_parameters = True
    shards_weights = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # this accelerator's plugin, kept even if a later Accelerator brings another one
        self.plugin = self.state.fsdp_plugin or FullyShardedDataParallelPlugin()
        # Accelerate's rule: mixed_precision reaches FSDP2 as the plugin's MixedPrecisionPolicy
        # (unless the plugin has its own); the forward's autocast stays on too
        self.plugin.set_mixed_precision(self.precision.mode)

    @property
    def mixed_precision_policy(self) -> Any:
        return self.plugin.mixed_precision_policy

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        inner = getattr(model, "_orig_mod", model)
        return _no_gradient_sync(inner) if is_fsdp_model(inner) else contextlib.nullcontext()

    def prepare_model(
        self, model: nn.Module, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        # no .to(device) first: shard_model places (or materialises) each rank's shards
        self.precision.wrap_forward(model)
        if evaluation_mode:
            return model
        return shard_model(model, self.plugin, self.device)

    def model_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_options(cpu_offload=True))

    def load_model_state_dict(
        self,
        model: nn.Module,
        tensors: Mapping[str, torch.Tensor],
        aliases: Mapping[str, str] | None = None,
        strict: bool = True,
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        expected = set(model.state_dict().keys())
        aliases = aliases or {}
        tensors = {**{a: tensors[k] for a, k in aliases.items() if k in tensors}, **tensors}
        tensors = {k: v for k, v in tensors.items() if k in expected}
        set_model_state_dict(model, tensors, options=_full_options())

    def optimizer_state_dict(self, optimizer: Any, model: nn.Module | None) -> dict:
        if model is None:
            return super().optimizer_state_dict(optimizer, model)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        inner = getattr(optimizer, "optimizer", optimizer)
        return get_optimizer_state_dict(model, inner, options=_full_options(cpu_offload=True))

    def load_optimizer_state_dict(
        self, optimizer: Any, state_dict: dict, model: nn.Module | None
    ) -> None:
        if model is None:
            super().load_optimizer_state_dict(optimizer, state_dict, model)
            return
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        inner = getattr(optimizer, "optimizer", optimizer)
        set_optimizer_state_dict(model, inner, state_dict, options=_full_options())

    sharded_checkpoints = True

    def save_sharded_checkpoint(self, objects: Any, directory: Any) -> list[str]:
        return save_fsdp_state(objects, directory, self.plugin)

    def load_sharded_checkpoint(self, objects: Any, directory: Any) -> None:
        load_fsdp_state(objects, directory, self.plugin)


@contextlib.contextmanager
def _no_gradient_sync(model: Any) -> Iterator[None]:
    """FSDP2's switch: backward leaves unsharded gradients in place of reduce-scattering them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
