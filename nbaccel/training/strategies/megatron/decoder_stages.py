"""One pipeline stage of a decoder-only language model, cut by hand (no tracing).

Training with pipeline parallelism needs each rank to hold a stage it can run forward and
backward on, and tensor parallelism inside the stage needs the stage's modules as they are
(a traced graph bakes in the full head counts). :class:`DecoderStage` keeps the model's own
modules for decoder layers ``[first, last)``: the token embedding on the first stage, the final
norm and LM head on the last, the rotary embedding everywhere. Parameter names stay those of
the full model (``model.layers.3.mlp.up_proj.weight``), so stages' state dicts together are the
model's state dict.

Models of the Llama family are supported (a base model with ``embed_tokens``, ``layers``,
``norm``, ``rotary_emb`` and an ``lm_head``: Llama, Mistral, Qwen2/3, Gemma...); others are
refused naming what is missing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DecoderStage", "WholeModelSaving", "check_decoder_model", "layer_ranges"]

_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


#: why a model family the Megatron-LM guide lists is not cut into stages here
_FAMILY_REASONS = {
    "bert": "BERT is an encoder (Megatron-LM's engine builds its own BERT); pipeline stages here "
    "cut decoder-only language models. Train BERT with FSDP2 (fsdp_plugin) or DeepSpeed",
    "megatron-bert": "Megatron-BERT is an encoder; pipeline stages here cut decoder-only language "
    "models. Train it with FSDP2 (fsdp_plugin) or DeepSpeed",
    "t5": "T5 is an encoder-decoder (Megatron-LM splits it at pipeline_model_parallel_split_rank); "
    "pipeline stages here cut decoder-only language models. Train T5 with FSDP2 (fsdp_plugin) "
    "or DeepSpeed",
}


def check_decoder_model(model: nn.Module, stages: int = 1) -> nn.Module:
    """The base model (``model.model``) after checking the parts a stage needs; errors name
    the model family's reason and what trains it instead."""
    kind = str(getattr(getattr(model, "config", None), "model_type", "")).lower()
    if kind in _FAMILY_REASONS:
        raise NotImplementedError(
            f"MegatronLMPlugin cannot train {type(model).__name__} here: {_FAMILY_REASONS[kind]}."
        )
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    missing = [p for p in _PARTS if base is None or not hasattr(base, p)]
    if not hasattr(model, "lm_head"):
        missing.append("lm_head")
    if missing:
        raise ValueError(
            f"Pipeline-parallel training cuts decoder language models of the Llama family "
            f"(base model with {', '.join(_PARTS)}, and lm_head); {type(model).__name__} lacks "
            f"{missing}. Train it with ParallelismConfig (tensor parallel / FSDP2) instead."
        )
    head, embed = getattr(model.lm_head, "weight", None), getattr(base.embed_tokens, "weight", 0)
    if stages > 1 and head is embed:
        raise NotImplementedError(
            f"{type(model).__name__} ties lm_head to embed_tokens (tie_word_embeddings=True): "
            f"with pp_degree={stages} they would live on the first and the last stage and "
            "drift apart. Build the model with tie_word_embeddings=False, or use pp_degree=1."
        )
    return base


