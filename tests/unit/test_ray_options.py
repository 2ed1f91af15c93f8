"""The Ray launcher's options and refusals that need no cluster (the default suite); the real
cluster tests are the Ray lane's (``tests/ray/``, ``scripts/test-ray``)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from nbaccel.launch.request import Fronts, LaunchRequest


def test_ray_options_are_checked_when_the_request_is_made():
    request = LaunchRequest(
        launcher="ray", num_processes=4, ray_resources="GPU=1,CPU=4,memory=1e9",
        ray_placement="Spread", ray_keep_warm=0,
    )  # fmt: skip
    ray = request.remote.ray
    assert ray.resources == {"GPU": 1.0, "CPU": 4.0, "memory": 1e9}
    assert (ray.placement, ray.strategy, ray.keep_warm, ray.gpus) == ("spread", "SPREAD", 0.0, 1.0)
    assert request.remote.layout is None  # placed by Ray when the plan is made
    assert LaunchRequest(launcher="ray").remote.ray.resources == {"CPU": 1.0}


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"ray_placement": "diagonal"}, "Unknown ray_placement 'diagonal'; choose one of pack"),
        ({"ray_resources": "GPU"}, "entry 'GPU' is not NAME=AMOUNT"),
        ({"ray_resources": {"GPU": -1}}, "ray_resources['GPU'] must be a non-negative number"),
        ({"ray_resources": {"GPU": 1.5}}, "a fraction of one GPU or a whole number"),
        ({"ray_keep_warm": -1}, "ray_keep_warm must be a number of seconds >= 0"),
        ({"hosts": "a:2"}, "launcher='ray' runs on the Ray cluster's nodes"),
        ({"ray_address": ""}, "ray_address must be the cluster's address"),
    ],
)
def test_bad_ray_options_are_refused_with_the_fix(given, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        LaunchRequest(launcher="ray", **given)


def test_ray_options_without_the_ray_launcher_say_so():
    with pytest.raises(ValueError, match="apply to launcher='ray' only"):
        LaunchRequest(launcher="ssh", hosts="a:1", ray_placement="spread")
    with pytest.raises(ValueError, match=r"ray_address applies only to a launch over hosts"):
        LaunchRequest(ray_address="auto")


def test_every_front_takes_the_ray_options():
    for front in (Fronts.LAUNCHER, Fronts.MAGIC, Fronts.CLI):
        names = set(LaunchRequest.options(front))
        assert {"ray_address", "ray_resources", "ray_placement", "ray_keep_warm"} <= names
    flags, _ = LaunchRequest.arguments(Fronts.MAGIC)["ray_address"]
    assert "--ray_address" in flags


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
        "from nbaccel.launch.plan import Front, LaunchPlan\n"
        "from nbaccel.launch.request import LaunchRequest\n"
        "try:\n"
        "    LaunchPlan.create(Front.NOTEBOOK, LaunchRequest(launcher='ray', num_processes=2))\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED launcher='ray' needs a Ray cluster: pass ray_address=" in done.stdout
