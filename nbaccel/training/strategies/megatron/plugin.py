"""``MegatronLMPlugin``: every option of Accelerate's plugin, each acted on, checked or refused.

nbaccel runs the plugin on torch's own engines (:mod:`.strategy`), not on Megatron-LM. Each
field falls in one of three kinds (:data:`FIELD_KINDS`, the table in ``docs/megatron.md``):

- **acts**: the parallel layout (``tp_degree``, ``pp_degree``, ``num_micro_batches``,
  ``sequence_parallelism``), the step (``gradient_clipping``, ``recompute_*``,
  ``use_distributed_optimizer``, ``custom_loss_function``, ``return_logits``), the
  learning-rate and weight-decay schedule that ``MegatronLMDummyScheduler`` stands for
  (:mod:`.scheduler`), the batch (``seq_length`` checked against it,
  ``is_train_batch_min``);
- **held**: ``eval_iters`` / ``eval_interval`` are validated and kept for the training loop to
  read (in Accelerate too they only size Megatron-LM's own indexed datasets);
- **refused**: what only Megatron-LM's engine does (its train-step classes, dataset providers,
  MoE, interleaved schedules, fused-kernel switches...), refused when set, naming the field
  and the torch way to get the same.

As in Accelerate, a field left unset is read from the launch (``MEGATRON_LM_<FIELD>``
variables, written by ``nbaccel launch --use_megatron_lm``); ``other_megatron_args`` keys are
read by name: a field's name (or Megatron-LM's name for it) acts as the field, any other key is
refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from nbaccel.values.booleans import parse_bool

__all__ = ["FIELD_KINDS", "MegatronLMPlugin"]

_ENV = "MEGATRON_LM_"
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")

#: Megatron-LM's argument names for plugin fields (``other_megatron_args`` keys)
_MEGATRON_NAMES = {
    "tensor_model_parallel_size": "tp_degree",
    "pipeline_model_parallel_size": "pp_degree",
    "sequence_parallel": "sequence_parallelism",
    "clip_grad": "gradient_clipping",
}

#: field -> (value that means "not asked for", why nbaccel refuses it, what to do instead)
_REFUSED: dict[str, tuple[Any, str]] = {
    "use_custom_fsdp": (
        False,
        "Megatron-LM's own FSDP; shard the optimizer state with "
        "use_distributed_optimizer=True, or train with FSDP2 "
        "(fsdp_plugin=FullyShardedDataParallelPlugin())",
    ),
    "overlap_cpu_optimizer_d2h_h2d": (
        False,
        "Megatron-LM's CPU-offloaded optimizer; offload "
        "with DeepSpeed (offload_optimizer_device='cpu')",
    ),
    "optimizer_cpu_offload": (
        False,
        "Megatron-LM's CPU-offloaded optimizer; offload with "
        "DeepSpeed (offload_optimizer_device='cpu')",
    ),
    "use_precision_aware_optimizer": (
        False,
        "Megatron-LM's fused optimizer kernels; use torch's optimizers with mixed_precision='bf16'",
    ),
    "no_load_optim": (
        False,
        "Megatron-LM's checkpoint loader; accelerator.load_state "
        "restores the optimizer with the model",
    ),
    "no_save_optim": (
        False,
        "Megatron-LM's checkpoint writer; accelerator.save_state saves "
        "the optimizer with the model (accelerator.save_model: weights only)",
    ),
    "eod_mask_loss": (
        False,
        "Megatron-LM's GPT dataset (it knows the EOD token); mask it in "
        "the labels (-100) or pass custom_loss_function",
    ),
    "expert_model_parallel_size": (1, "mixture-of-experts parallelism of Megatron-LM's own models"),
    "expert_tensor_parallel_size": (
        1,
        "mixture-of-experts parallelism of Megatron-LM's own models",
    ),
    "context_parallel_size": (
        1,
        "Megatron-LM's context parallelism; use ParallelismConfig(cp_size=...) on GPUs",
    ),
    "attention_softmax_in_fp32": (
        None,
        "a switch of Megatron-LM's fused softmax; the softmax "
        "precision is the model's attention kernel's "
        "(config._attn_implementation)",
    ),
    "calculate_per_token_loss": (
        False,
        "Megatron-LM's loss reduction; the loss here is the "
        "mean over micro-batches of the causal LM loss (pass "
        "custom_loss_function for another)",
    ),
    "attention_backend": (
        True,
        "Megatron-LM's attention kernels; attention runs with the "
        "model's config._attn_implementation",
    ),
    "pipeline_model_parallel_split_rank": (
        None,
        "the encoder/decoder split of Megatron-LM's T5; "
        "pipeline stages here cut decoder-only models",
    ),
    "num_layers_per_virtual_pipeline_stage": (
        None,
        "Megatron-LM's interleaved schedule; stages here run torch's 1F1B schedule, one per rank",
    ),
    "consumed_samples": (
        None,
        "Megatron-LM's sampler; resume with accelerator.load_state "
        "(and accelerator.skip_first_batches)",
    ),
    "no_wd_decay_cond": (
        None,
        "Megatron-LM's optimizer builder; put those parameters in a "
        "torch param group with weight_decay=0.0",
    ),
    "scale_lr_cond": (
        None,
        "Megatron-LM's optimizer builder; put those parameters in a torch "
        "param group with their own lr",
    ),
    "lr_mult": (
        1.0,
        "it scales the lr of scale_lr_cond's parameters in Megatron-LM's "
        "optimizer builder; give those parameters a param group with their own lr",
    ),
    "megatron_dataset_flag": (False, "Megatron-LM's indexed datasets; pass torch DataLoaders"),
    "encoder_seq_length": (None, "encoder models (BERT, T5) are not cut into stages here"),
    "tensorboard_dir": (
        None,
        "Megatron-LM's own logging; use Accelerator(log_with='tensorboard', project_dir=...)",
    ),
    "set_all_logging_options": (
        False,
        "Megatron-LM's own logging; use Accelerator(log_with='tensorboard', project_dir=...)",
    ),
    "use_rotary_position_embeddings": (
        None,
        "Megatron-LM builds its own model; the model's config decides its position embeddings",
    ),
    "custom_train_step_class": (
        None,
        "Megatron-LM's train step; the training step here is "
        "torch's pipeline schedule (a custom loss goes in "
        "custom_loss_function)",
    ),
    "custom_train_step_kwargs": (None, "Megatron-LM's train step (see custom_train_step_class)"),
    "custom_model_provider_function": (
        None,
        "Megatron-LM builds its own model; pass the transformers model to accelerator.prepare",
    ),
    "custom_prepare_model_function": (
        None,
        "Megatron-LM builds its own model; pass the transformers model to accelerator.prepare",
    ),
    "custom_megatron_datasets_provider_function": (
        None,
        "Megatron-LM's indexed datasets; pass torch DataLoaders",
    ),
    "custom_get_batch_function": (
        None,
        "Megatron-LM's batch reader; batches are the DataLoader's dicts (input_ids, labels)",
    ),
}

_ACTS = [
    "tp_degree",
    "pp_degree",
    "num_micro_batches",
    "gradient_clipping",
    "sequence_parallelism",
    "recompute_activations",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "use_distributed_optimizer",
    "decoder_last_pipeline_num_layers",
    "attention_dropout",
    "hidden_dropout",
    "is_train_batch_min",
    "train_iters",
    "train_samples",
    "weight_decay_incr_style",
    "start_weight_decay",
    "end_weight_decay",
    "lr_decay_style",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "lr_warmup_fraction",
    "min_lr",
    "seq_length",
    "decoder_seq_length",
    "return_logits",
    "custom_loss_function",
    "other_megatron_args",
]

#: every field of the plugin -> "acts", "held" or "refused"
FIELD_KINDS: dict[str, str] = {
    **dict.fromkeys(_ACTS, "acts"),
    "eval_iters": "held",
    "eval_interval": "held",
    **dict.fromkeys(_REFUSED, "refused"),
}

#: fields read from MEGATRON_LM_<NAME> when left unset, with their parser
_FROM_ENV: dict[str, Callable[[str], Any]] = {
    "tp_degree": int,
    "pp_degree": int,
    "num_micro_batches": int,
    "gradient_clipping": float,
    "sequence_parallelism": parse_bool,
    "recompute_activations": parse_bool,
    "use_distributed_optimizer": parse_bool,
    "recompute_granularity": str,
    "recompute_method": str,
    "recompute_num_layers": int,
    "decoder_last_pipeline_num_layers": int,
    "attention_dropout": float,
    "hidden_dropout": float,
    "use_custom_fsdp": parse_bool,
    "no_load_optim": parse_bool,
    "no_save_optim": parse_bool,
    "eod_mask_loss": parse_bool,
    "optimizer_cpu_offload": parse_bool,
    "overlap_cpu_optimizer_d2h_h2d": parse_bool,
    "use_precision_aware_optimizer": parse_bool,
    "attention_backend": parse_bool,
    "expert_model_parallel_size": int,
    "expert_tensor_parallel_size": int,
    "context_parallel_size": int,
    "attention_softmax_in_fp32": parse_bool,
    "calculate_per_token_loss": parse_bool,
    "use_rotary_position_embeddings": parse_bool,
}


@dataclass
class MegatronLMPlugin:
    """Megatron-LM's options (Accelerate's ``MegatronLMPlugin``), run on torch's engines.

    The fields are Accelerate's; what each does here is in :data:`FIELD_KINDS` and
    ``docs/megatron.md``. After ``accelerator.prepare`` the plugin also carries
    ``micro_batch_size``, ``data_parallel_size`` and ``global_batch_size``
    (``dp x micro_batch_size x num_micro_batches``), as Accelerate's does.
    """

    tp_degree: int | None = None
    pp_degree: int | None = None
    num_micro_batches: int | None = None
    gradient_clipping: float | None = None
    sequence_parallelism: bool | None = None
    recompute_activations: bool | None = None
    use_distributed_optimizer: bool | None = None
    use_custom_fsdp: bool | None = None
    overlap_cpu_optimizer_d2h_h2d: bool | None = None
    no_load_optim: bool | None = None
    eod_mask_loss: bool | None = None
    no_save_optim: bool | None = None
    optimizer_cpu_offload: bool | None = None
    use_precision_aware_optimizer: bool | None = None
    decoder_last_pipeline_num_layers: int | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_backend: bool | None = None
    expert_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    attention_dropout: float | None = None
    hidden_dropout: float | None = None
    attention_softmax_in_fp32: bool | None = None
    expert_tensor_parallel_size: int | None = None
    calculate_per_token_loss: bool | None = None
    use_rotary_position_embeddings: bool | None = None
    pipeline_model_parallel_split_rank: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    is_train_batch_min: bool = True
    train_iters: int | None = None
    train_samples: int | None = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_warmup_fraction: float | None = None
    min_lr: float = 0.0
    consumed_samples: list[int] | None = None
    no_wd_decay_cond: Callable | None = None
    scale_lr_cond: Callable | None = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    tensorboard_dir: str | None = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Any = None
    custom_train_step_kwargs: dict[str, Any] | None = None
    custom_model_provider_function: Callable | None = None
    custom_prepare_model_function: Callable | None = None
    custom_megatron_datasets_provider_function: Callable | None = None
    custom_get_batch_function: Callable | None = None
    custom_loss_function: Callable | None = None
    other_megatron_args: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._read_other_args()
        for name, parse in _FROM_ENV.items():
            text = os.environ.get(_ENV + name.upper())
            if getattr(self, name) is None and text not in (None, "", "None"):
                setattr(self, name, parse(text))
        self.tp_degree = int(self.tp_degree or 1)
        self.pp_degree = int(self.pp_degree or 1)
        self.num_micro_batches = int(self.num_micro_batches or 1)
        if self.gradient_clipping is None:
            self.gradient_clipping = 1.0  # Accelerate's default (0 turns clipping off)
        for name in ("sequence_parallelism", "recompute_activations", "use_distributed_optimizer"):
            setattr(self, name, bool(getattr(self, name)))
        self._refuse()
        self._check()
        #: set by accelerator.prepare (the dataloaders give the micro-batch size)
        self.micro_batch_size: int | None = None
        self.data_parallel_size: int | None = None
        self.global_batch_size: int | None = None

    # -- checks -------------------------------------------------------------------------------
    def _read_other_args(self) -> None:
        """``other_megatron_args``: each key a field (or Megatron-LM's name for one), else
        refused by name."""
        names = {f.name for f in fields(self)} - {"other_megatron_args"}
        unknown = []
        for key, value in (self.other_megatron_args or {}).items():
            name = _MEGATRON_NAMES.get(key, key)
            if name not in names:
                unknown.append(key)
                continue
            current = getattr(self, name)
            default = next(f.default for f in fields(self) if f.name == name)
            if current not in (None, default) and current != value:
                raise ValueError(
                    f"other_megatron_args[{key!r}]={value!r} contradicts {name}={current!r}: "
                    "give it once."
                )
            setattr(self, name, value)
        if unknown:
            raise NotImplementedError(
                f"other_megatron_args {sorted(unknown)}: nbaccel runs this plugin on torch's "
                "engines, not Megatron-LM, and these arguments have no meaning there (the "
                "model's own config decides its architecture: position embeddings, attention "
                "heads...; a tokenizer is the script's). Keys that are MegatronLMPlugin fields "
                f"(or {', '.join(_MEGATRON_NAMES)}) are read; remove the others."
            )

    def _refuse(self) -> None:
        given = []
        for name, (unset, why) in _REFUSED.items():
            value = getattr(self, name)
            if value is not None and value != unset and not (unset is None and value is False):
                given.append(f"{name}={value!r}: {why}")
        if given:
            raise NotImplementedError(
                "MegatronLMPlugin runs on torch's engines in nbaccel (no Megatron-LM install); "
                "these options only exist inside Megatron-LM's engine:\n  - "
                + "\n  - ".join(given)
                + "\nLeave them unset (docs/megatron.md maps every field)."
            )

    def _check(self) -> None:
        for name in ("tp_degree", "pp_degree", "num_micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.gradient_clipping < 0:
            raise ValueError(
                f"gradient_clipping must be >= 0 (0: off), got {self.gradient_clipping}."
            )
        _choice("lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        _choice("weight_decay_incr_style", self.weight_decay_incr_style, WD_INCR_STYLES)
        if self.recompute_granularity is not None:
            _choice("recompute_granularity", self.recompute_granularity, ("full", "selective"))
        if self.recompute_method is not None:
            _choice("recompute_method", self.recompute_method, ("uniform", "block"))
        if (self.recompute_method or "uniform") == "uniform" and self.recompute_num_layers not in (
            None,
            1,
        ):
            raise NotImplementedError(
                f"recompute_method='uniform' with recompute_num_layers={self.recompute_num_layers}"
                ": nbaccel recomputes each decoder layer on its own (uniform, 1 layer); use "
                "recompute_method='block' to recompute the first N layers of each stage."
            )
        both = None not in (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant" and both:  # noqa: SIM102
            if self.start_weight_decay != self.end_weight_decay:
                raise ValueError(
                    "weight_decay_incr_style='constant' keeps one weight decay: "
                    f"start_weight_decay={self.start_weight_decay} differs from "
                    f"end_weight_decay={self.end_weight_decay}. Use 'linear' or 'cosine'."
                )
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction <= 1:
            raise ValueError(
                f"lr_warmup_fraction must be in [0, 1], got {self.lr_warmup_fraction}."
            )
        for name in ("eval_iters", "eval_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.decoder_seq_length is not None:
            if self.seq_length not in (None, self.decoder_seq_length):
                raise ValueError(
                    f"seq_length={self.seq_length} and decoder_seq_length="
                    f"{self.decoder_seq_length} differ: a decoder model has one sequence length."
                )
            self.seq_length = self.decoder_seq_length
        if self.sequence_parallelism and self.tp_degree == 1:
            self.sequence_parallelism = False  # Megatron-LM: only with tensor parallelism

    # -- what prepare reads -------------------------------------------------------------------
    @property
    def recompute(self) -> str | None:
        """``"full"`` (whole decoder layers), ``"selective"`` (attention blocks) or None:
        recompute_activations asks for Megatron-LM's full-layer default here."""
        if self.recompute_granularity is not None:
            return self.recompute_granularity
        return "full" if self.recompute_activations else None

    def check_world(self, num_processes: int) -> int:
        """The data-parallel size for ``num_processes`` ranks; ValueError when
        ``tp_degree x pp_degree`` does not divide them."""
        group = self.tp_degree * self.pp_degree
        if num_processes % group:
            raise ValueError(
                f"tp_degree={self.tp_degree} x pp_degree={self.pp_degree} = {group} does not "
                f"divide the {num_processes} ranks of the run: launch a multiple of {group} "
                "processes, or change the degrees."
            )
        return num_processes // group

    def set_training_args(self, micro_batch_size: int, dp_degree: int) -> None:
        """Record the batch layout (Accelerate's method of the same name)."""
        self.data_parallel_size = dp_degree
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = dp_degree * micro_batch_size * self.num_micro_batches

    @property
    def megatron_lm_default_args(self) -> dict[str, Any]:
        """The settings under Megatron-LM's argument names (Accelerate's attribute)."""
        return {
            "tensor_model_parallel_size": self.tp_degree,
            "pipeline_model_parallel_size": self.pp_degree,
            "num_micro_batches": self.num_micro_batches,
            "sequence_parallel": self.sequence_parallelism,
            "clip_grad": self.gradient_clipping,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "recompute_granularity": self.recompute,
            "micro_batch_size": self.micro_batch_size,
            "data_parallel_size": self.data_parallel_size,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "eval_iters": self.eval_iters,
            "eval_interval": self.eval_interval,
            "lr_decay_style": self.lr_decay_style,
            "min_lr": self.min_lr,
        }


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}.")
