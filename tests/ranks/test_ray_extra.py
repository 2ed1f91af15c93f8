"""Ray's optional extra, checked in fresh interpreters: ``import nbaccel`` imports nothing of
Ray, a missing Ray names ``pip install nbaccel[ray]``, a Ray launch with no cluster named says
how to name one (all before anything starts; the real cluster tests are the Ray lane's)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ
    )


def test_nbaccel_imports_no_ray_and_a_missing_ray_names_the_extra():
    done = _python(
        "import sys\n"
        "import nbaccel\n"
        "from nbaccel.launch.registry import LAUNCHERS\n"
        "assert 'ray' in LAUNCHERS and 'ray' not in sys.modules, 'ray imported'\n"
        "sys.modules['ray'] = None  # as if Ray were not installed\n"
        "try:\n"
        "    nbaccel.notebook_launcher(print, num_processes=2, launcher='ray',\n"
        "                              ray_address='127.0.0.1:1')\n"
        "except ImportError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED launcher='ray' needs Ray" in done.stdout
    assert "pip install nbaccel[ray]" in done.stdout


def test_a_ray_launch_without_a_cluster_says_how_to_name_one():
    pytest.importorskip("ray")
    done = _python(
        "from nbaccel.launch.plan import LaunchPlan\n"
        "from nbaccel.launch.request import Front, LaunchRequest\n"
        "try:\n"
        "    LaunchPlan.create(Front.LAUNCHER, LaunchRequest(launcher='ray', num_processes=2))\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED launcher='ray' needs a Ray cluster: pass ray_address=" in done.stdout


def test_a_cluster_address_where_nothing_listens_is_refused_naming_it():
    """Refused at once (a probe of the address), not after Ray's minutes of connection
    retries; Ray is left unconnected."""
    pytest.importorskip("ray")
    done = _python(
        "import socket, ray\n"
        "from nbaccel import notebook_launcher\n"
        "with socket.socket() as s:\n"
        "    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
        "try:\n"
        "    notebook_launcher(print, num_processes=2, launcher='ray',\n"
        "                      ray_address=f'127.0.0.1:{port}')\n"
        "except ConnectionError as exc:\n"
        "    print('REFUSED', port, exc)\n"
        "print('CONNECTED', ray.is_initialized())\n"
    )
    assert done.returncode == 0, done.stderr
    refused = done.stdout.split("REFUSED ", 1)[1]
    port = refused.split()[0]
    assert f"a Ray cluster's GCS at 127.0.0.1:{port} is not there: nothing listens" in refused
    assert "CONNECTED False" in done.stdout
