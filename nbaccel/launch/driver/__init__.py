"""The driver side of a launch (the notebook kernel): the worker group, its ranks' streams and
ends, the driver loop, and how a launch is rendered."""
