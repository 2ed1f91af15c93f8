"""transformers' ``Trainer`` on 2 ssh hosts x 1 rank, bf16 asked of the launch (the hosts lane,
``sudo bash scripts/test-hosts``): each rank sees Accelerate's ``ACCELERATE_MIXED_PRECISION``,
the Trainer's own Accelerate ``Accelerator`` runs bf16 on a world of 2 CPU ranks, and the losses
are those of ``accelerate launch`` running the same function on this machine."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from _hf_reference import accelerate_records, records, same_training
from kernel import cell_errors, cell_text
from kernel import run_notebook as _run_notebook
from test_remote_hosts import NO_WARMUP, clean_hosts, shared_tmp  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

TESTS = str(Path(__file__).resolve().parents[1])  # _hf_trainer: importable in the kernel

_LAUNCH = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import _hf_trainer
    from nbaccel import notebook_launcher

    notebook_launcher(_hf_trainer.train, ({prefix!r}, "plain"), num_processes=2,
                      hosts=["nbh1:1", "nbh2:1"], python=sys.executable, mixed_precision="bf16")
    """
)


def test_the_trainer_on_two_hosts_trains_bf16_as_accelerate_launch_does(
    clean_hosts,  # noqa: F811
    shared_tmp,  # noqa: F811
):
    reference = shared_tmp / "accelerate"
    reference.mkdir()
    theirs = accelerate_records(reference)  # this machine, Accelerate's own launcher
    prefix = shared_tmp / "hosts"
    nb = _run_notebook([_LAUNCH.format(tests=TESTS, prefix=str(prefix))], timeout=400,
                       env=NO_WARMUP, shutdown=True)  # fmt: skip
    text = cell_text(nb.cells[0])
    assert not cell_errors(nb.cells[0]), text
    assert "on 2 hosts (nbh1:1, nbh2:1) over ssh" in text, text
    ours = records(prefix)
    assert [rank["host"] for rank in ours] == ["nbh1", "nbh2"]
    for rank in ours:
        assert rank["environ"]["ACCELERATE_MIXED_PRECISION"] == "bf16", rank["environ"]
    same_training(theirs, ours, "bf16")