def layer_ranges(
    num_layers: int, stages: int, last_stage_layers: int | None = None
) -> list[tuple[int, int]]:
    """``[first, last)`` decoder layers of each stage, as even as possible (earlier stages get
    the extra layers); ``last_stage_layers`` fixes the last stage's count (Megatron-LM's
    ``decoder_last_pipeline_num_layers``)."""
    if last_stage_layers is not None and stages > 1:
        rest = num_layers - last_stage_layers
        if last_stage_layers < 1 or rest < stages - 1:
            raise ValueError(
                f"decoder_last_pipeline_num_layers={last_stage_layers} leaves {rest} of the "
                f"{num_layers} decoder layers for {stages - 1} other stages: each stage needs "
                "one layer or more."
            )
        return [*layer_ranges(rest, stages - 1), (rest, num_layers)]
    if num_layers < stages:
        raise ValueError(
            f"The model has {num_layers} decoder layers, fewer than pp_degree={stages} pipeline "
            f"stages: use pp_degree <= {num_layers}."
        )
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class WholeModelSaving:
    """What a pipeline stage offers to save the whole model (every stage, TP shards gathered)
    as transformers does. The strategy sets ``full_state_dict``; ``model_class`` and
    ``config`` come from the model the stage was cut from."""

    full_state_dict: Any = None
    model_class: Any = None
    config: Any = None

    def export_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This stage's full (TP-gathered) tensors under the model's own names and layouts."""
        return state

    def save_pretrained(
        self,
        save_directory: str,
        is_main_process: bool = True,
        state_dict: dict[str, Any] | None = None,
        save_function: Any = None,
        **kwargs: Any,
    ) -> None:
        """The whole model (every stage, TP shards gathered) saved as transformers does; every
        rank calls it (the gather is a collective), the main process writes."""
        if state_dict is None:
            if self.full_state_dict is None:
                raise RuntimeError("This stage was not prepared by an Accelerator: no gather.")
            state_dict = self.full_state_dict()
        if not is_main_process or not state_dict:
            return
        with torch.device("meta"):
            whole = self.model_class(self.config)
        if save_function is not None:
            kwargs["save_function"] = save_function
        whole.save_pretrained(save_directory, state_dict=state_dict, **kwargs)


class DecoderStage(WholeModelSaving, nn.Module):
    """Stage ``index`` of ``stages`` of a decoder LM: input ids (first stage) or hidden states
    in, hidden states or logits (last stage) out. Takes the model's modules (the model is
    consumed)."""

    def __init__(
        self, model: nn.Module, index: int, stages: int, last_stage_layers: int | None = None
    ) -> None:
        super().__init__()
        base = check_decoder_model(model, stages)
        first, last = layer_ranges(len(base.layers), stages, last_stage_layers)[index]
        self.model_class = type(model)
        self.is_first, self.is_last = index == 0, index == stages - 1
        #: ranks the sequence is split over between blocks (sequence parallelism), else 1
        self.sequence_shards = 1
        self.layer_range = (first, last)
        base.layers = nn.ModuleDict({str(i): base.layers[i] for i in range(first, last)})
        if not self.is_first:
            base.embed_tokens = None
        if not self.is_last:
            base.norm = None
        self.config = getattr(model, "config", None)
        prefix = getattr(model, "base_model_prefix", "model")
        self.prefix = prefix
        self.add_module(prefix, base)  # same parameter names as the full model
        self.lm_head = model.lm_head if self.is_last else None

    def blocks(self) -> nn.ModuleDict:
        """This stage's decoder layers, by their index in the model."""
        return getattr(self, self.prefix).layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = getattr(self, self.prefix)
        if self.is_first and x.shape[1] % self.sequence_shards:
            raise ValueError(
                f"Sequence parallelism splits the sequence over {self.sequence_shards} ranks: "
                f"the length {x.shape[1]} must divide by it (pad or trim the batches)."
            )
        hidden = base.embed_tokens(x) if self.is_first else x
        batch, seq = hidden.shape[0], hidden.shape[1] * self.sequence_shards
        positions = torch.arange(seq, device=hidden.device).unsqueeze(0).expand(batch, -1)
        position_embeddings = base.rotary_emb(hidden, position_ids=positions)
        for layer in base.layers.values():
            hidden = layer(
                hidden,
                attention_mask=None,  # causal attention (sdpa's is_causal): no padding
                position_ids=positions,
                position_embeddings=position_embeddings,
            )
        if not self.is_last:
            return hidden
        return self.lm_head(base.norm(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over the tokens whose label is not -100 (transformers'
    causal LM loss)."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
    )
