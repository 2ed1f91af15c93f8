"""How models are trained in parallel: one ``Strategy`` interface (``base``), DDP, FSDP2, XLA,
chosen once per Accelerator from the run's ``DistributedType`` (``registry``)."""
