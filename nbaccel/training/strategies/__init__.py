"""How models are wrapped for parallel training: DDP, FSDP2, XLA."""
