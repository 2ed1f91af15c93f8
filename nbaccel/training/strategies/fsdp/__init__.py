"""FSDP2 behind the strategy interface: the plugin, the strategy, sharded checkpoints."""
