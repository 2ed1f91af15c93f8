"""Helpers for testing code built on nbaccel (and for running tests written for Accelerate's
``accelerate.test_utils``, reachable as ``nbaccel.test_utils``): skip markers by device and
package, test-case bases that reset the distributed state, subprocess launch helpers, and the
tiny regression model and dataset the examples use. Multi-rank tests use
:func:`nbaccel.testing.run_on_ranks`."""
