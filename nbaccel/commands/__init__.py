"""Subcommands of the ``nbaccel`` command line, one module each (see :mod:`nbaccel.cli`)."""
