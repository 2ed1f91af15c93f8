"""Imported first by ``nbaccel/__init__.py``: in a Jupyter kernel, start the fork server now,
with the libraries the kernel imported already, and watch what it imports next
(``notebook.kernel.preload_hook``), so that ranks start with them.

The server's ``import torch`` then runs on the other core while the kernel imports torch for
nbaccel itself, so the first launch does not wait for it; and the kernel will exit as fast as a
plain one despite torch (``notebook.kernel.quick_exit``). Only the standard library is imported
here; outside a kernel (scripts, workers, tests) nothing happens.
"""

import os
import sys

from nbaccel.launch.launchers.forkserver.kernel_modules import in_kernel
from nbaccel.launch.launchers.forkserver.launcher import warm_up_if_in_kernel
from nbaccel.notebook.kernel.preload_hook import install
from nbaccel.notebook.kernel.quick_exit import exit_quickly
from nbaccel.notebook.preload import WORKER_PRELOAD

warm_up_if_in_kernel(WORKER_PRELOAD)
if in_kernel():
    install()
if "ipykernel" in sys.modules and not os.environ.get("NBACCEL_LAUNCHER"):
    exit_quickly()
