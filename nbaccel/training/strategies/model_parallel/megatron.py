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
(:mod:`.megatron_scheduler`); with ``use_distributed_optimizer`` each data-parallel rank steps
its share of the parameters. The plugin's fields are in :mod:`.megatron_plugin`; what only
Megatron-LM's engine does (its train-step classes, datasets, ``megatron_generate``) is refused
there, naming the field.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.model_parallel.decoder_stages import (
    DecoderStage,
    causal_lm_loss,
    check_decoder_model,
)
from nbaccel.training.strategies.model_parallel.gpt2_stages import GPT2Stage, gpt2_tp_plan, is_gpt2
from nbaccel.training.strategies.model_parallel.megatron_plugin import MegatronLMPlugin
from nbaccel.training.strategies.model_parallel.tensor_parallel import check_tensor_parallel
from nbaccel.training.strategies.repoint import remember_moves

__all__ = ["MegatronLMPlugin", "MegatronStrategy", "PipelineTrainingModel"]

logger = logging.getLogger(__name__)


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
        _check_model_options(model, p)
        before = dict(model.named_parameters(remove_duplicate=False))
        if is_gpt2(model):
            stage = self._gpt2_stage(model)
        else:
            stage = self._decoder_stage(model)
        if p.recompute:
            _checkpoint_layers(stage, p)
        self._remember_splits(before, stage)
        self.precision.wrap_forward(stage)
        stage.full_state_dict = lambda: self.model_state_dict(stage)
        self.stages.append(stage)
        loss_fn = p.custom_loss_function or causal_lm_loss
        pp_rank, group = self.pipeline_parallel_rank, self.mesh["pp"].get_group()
        kind = Schedule1F1B if p.num_micro_batches >= p.pp_degree else ScheduleGPipe

        part = PipelineStage(stage, pp_rank, p.pp_degree, self.device, group=group)
        schedule = kind(part, p.num_micro_batches, loss_fn=loss_fn)
        wrapped = PipelineTrainingModel(stage, schedule, self)
        remember_moves(wrapped, before, dict(stage.named_parameters(remove_duplicate=False)))
        return wrapped

    def _decoder_stage(self, model: nn.Module) -> DecoderStage:
        """This rank's stage of a Llama-family model, split over ``tp`` with the model's plan
        (sequence parallel when asked)."""
        p = self.plugin
        check_decoder_model(model, p.pp_degree)
        resolved = check_tensor_parallel(model, p.tp_degree) if p.tp_degree > 1 else {}
        by_module = {id(model.get_submodule(n)): s for n, s in resolved.items()}
        stage = DecoderStage(
            model, self.pipeline_parallel_rank, p.pp_degree, p.decoder_last_pipeline_num_layers
        )
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
        return stage

    def _gpt2_stage(self, model: nn.Module) -> GPT2Stage:
        """This rank's stage of a GPT-2 model, split over ``tp`` (:mod:`.gpt2_stages`); its
        tied ``wte``/``lm_head`` kept one parameter on one stage, synchronised over two."""
        from torch.distributed.tensor.parallel import parallelize_module

        p = self.plugin
        if p.sequence_parallelism:
            raise NotImplementedError(
                "sequence_parallelism=True is not offered for GPT-2 here: its learned position "
                "embedding is added to the token embedding before any split along the sequence. "
                "Set sequence_parallelism=False (tensor and pipeline parallel still apply), or "
                "train a Llama-family model."
            )
        stage = GPT2Stage(
            model, self.pipeline_parallel_rank, p.pp_degree, p.decoder_last_pipeline_num_layers
        )
        stage.to(self.device)
        if p.tp_degree > 1:
            parallelize_module(stage, self.mesh["tp"], gpt2_tp_plan(stage, p.tp_degree))
            if stage.tied and stage.is_first and stage.is_last:  # one parameter again
                stage.lm_head.weight = stage.transformer.wte.weight
        if stage.tied and p.pp_degree > 1:
            self._tie_stages(stage)
        return stage

    def _remember_splits(self, before: dict[str, nn.Parameter], stage: nn.Module) -> None:
        """Parameters that became several (GPT-2's ``c_attn`` -> q, k, v), so that an
        optimizer built on the model steps the pieces."""
        after = {
            n.replace("_checkpoint_wrapped_module.", ""): q for n, q in stage.named_parameters()
        }
        for name, old in before.items():
            if name in after or not name.endswith((".c_attn.weight", ".c_attn.bias")):
                continue
            head, _, kind = name.rpartition(".")
            news = [after.get(f"{head}.{part}.{kind}") for part in ("q", "k", "v")]
            if all(n is not None for n in news):
                self._splits[id(old)] = (old, news)

    def _tie_stages(self, stage: GPT2Stage) -> None:
        """A group of the first and last stage for each (dp, tp) place: their copies of the
        tied embedding sum their gradients there before each step."""
        pp, dp, tp = self.plugin.pp_degree, self.dp, self.plugin.tp_degree
        me = dist.get_rank()
        for d in range(dp):
            for t in range(tp):
                ranks = [d * tp + t, (pp - 1) * dp * tp + d * tp + t]
                group = dist.new_group(ranks)  # every rank creates every group, in order
                if me in ranks:
                    self._tied_group = group
        if stage.is_first:
            self._tied_param = stage.transformer.wte.weight
        elif stage.is_last:
            self._tied_param = stage.lm_head.weight

    _tied_group: Any = None
    _tied_param: Any = None

    def _sync_tied(self) -> None:
        param = self._tied_param
        if self._tied_group is None or param is None:
            return
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        placements = getattr(param, "placements", None)
        if placements is not None and param.grad.placements != placements:
            # the embedding's backward gives a replicated gradient; the head's is sharded
            param.grad = param.grad.redistribute(param.device_mesh, placements)
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        dist.all_reduce(local, group=self._tied_group)

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

    def check_batch(self, input_ids: torch.Tensor | None) -> None:
        """The batch's sequence length against ``seq_length`` (when set)."""
        want = self.plugin.seq_length
        if want is not None and input_ids is not None and input_ids.shape[-1] != want:
            raise ValueError(
                f"The batch's sequences have {input_ids.shape[-1]} tokens, but MegatronLMPlugin("
                f"seq_length={want}) was set: pad or cut the sequences to {want} tokens (the "
                "pipeline's stages exchange activations of that length), or change seq_length."
            )

    def make_scheduler(self, stand_in: Any) -> Any:
        """Megatron-LM's scheduler for a ``MegatronLMDummyScheduler``."""
        from nbaccel.training.strategies.model_parallel.megatron_scheduler import (
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
        if self._tied_group is not None and self.stages and self.stages[0].is_last:
            params = [p for p in params if p is not self._tied_param]
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
        if self._tied_group is not None and self.stages[0].is_last:  # counted on the first
            grads.append(self._tied_param.grad)
        for g in grads:
            g.mul_(scale)
        return total

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        params = self._params()
        self._sync_tied()
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


def _checkpoint_layers(stage: DecoderStage, plugin: MegatronLMPlugin) -> None:
    """Activation recomputation: whole decoder layers (``full``; with ``recompute_method=
    'block'`` only the first ``recompute_num_layers`` of the stage) or their attention blocks
    (``selective``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = stage.blocks()
    keys = list(layers.keys())
    if plugin.recompute_method == "block":
        keys = keys[: plugin.recompute_num_layers or 1]
    for key in keys:
        if plugin.recompute == "selective":
            layer = layers[key]
            name = "self_attn" if hasattr(layer, "self_attn") else "attn"
            setattr(layer, name, checkpoint_wrapper(getattr(layer, name), preserve_rng_state=True))
        else:
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=True)


_DROPOUT_NAMES = {
    "attention_dropout": ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"),
    "hidden_dropout": ("hidden_dropout", "resid_pdrop", "hidden_dropout_prob"),
}


def _check_model_options(model: nn.Module, plugin: MegatronLMPlugin) -> None:
    """The plugin's model options against the model as built (nbaccel trains it as it is)."""
    config = getattr(model, "config", None)
    for option, names in _DROPOUT_NAMES.items():
        wanted = getattr(plugin, option)
        if wanted is None:
            continue
        name = next((n for n in names if hasattr(config, n)), None)
        has = float(getattr(config, name, 0.0) or 0.0) if name else 0.0
        if abs(has - float(wanted)) > 1e-12:
            raise ValueError(
                f"MegatronLMPlugin({option}={wanted}) but the model was built with "
                f"{name or option}={has}: nbaccel trains the model as built (Megatron-LM builds "
                f"its own). Set config.{name or option}={wanted} before building the model, or "
                f"leave {option} unset."
            )


def with_batch_size(loader: Any, batch_size: int) -> Any:
    """``loader`` rebuilt to yield full batches of ``batch_size`` (same dataset, sampler,
    collate): the pipeline's stages exchange activations of one shape, so a last batch too
    small for ``num_micro_batches`` full micro-batches is dropped, as Megatron-LM's samplers do
    (with a warning)."""
    from torch.utils.data import BatchSampler, DataLoader

    if loader.batch_size is None:
        raise ValueError(
            "MegatronLMPlugin needs DataLoaders built with batch_size (not a batch_sampler): "
            "it groups num_micro_batches micro-batches per training step."
        )
    left = len(loader.dataset) % batch_size if hasattr(loader.dataset, "__len__") else 0
    if left:
        logger.warning(
            "MegatronLMPlugin: %d samples of %d do not fill a last batch of %d (micro-batch x "
            "num_micro_batches); they are left out, as Megatron-LM's samplers do.",
            left,
            len(loader.dataset),
            batch_size,
        )
    elif loader.batch_size == batch_size:
        return loader
    sampler = BatchSampler(loader.sampler, batch_size, drop_last=True)
    return DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
