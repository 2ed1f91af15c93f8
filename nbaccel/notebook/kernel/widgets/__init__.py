"""Driver-side notebook widgets: progress from ranks, per-rank output, memory, device maps."""
