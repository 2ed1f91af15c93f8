"""Megatron-LM's plugin on torch's own engines: tensor, sequence, pipeline and data parallel.

``Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2))``
trains a decoder language model of the Llama family, or GPT-2 (:mod:`.gpt2_stages`), without
Megatron-LM installed:

- the ranks form a ``(pp, dp, tp)`` ``DeviceMesh`` (tensor-parallel ranks adjacent, as
  Megatron orders them);
- each pipeline rank keeps one stage (:class:`~.decoder_stages.DecoderStage`, or
  :class:`~.gpt2_stages.GPT2Stage`: its share of the decoder layers), split over the ``tp``
  axis with the model's tensor-parallel plan;
- calling the prepared model with ``input_ids`` and ``labels`` in training mode runs a whole
  training step of ``num_micro_batches`` micro-batches through torch's ``Schedule1F1B``: forward
  *and* backward, as Megatron-LM's engine does. It returns an output whose ``loss`` is the
  batch's loss on every rank; ``accelerator.backward(loss)`` then has nothing left to do, so the
  loop of the Megatron-LM guide runs as it is. In eval mode the schedule runs forward only.
- the optimizer step all-reduces gradients over ``dp``, clips them by the global norm across
  stages (``gradient_clipping``), and steps each rank's own parameters.

As in Accelerate, a dataloader's batch size is the micro-batch: ``prepare`` rebuilds the loaders
to yield ``num_micro_batches`` micro-batches per batch (:meth:`MegatronStrategy.rebatch`) and the
plugin records ``global_batch_size``; ``MegatronLMDummyScheduler`` becomes Megatron-LM's schedule
(:mod:`.scheduler`); with ``use_distributed_optimizer`` each data-parallel rank steps
its share of the parameters. The plugin's fields are in :mod:`.plugin`; what only
Megatron-LM's engine does (its train-step classes, datasets, ``megatron_generate``) is refused
there, naming the field.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.megatron.decoder_stages import DecoderStage, causal_lm_loss
from nbaccel.training.strategies.megatron.micro_batches import with_batch_size
from nbaccel.training.strategies.megatron.plugin import MegatronLMPlugin
from nbaccel.training.strategies.megatron.stages import build_stage, split_moves
from nbaccel.training.strategies.megatron.tied_embedding import TiedEmbedding
from nbaccel.training.strategies.repoint import remember_moves

__all__ = ["MegatronLMPlugin", "MegatronStrategy", "PipelineTrainingModel"]


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
        strategy.check_batch(input_ids)
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

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """The whole model saved as transformers does (see ``DecoderStage.save_pretrained``)."""
        self.stage_module.save_pretrained(save_directory, **kwargs)


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
        from torch.distributed.device_mesh import init_device_mesh

        self.dp = plugin.check_world(self.num_processes)
        self.mesh = init_device_mesh(
            self.device.type, (pp, self.dp, tp), mesh_dim_names=("pp", "dp", "tp")
        )
        self.pipeline_parallel_rank = self.mesh["pp"].get_local_rank()
        self.stages: list[DecoderStage] = []
        self._splits: dict[int, tuple[nn.Parameter, list[nn.Parameter]]] = {}

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
        before = dict(model.named_parameters(remove_duplicate=False))
        tp_mesh, pp_rank = self.mesh["tp"], self.pipeline_parallel_rank
        stage = build_stage(model, p, pp_rank, tp_mesh, self.device)
        if getattr(stage, "tied", False) and p.pp_degree > 1:
            self.tied = TiedEmbedding(stage, p.pp_degree, self.dp, p.tp_degree)
        self._splits.update(split_moves(before, stage))
        self.precision.wrap_forward(stage)
        stage.full_state_dict = lambda: self.model_state_dict(stage)
        self.stages.append(stage)
        loss_fn = p.custom_loss_function or causal_lm_loss
        group = self.mesh["pp"].get_group()
        kind = Schedule1F1B if p.num_micro_batches >= p.pp_degree else ScheduleGPipe

        part = PipelineStage(stage, pp_rank, p.pp_degree, self.device, group=group)
        schedule = kind(part, p.num_micro_batches, loss_fn=loss_fn)
        wrapped = PipelineTrainingModel(stage, schedule, self)
        remember_moves(wrapped, before, dict(stage.named_parameters(remove_duplicate=False)))
        return wrapped

    # -- batches ------------------------------------------------------------------------------
    def plan_batches(self, loaders: list[Any]) -> None:
        """The micro-batch size from the loaders prepared together (the smallest batch, or the
        largest with ``is_train_batch_min=False``, as Accelerate), and the global batch."""
        sizes = [d.batch_size for d in loaders if getattr(d, "batch_size", None)]
        if sizes:
            micro = min(sizes) if self.plugin.is_train_batch_min else max(sizes)
            self.plugin.set_training_args(micro, self.dp)

    def rebatch(self, loader: Any) -> Any:
        """A loader whose batches hold ``num_micro_batches`` micro-batches (Accelerate's
        Megatron-LM loaders do the same): each model call is one training step."""
        if self.plugin.micro_batch_size is None:
            self.plan_batches([loader])
        n = self.plugin.num_micro_batches
        return with_batch_size(loader, self.plugin.micro_batch_size * n)

    #: GPT-2's tied embedding over the first and last stage (None: nothing tied across stages)
    tied: TiedEmbedding | None = None

    def check_batch(self, input_ids: torch.Tensor | None) -> None:
        """The batch's sequence length against ``seq_length`` (when set)."""
        want = self.plugin.seq_length
        if want is not None and input_ids is not None and input_ids.shape[-1] != want:
            raise ValueError(
                f"The batch's sequences have {input_ids.shape[-1]} tokens, but MegatronLMPlugin("
                f"seq_length={want}) was set: pad or cut the sequences to {want} tokens (the "
                "pipeline's stages exchange activations of that length), or change seq_length."
            )

    def scheduler_for(self, scheduler: Any) -> tuple[Any, int | None]:
        """Megatron-LM's schedule for its stand-in (one step per call: it counts samples);
        a torch scheduler steps once per data-parallel batch the step consumed."""
        scheduler, steps = super().scheduler_for(scheduler)
        return scheduler, steps or self.dp

    def make_scheduler(self, stand_in: Any) -> Any:
        """Megatron-LM's scheduler for a ``MegatronLMDummyScheduler``."""
        from nbaccel.training.strategies.megatron.scheduler import (
            MegatronLRScheduler,
        )

        inner = getattr(stand_in.optimizer, "optimizer", stand_in.optimizer)
        total, warmup = stand_in.total_num_steps, stand_in.warmup_num_steps
        return MegatronLRScheduler(inner, self.plugin, total, warmup)

    def unwrap_parallel(self, model: nn.Module) -> nn.Module:
        return getattr(model, "stage_module", model)

    def prepare_optimizer(self, optimizer: Any, models: Iterable[nn.Module]) -> None:
        """Point ``optimizer`` at this rank's stage parameters and drop the other stages'."""
        super().prepare_optimizer(optimizer, models)
        if not self.stages:
            return
        mine = {id(p) for stage in self.stages for p in stage.parameters()}
        if self.plugin.use_distributed_optimizer and self.dp > 1:
            mine = {id(p) for p in self._owned()}
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            pieces = []
            for p in group["params"]:
                split = self._splits.get(id(p))
                pieces.extend(split[1] if split is not None and split[0] is p else [p])
            group["params"] = [p for p in pieces if id(p) in mine]

    def _owners(self) -> list[tuple[nn.Parameter, int]]:
        """Each stage parameter with the data-parallel rank that keeps its optimizer state
        (``use_distributed_optimizer``): the largest first, each to the least loaded rank."""
        params = self._params()
        load, owners = [0] * self.dp, {}
        for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
            rank = load.index(min(load))
            load[rank] += params[i].numel()
            owners[i] = rank
        return [(p, owners[i]) for i, p in enumerate(params)]

    def _owned(self) -> list[nn.Parameter]:
        me = self.data_parallel_rank
        return [p for p, rank in self._owners() if rank == me]

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

    def _norm_params(self) -> list[nn.Parameter]:
        """The parameters the global norm counts: a tied embedding once (on the first stage)."""
        params = self._params()
        if self.tied is not None and not self.tied.counted:
            params = [p for p in params if p is not self.tied.param]
        return params

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        return self._clip(self._norm_params(), max_norm, norm_type)

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
        if self.tied is not None and not self.tied.counted:  # counted on the first stage
            grads.append(self.tied.param.grad)
        for g in grads:
            g.mul_(scale)
        return total

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        params = self._params()
        if self.tied is not None:
            self.tied.sync()
        if self.dp > 1:
            group = self.mesh["dp"].get_group()
            for p in params:
                if p.grad is not None:
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    dist.all_reduce(local, group=group)
                    local.div_(self.dp)
        if self.plugin.gradient_clipping:
            self._clip(self._norm_params(), self.plugin.gradient_clipping)
        result = super().optimizer_step(optimizer, closure)
        if self.plugin.use_distributed_optimizer and self.dp > 1:
            self._share_updates()
        return result

    def _share_updates(self) -> None:
        """Distributed optimizer: each data-parallel rank stepped the parameters it owns; they
        go to the other ranks, and the gradients of the others are dropped."""
        group, me = self.mesh["dp"].get_group(), self.data_parallel_rank
        with torch.no_grad():
            for param, rank in self._owners():
                local = param.to_local() if hasattr(param, "to_local") else param
                dist.broadcast(local.data, src=dist.get_global_rank(group, rank), group=group)
                if rank != me:
                    param.grad = None

    # -- state dicts --------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full model's state dict on rank 0 (``{}`` elsewhere): TP shards gathered within
        each stage, the stages' pieces gathered across the pipeline."""
        stage = self.unwrap_parallel(model)
        local = {}
        for k, v in stage.state_dict().items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            local[k] = v.detach().cpu()
        local = stage.export_state(local)
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
