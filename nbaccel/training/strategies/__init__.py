"""How models are trained in parallel: one ``Strategy`` interface (``base``), chosen once per
Accelerator from the run's ``DistributedType`` (``registry``); one package per engine:
``deepspeed/``, ``fsdp/``, ``model_parallel/`` (mesh, TP/SP, pipeline stages, Megatron-LM),
beside DDP and XLA."""
