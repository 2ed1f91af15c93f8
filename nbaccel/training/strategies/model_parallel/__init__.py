"""Model parallelism over a DeviceMesh: tensor, sequence and pipeline parallel, HSDP, Megatron-LM's
plugin."""
