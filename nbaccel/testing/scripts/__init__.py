"""Scripts that check a distributed setup end to end, each with a ``main()`` that runs on every
rank (through ``nbaccel launch``, ``debug_launcher`` or ``torchrun``) and raises on a wrong
result. Reachable as Accelerate's ``test_utils.scripts`` paths through :mod:`nbaccel.compat`."""

from nbaccel.testing.scripts import test_cli, test_ops, test_script, test_sync

__all__ = ["test_cli", "test_ops", "test_script", "test_sync"]
