"""Fixtures shared by the rank tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def pool():
    """A fresh in-process pool of 2 real ranks, shut down after the test."""
    from nbaccel.launch.driver.renderer import Renderer
    from nbaccel.notebook.kernel import pool as pool_module

    pool = pool_module.start_pool(num_processes=2, renderer=Renderer())
    yield pool
    pool_module.shutdown_pool()
    pool.shutdown()
