"""DeepSpeed ZeRO behind the strategy interface: plugin, config, launch options, prepare, runtime,
wrappers."""
