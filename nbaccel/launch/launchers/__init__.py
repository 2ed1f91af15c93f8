"""Launcher variants that start ranks on this machine, behind one small interface
(:class:`~nbaccel.launch.launchers.base.ProcessLauncher`): ``forkserver`` (the default on
Linux/macOS), ``spawn``, ``fork`` and ``xla``. The variants that start ranks on other hosts live
in :mod:`nbaccel.launch.remote`; :mod:`nbaccel.launch.registry` maps every kind to its class.
"""
