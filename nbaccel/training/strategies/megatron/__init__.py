"""Megatron-LM's plugin on torch's own engines: the plugin, the strategy, its pipeline stages
(decoder and GPT-2, the tied embedding across stages, micro-batched loaders), its schedule and
the launch's variables. The tensor and sequence parallel styles it applies come from
:mod:`nbaccel.training.strategies.model_parallel`."""
