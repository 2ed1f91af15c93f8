"""Megatron-LM's plugin on torch's own engines: tensor, sequence, pipeline and data parallel.

``Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2))``
trains a decoder language model of the Llama family without Megatron-LM installed:

- the ranks form a ``(pp, dp, tp)`` ``DeviceMesh`` (tensor-parallel ranks adjacent, as
  Megatron orders them);
- each pipeline rank keeps one :class:`~.decoder_stages.DecoderStage` (its share of the
  decoder layers), split over the ``tp`` axis with the model's tensor-parallel plan;
- calling the prepared model with ``input_ids`` and ``labels`` in training mode runs a whole
  training step of ``num_micro_batches`` micro-batches through torch's ``Schedule1F1B``: forward
  *and* backward, as Megatron-LM's engine does. It returns an output whose ``loss`` is the
  batch's loss on every rank; ``accelerator.backward(loss)`` then has nothing left to do, so the
  loop of the Megatron-LM guide runs as it is. In eval mode the schedule runs forward only.
- the optimizer step all-reduces gradients over ``dp``, clips them by the global norm across
  stages (``gradient_clipping``), and steps each rank's own parameters.

What only Megatron-LM's model zoo does (its train-step classes, its dataset and tokenizer
files, ``megatron_generate``) stays refused, naming this path.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.model_parallel.decoder_stages import DecoderStage, causal_lm_loss
from nbaccel.training.strategies.model_parallel.tensor_parallel import check_tensor_parallel
from nbaccel.training.strategies.repoint import remember_moves

__all__ = ["MegatronLMPlugin", "MegatronStrategy", "PipelineTrainingModel"]

_MEGATRON_ONLY = (
    "custom_train_step_class",
    "custom_model_provider_function",
    "custom_prepare_model_function",
    "custom_megatron_datasets_provider_function",
    "custom_get_batch_function",
    "megatron_dataset_flag",
    "use_distributed_optimizer",
    "num_layers_per_virtual_pipeline_stage",
)


@dataclass
class MegatronLMPlugin:
    """Megatron-LM's options that nbaccel runs on torch (Accelerate's ``MegatronLMPlugin``).

    Args:
        tp_degree: tensor-parallel ranks per stage (the model's own TP plan splits each layer).
        pp_degree: pipeline stages (decoder layers shared out evenly).
        num_micro_batches: micro-batches each training step is cut into (a multiple of nothing:
            the batch must divide by it).
        sequence_parallelism: keep activations outside attention/MLP split along the sequence
            over the ``tp`` ranks (:mod:`.sequence_parallel`); no effect when tp_degree is 1.
        gradient_clipping: clip gradients to this global norm (across stages) before a step.
        recompute_activations: recompute each decoder layer in backward (activation checkpointing).
        return_logits: keep the last stage's logits on the output (else only the loss).
        custom_loss_function: ``fn(logits, labels) -> loss`` in place of the causal LM loss.
    """

    tp_degree: int | None = None
    pp_degree: int | None = None
    num_micro_batches: int | None = None
    gradient_clipping: float | None = None
    sequence_parallelism: bool | None = None
    recompute_activations: bool | None = None
    use_distributed_optimizer: bool | None = None
    return_logits: bool = False
    seq_length: int | None = None
    custom_loss_function: Any = None
    custom_train_step_class: Any = None
    custom_train_step_kwargs: dict[str, Any] | None = None
    custom_model_provider_function: Any = None
    custom_prepare_model_function: Any = None
    custom_megatron_datasets_provider_function: Any = None
    custom_get_batch_function: Any = None
    megatron_dataset_flag: bool = False
    num_layers_per_virtual_pipeline_stage: int | None = None
    other_megatron_args: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.tp_degree = int(self.tp_degree or 1)
        self.pp_degree = int(self.pp_degree or 1)
        self.num_micro_batches = int(self.num_micro_batches or 1)
        for name in ("tp_degree", "pp_degree", "num_micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        given = [n for n in _MEGATRON_ONLY if getattr(self, n)]
        if given:
            raise NotImplementedError(
                f"{', '.join(given)} belong to Megatron-LM's own engine, which nbaccel does not "
                "install: nbaccel trains transformers decoder models with tp_degree/pp_degree/"
                "num_micro_batches on torch's engines. Leave them unset (a custom loss goes in "
                "custom_loss_function)."
            )


class PipelineTrainingModel(nn.Module):
    """The prepared model of a Megatron run: one stage, and the schedule that drives all."""

    def __init__(self, stage: DecoderStage, schedule: Any, strategy: Any) -> None:
        super().__init__()
        self.stage_module = stage
        self.config = getattr(stage, "config", None)
        self._schedule = schedule
        self._strategy = strategy

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step (train mode, gradients on) or a forward pass of the whole batch
        through every stage; returns ``.loss`` (every rank) and ``.logits`` (last stage, with
        ``return_logits``)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "Pipeline-parallel training runs causal attention without padding masks: pack "
                "or trim the sequences so that attention_mask is all ones (or drop it)."
            )
        if labels is None:
            raise ValueError("Pass labels: the last pipeline stage computes the loss from them.")
        strategy, stage = self._strategy, self.stage_module
        train = self.training and torch.is_grad_enabled()
        schedule = self._schedule
        losses: list[torch.Tensor] = []
        inputs = (input_ids.to(strategy.device),) if stage.is_first else ()
        target = labels.to(strategy.device) if stage.is_last else None
        run = schedule.step if train else schedule.eval
        context = contextlib.nullcontext() if train else torch.no_grad()
        with context:
            logits = run(*inputs, target=target, losses=losses)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else None
        return _Output(strategy.share_loss(loss), logits if strategy.plugin.return_logits else None)


class _Output(dict):
    """``loss`` and ``logits`` as attributes and keys, like transformers' model outputs."""

    def __init__(self, loss: torch.Tensor, logits: Any) -> None:
        super().__init__(loss=loss, logits=logits)
        self.loss, self.logits = loss, logits


class MegatronStrategy(Strategy):
    """Tensor + pipeline (+ data) parallel training as :mod:`this module <.megatron>` says."""

    replaces_parameters = True

    def __init__(self, *args: Any, plugin: MegatronLMPlugin, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plugin = plugin
        tp, pp = plugin.tp_degree, plugin.pp_degree
        world = self.num_processes
        if world % (tp * pp):
            raise ValueError(
                f"tp_degree={tp} x pp_degree={pp} = {tp * pp} does not divide the {world} ranks "
                f"of the run: launch a multiple of {tp * pp} processes, or change the degrees."
            )
        from torch.distributed.device_mesh import init_device_mesh

        self.dp = world // (tp * pp)
        self.mesh = init_device_mesh(
            self.device.type, (pp, self.dp, tp), mesh_dim_names=("pp", "dp", "tp")
        )
        self.pipeline_parallel_rank = self.mesh["pp"].get_local_rank()
        self.stages: list[DecoderStage] = []

    def __repr__(self) -> str:
        p = self.plugin
        return f"MegatronStrategy(tp={p.tp_degree}, pp={p.pp_degree}, dp={self.dp}, {self.device})"

    @property
    def data_parallel_size(self) -> int:
        return self.dp

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def tensor_parallel_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    # -- model --------------------------------------------------------------------------------
    def prepare_model(
        self, model: nn.Module, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        p = self.plugin
        resolved = check_tensor_parallel(model, p.tp_degree) if p.tp_degree > 1 else {}
        by_module = {id(model.get_submodule(n)): s for n, s in resolved.items()}
        before = dict(model.named_parameters(remove_duplicate=False))
        stage = DecoderStage(model, self.pipeline_parallel_rank, p.pp_degree)
        stage.to(self.device)
        if by_module:
            from torch.distributed.tensor.parallel import parallelize_module

            plan = {n: by_module[id(m)] for n, m in stage.named_modules() if id(m) in by_module}
            if p.sequence_parallelism:
                from nbaccel.training.strategies.model_parallel.sequence_parallel import (
                    sequence_parallel_plan,
                )

                plan = sequence_parallel_plan(stage, plan)
                stage.sequence_shards = p.tp_degree
            parallelize_module(stage, self.mesh["tp"], plan)
        if p.recompute_activations:
            _checkpoint_layers(stage)
        self.precision.wrap_forward(stage)
        self.stages.append(stage)
        loss_fn = p.custom_loss_function or causal_lm_loss
        pp_rank, group = self.pipeline_parallel_rank, self.mesh["pp"].get_group()
        kind = Schedule1F1B if p.num_micro_batches >= p.pp_degree else ScheduleGPipe

        part = PipelineStage(stage, pp_rank, p.pp_degree, self.device, group=group)
        schedule = kind(part, p.num_micro_batches, loss_fn=loss_fn)
        wrapped = PipelineTrainingModel(stage, schedule, self)
        remember_moves(wrapped, before, dict(stage.named_parameters(remove_duplicate=False)))
        return wrapped

    def unwrap_parallel(self, model: nn.Module) -> nn.Module:
        return getattr(model, "stage_module", model)

    def prepare_optimizer(self, optimizer: Any, models: Iterable[nn.Module]) -> None:
        """Point ``optimizer`` at this rank's stage parameters and drop the other stages'."""
        super().prepare_optimizer(optimizer, models)
        if not self.stages:
            return
        mine = {id(p) for stage in self.stages for p in stage.parameters()}
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]

    # -- the training step --------------------------------------------------------------------
    def share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss on every rank (mean over data-parallel ranks)."""
        value = torch.zeros((), device=self.device) if loss is None else loss.to(self.device)
        dist.all_reduce(value, group=self.mesh["pp"].get_group())  # only the last stage adds
        if self.dp > 1:
            dist.all_reduce(value, group=self.mesh["dp"].get_group())
            value = value / self.dp
        return value

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Nothing: the model's call ran backward for every micro-batch already."""

    def _params(self) -> list[nn.Parameter]:
        return [p for stage in self.stages for p in stage.parameters()]

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        return self._clip(self._params(), max_norm, norm_type)

    def _clip(self, params: list[nn.Parameter], max_norm: float, norm_type: float = 2):
        """Clip by the norm over every stage's gradients (TP shards counted once)."""
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.zeros((), device=self.device)
        for g in grads:
            n = torch.linalg.vector_norm(g, norm_type)
            n = n.full_tensor() if hasattr(n, "full_tensor") else n
            local = torch.maximum(local, n) if math.isinf(norm_type) else local + n.float() ** 2
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=self.mesh["pp"].get_group())
        total = local if math.isinf(norm_type) else local ** (1.0 / norm_type)
        scale = min(float(max_norm) / (float(total) + 1e-6), 1.0)
        for g in grads:
            g.mul_(scale)
        return total

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        params = self._params()
        if self.dp > 1:
            group = self.mesh["dp"].get_group()
            for p in params:
                if p.grad is not None:
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    dist.all_reduce(local, group=group)
                    local.div_(self.dp)
        if self.plugin.gradient_clipping:
            self._clip(params, self.plugin.gradient_clipping)
        return super().optimizer_step(optimizer, closure)

    # -- state dicts --------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full model's state dict on rank 0 (``{}`` elsewhere): TP shards gathered within
        each stage, the stages' pieces gathered across the pipeline."""
        stage = self.unwrap_parallel(model)
        local = {}
        for k, v in stage.state_dict().items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            local[k] = v.detach().cpu()
        keep = self.mesh["tp"].get_local_rank() == 0 and self.mesh["dp"].get_local_rank() == 0
        pieces: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local if keep else {}, pieces, dst=0)
        if dist.get_rank() != 0:
            return {}
        return {k: v for piece in pieces for k, v in piece.items()}

    sharded_checkpoints = True

    def save_sharded_checkpoint(self, objects: Any, directory: Any) -> list[str]:
        """Every rank writes its stage's shards with dcp, keyed by the full model's parameter
        names (optimizer state flattened per parameter, so stages never collide): the stages
        together are one checkpoint of the whole model."""
        import torch.distributed.checkpoint as dcp

        names = []
        for i, (stage, optimizers) in enumerate(self._pairs(objects)):
            name = f"megatron_model_{i}"
            state = _stage_state(stage, optimizers)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{directory}/{name}"))
            names.append(name)
        return names

    def load_sharded_checkpoint(self, objects: Any, directory: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        for i, (stage, optimizers) in enumerate(self._pairs(objects)):
            state = _stage_state(stage, optimizers)
            dcp.load(state, storage_reader=dcp.FileSystemReader(f"{directory}/megatron_model_{i}"))
            set_state_dict(
                stage,
                optimizers,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=_FLAT,
            )

    def _pairs(self, objects: Any) -> list[tuple[nn.Module, list[Any]]]:
        """Each model's stage with the (inner) optimizers that update it."""
        pairs = []
        for model in objects.models:
            stage = self.unwrap_parallel(model)
            ids = {id(p) for p in stage.parameters()}
            inner = [getattr(o, "optimizer", o) for o in objects.optimizers]
            mine = [
                o for o in inner if any(id(p) in ids for g in o.param_groups for p in g["params"])
            ]
            pairs.append((stage, mine))
        return pairs


def _stage_state(stage: nn.Module, optimizers: list[Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(stage, optimizers, options=_FLAT)
    return {"model": model_state, "optimizer": optim_state}


def _flat_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


_FLAT = _flat_options()


def _checkpoint_layers(stage: DecoderStage) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = getattr(stage, stage.prefix).layers
    for key in list(layers.keys()):
        layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=True)
