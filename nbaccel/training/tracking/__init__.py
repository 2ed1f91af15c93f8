"""Experiment trackers: the interface and registry (``trackers``), Accelerate's helpers, the
library backends."""
