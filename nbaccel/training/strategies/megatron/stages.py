"""This rank's pipeline stage of a Megatron run: cut from the model, split over ``tp``, with
activation recomputation, after checking the plugin's model options against the model.

:func:`build_stage` picks the stage kind (:class:`~.decoder_stages.DecoderStage` for the Llama
family, :class:`~.gpt2_stages.GPT2Stage` for GPT-2), places it, applies the tensor-parallel (and
sequence-parallel) plan and the recomputation the plugin asks for. :func:`split_moves` records
which model parameters became several (GPT-2's ``c_attn`` -> q, k, v), so that an optimizer
built on the model steps the pieces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nbaccel.training.strategies.megatron.decoder_stages import (
    DecoderStage,
    check_decoder_model,
)
from nbaccel.training.strategies.megatron.gpt2_stages import GPT2Stage, gpt2_tp_plan, is_gpt2
from nbaccel.training.strategies.megatron.plugin import MegatronLMPlugin
from nbaccel.training.strategies.model_parallel.tensor_parallel import check_tensor_parallel

__all__ = ["build_stage", "check_model_options", "split_moves"]

_DROPOUT_NAMES = {
    "attention_dropout": ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"),
    "hidden_dropout": ("hidden_dropout", "resid_pdrop", "hidden_dropout_prob"),
}


def check_model_options(model: nn.Module, plugin: MegatronLMPlugin) -> None:
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


def build_stage(
    model: nn.Module, plugin: MegatronLMPlugin, pp_rank: int, tp_mesh: Any, device: torch.device
) -> DecoderStage | GPT2Stage:
    """Stage ``pp_rank`` of ``model``, placed on ``device``, split over ``tp_mesh``,
    recomputing activations as the plugin says. The model is consumed."""
    check_model_options(model, plugin)
    build = _gpt2_stage if is_gpt2(model) else _decoder_stage
    stage = build(model, plugin, pp_rank, tp_mesh, device)
    if plugin.recompute:
        _checkpoint_layers(stage, plugin)
    return stage


def _decoder_stage(
    model: nn.Module, p: MegatronLMPlugin, pp_rank: int, tp_mesh: Any, device: torch.device
) -> DecoderStage:
    """A Llama-family stage, split with the model's plan (sequence parallel when asked)."""
    check_decoder_model(model, p.pp_degree)
    resolved = check_tensor_parallel(model, p.tp_degree) if p.tp_degree > 1 else {}
    by_module = {id(model.get_submodule(n)): s for n, s in resolved.items()}
    stage = DecoderStage(model, pp_rank, p.pp_degree, p.decoder_last_pipeline_num_layers)
    stage.to(device)
    if by_module:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = {n: by_module[id(m)] for n, m in stage.named_modules() if id(m) in by_module}
        if p.sequence_parallelism:
            from nbaccel.training.strategies.model_parallel.sequence_parallel import (
                sequence_parallel_plan,
            )

            plan = sequence_parallel_plan(stage, plan)
            stage.sequence_shards = p.tp_degree
        parallelize_module(stage, tp_mesh, plan)
    return stage


def _gpt2_stage(
    model: nn.Module, p: MegatronLMPlugin, pp_rank: int, tp_mesh: Any, device: torch.device
) -> GPT2Stage:
    """A GPT-2 stage, split over ``tp`` (:mod:`.gpt2_stages`); on one stage the tied
    ``wte``/``lm_head`` stay one parameter."""
    from torch.distributed.tensor.parallel import parallelize_module

    if p.sequence_parallelism:
        raise NotImplementedError(
            "sequence_parallelism=True is not offered for GPT-2 here: its learned position "
            "embedding is added to the token embedding before any split along the sequence. "
            "Set sequence_parallelism=False (tensor and pipeline parallel still apply), or "
            "train a Llama-family model."
        )
    stage = GPT2Stage(model, pp_rank, p.pp_degree, p.decoder_last_pipeline_num_layers)
    stage.to(device)
    if p.tp_degree > 1:
        parallelize_module(stage, tp_mesh, gpt2_tp_plan(stage, p.tp_degree))
        if stage.tied and stage.is_first and stage.is_last:  # one parameter again
            stage.lm_head.weight = stage.transformer.wte.weight
    return stage


def _checkpoint_layers(stage: DecoderStage | GPT2Stage, plugin: MegatronLMPlugin) -> None:
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


def split_moves(
    before: dict[str, nn.Parameter], stage: nn.Module
) -> dict[int, tuple[nn.Parameter, list[nn.Parameter]]]:
    """``id(old) -> (old, [pieces])`` for the model parameters that became several in
    ``stage`` (GPT-2's ``c_attn`` -> q, k, v)."""
    after = {n.replace("_checkpoint_wrapped_module.", ""): q for n, q in stage.named_parameters()}
    splits = {}
    for name, old in before.items():
        if name in after or not name.endswith((".c_attn.weight", ".c_attn.bias")):
            continue
        head, _, kind = name.rpartition(".")
        news = [after.get(f"{head}.{part}.{kind}") for part in ("q", "k", "v")]
        if all(n is not None for n in news):
            splits[id(old)] = (old, news)
    return splits
