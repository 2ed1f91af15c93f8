"""Weights into a model: a checkpoint loaded tensor by tensor along a device map
(``checkpoint``), streamed to accelerators through pinned staging (``host_to_device``), and
single weights on disk and state dicts of offloaded models (``weight_files``)."""
