"""The Ray launcher's options and refusals that need no cluster (the default suite). The checks
in fresh interpreters are in ``tests/ranks/test_ray_extra.py``; the real cluster tests are the
Ray lane's (``tests/ray/``, ``scripts/test-ray``)."""

from __future__ import annotations

import re

import pytest

from nbaccel.launch.request import Front, LaunchRequest


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
    for front in (Front.LAUNCHER, Front.MAGIC, Front.CLI):
        names = set(LaunchRequest.options(front))
        assert {"ray_address", "ray_resources", "ray_placement", "ray_keep_warm"} <= names
    flags, _ = LaunchRequest.arguments(Front.MAGIC)["ray_address"]
    assert "--ray_address" in flags
