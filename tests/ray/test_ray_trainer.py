"""transformers' ``Trainer`` on 2 Ray nodes x 1 rank, bf16 asked of the launch (the Ray lane):
each rank sees Accelerate's ``ACCELERATE_MIXED_PRECISION``, the Trainer's own Accelerate
``Accelerator`` runs bf16 on a world of 2 CPU ranks, and the losses are those of ``accelerate
launch`` running the same function on this machine."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from _hf_reference import accelerate_records, records, same_training
from kernel import cell_errors, cell_text, run_notebook
from ray_cluster import RayCluster

pytestmark = pytest.mark.timeout(600)

TESTS = str(Path(__file__).resolve().parents[1])  # _hf_trainer: importable in the kernel

_LAUNCH = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import _hf_trainer
    from nbaccel import notebook_launcher

    notebook_launcher(_hf_trainer.train, ({prefix!r}, "plain"), num_processes=2,
                      launcher="ray", ray_address={address!r}, ray_placement="strict_spread",
                      ray_keep_warm=0, mixed_precision="bf16")
    """
)


def test_the_trainer_on_two_ray_nodes_trains_bf16_as_accelerate_launch_does(tmp_path):
    reference = tmp_path / "accelerate"
    reference.mkdir()
    theirs = accelerate_records(reference)  # this machine, Accelerate's own launcher
    prefix = tmp_path / "ray"
    with RayCluster(cpus=(2, 2)) as cluster:
        cell = _LAUNCH.format(tests=TESTS, prefix=str(prefix), address=cluster.address)
        nb = run_notebook([cell], timeout=400, env={"NBACCEL_RENDERER": "text"}, shutdown=True)
    text = cell_text(nb.cells[0])
    assert not cell_errors(nb.cells[0]), text
    nodes = re.search(r"on 2 Ray nodes \((\S+):1, (\S+):1;", text)
    assert nodes and nodes.group(1) != nodes.group(2), text
    ours = records(prefix)
    for rank in ours:
        assert rank["environ"]["ACCELERATE_MIXED_PRECISION"] == "bf16", rank["environ"]
    same_training(theirs, ours, "bf16")
