"""The Ray lane (``scripts/test-ray``): tests against a real Ray cluster on this machine.

A cluster (a head and more nodes, each its own ``ray start --block``, see ``tests/ray_cluster.py``)
costs about 20 s to start and a few hundred MB while it runs, so these tests run only when
``NBACCEL_RAY_LANE=1`` (the lane script sets it) or, for the ``gpu``-marked ones, in the GPU lane
on a CUDA machine. The default suite runs Ray's cheap checks (``tests/unit/test_ray_options.py``,
``tests/ranks/test_ray_extra.py``).
"""

from __future__ import annotations

import os

import pytest

# Ray turns token authentication on for `ray start` nodes when ~/.ray/auth_token exists (a local
# `ray.init()` writes one, the docs build's Ray notebook included), and the lane's clients were
# then refused ("Authentication token is missing or incorrect"). The lane's clusters are private
# to this machine: one setting for its nodes, its clients and its kernels keeps them agreeing.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NBACCEL_RAY_LANE") == "1":
        return
    import torch

    skip = pytest.mark.skip(
        reason="a real Ray cluster on this machine: run the Ray lane, scripts/test-ray"
    )
    for item in items:
        if "tests/ray/" not in str(item.fspath).replace(os.sep, "/"):
            continue
        if item.get_closest_marker("gpu") is not None and torch.cuda.is_available():
            continue
        item.add_marker(skip)
