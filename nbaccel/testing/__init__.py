"""Helpers for testing code built on nbaccel: :func:`run_on_ranks` (a test function on N real
processes, every rank's failure reported: ``ranks``), and for running tests written for
Accelerate's ``accelerate.test_utils`` (reachable as ``nbaccel.test_utils``): skip markers by
device and package (``markers``), test-case bases that reset the distributed state (``cases``),
subprocess launch helpers (``subprocesses``), the tiny regression model and dataset the examples
use (``regression``) and Accelerate's test scripts (``scripts``)."""

from nbaccel.testing.ranks import RankFailures, free_port, run_on_ranks

__all__ = ["RankFailures", "free_port", "run_on_ranks"]
