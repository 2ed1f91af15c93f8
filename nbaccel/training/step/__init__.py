"""The training step's parts: the wrapped optimizer and scheduler, local SGD, batch-size retries,
regional compilation."""
