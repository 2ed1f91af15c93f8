"""Model parallelism over a DeviceMesh: the mesh strategy (tensor parallel, HSDP and their
compositions), tensor parallel plans and Megatron-style sequence parallelism. Megatron-LM's
plugin, built on these, is :mod:`nbaccel.training.strategies.megatron`."""
