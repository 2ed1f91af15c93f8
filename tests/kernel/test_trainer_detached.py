"""A detached ``Trainer`` run from a real kernel: rank 1 is SIGKILLed after the Trainer's
checkpoint at step 4, ``run.resume()`` relaunches the same function, which continues from
``output_dir``'s last ``checkpoint-N`` (``get_last_checkpoint`` passed to
``resume_from_checkpoint``) and ends with the losses of an uninterrupted run; a second kernel
re-attaches and sees the bar, the metrics and the result. And Accelerate's launch contract holds
from a detached run: its ranks see the ``ACCELERATE_*`` variables an attached launch of the same
request gives (the hf lane, ``scripts/test-hf``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _hf_reference import hf_lane
from detached import runs_fixture  # noqa: F401 (the fixture `runs`)
from kernel import cell_errors, cell_text, run_notebook

from nbaccel import notebook_launcher
from nbaccel.launch.detached.folder import RunFolder, RunState
from nbaccel.launch.driver.renderer import Renderer

pytestmark = pytest.mark.timeout(900)

TESTS = str(Path(__file__).resolve().parents[1])  # _trainer, _llama: importable on the ranks


def _losses_after(history: list[dict], step: int) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in history if "loss" in e and e["step"] > step}


def test_a_killed_trainer_run_resumes_from_its_last_checkpoint(runs, tmp_path):
    from _trainer import train_tiny

    root, _, env = runs
    env = {**env, "PYTHONPATH": f"{TESTS}:{env['PYTHONPATH']}"}
    reference = notebook_launcher(
        train_tiny, (str(tmp_path / "reference"), 8, False, 4), num_processes=2, cpu=True,
        renderer=Renderer(), memory=False,
    )  # fmt: skip
    out, marker = tmp_path / "out", tmp_path / "killed-once"
    start = (
        "from nbaccel import notebook_launcher\n"
        "from _trainer import train_tiny\n"
        f"run = notebook_launcher(train_tiny, ({str(out)!r}, 8, False, 4, 4, {str(marker)!r}),\n"
        "                         num_processes=2, cpu=True, detach=True)\n"
        "info = run.wait(timeout=600)\n"
        "import os\n"
        f"print('CHECKPOINTS', sorted(os.listdir({str(out)!r})))\n"
        "print('RUN', run.id, info.state, '|', info.reason)"
    )
    resume = (
        "run.resume()\n"
        "results = run.result(timeout=600)\n"
        "print('RESUMED', [r['resumed_from'] for r in results], run.info.attempts)"
    )
    first = run_notebook([start, resume], timeout=600, env=env, shutdown=True)
    text = cell_text(first.cells[0])
    found = re.search(r"RUN (\S+) (\S+) \| (.*)", text)
    assert found, text
    run_id, state, reason = found.groups()
    assert state == RunState.FAILED and "SIGKILL" in reason and "rank 1" in reason, text
    assert "CHECKPOINTS ['checkpoint-4']" in text  # what the killed attempt left
    assert not cell_errors(first.cells[1]), cell_text(first.cells[1])
    assert "RESUMED ['checkpoint-4', 'checkpoint-4'] 2" in cell_text(first.cells[1])

    attach = (
        "import nbaccel\n"
        f"run = nbaccel.attach({run_id!r})\n"
        "results = run.result()\n"
        "print('FINAL', results[0]['log_history'])"
    )
    second = run_notebook([attach], timeout=600, env=env, shutdown=True)
    cell = second.cells[0]
    assert not cell_errors(cell), cell_text(cell)
    shown = cell_text(cell)
    assert "8/8" in shown  # the Trainer's bar, exact at the end (the view's summary)
    assert "Trainer: " in shown and "loss=" in shown  # the metrics plot's static twin
    history = eval(re.search(r"FINAL (\[.*\])", shown).group(1))
    resumed, uninterrupted = (
        _losses_after(history, 4),
        _losses_after(reference[0]["log_history"], 4),
    )
    assert sorted(resumed) == [6, 8]
    for step, loss in uninterrupted.items():
        assert abs(resumed[step] - loss) < 1e-4, (step, resumed[step], loss)
    assert RunFolder(root / run_id).info().state == RunState.FINISHED


@hf_lane
def test_a_detached_trainer_rank_sees_the_contract_an_attached_launch_gives(
    runs, tmp_path, monkeypatch
):
    """``notebook_launcher(train, detach=True, mixed_precision="bf16")``: its ranks, started by
    the supervisor, see the ``ACCELERATE_*`` variables the same launch attached gives them, and
    the Trainer's Accelerate ``Accelerator`` runs bf16 with the same losses."""
    import _hf_trainer

    _, _, env = runs
    attached = notebook_launcher(
        _hf_trainer.train, (str(tmp_path / "attached"), "plain"), num_processes=2,
        mixed_precision="bf16", renderer=Renderer(), memory=False,
    )  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = notebook_launcher(
        _hf_trainer.train, (str(tmp_path / "detached"), "plain"), num_processes=2,
        mixed_precision="bf16", detach=True,
    )  # fmt: skip
    detached = run.result(timeout=600)
    assert len(detached) == len(attached) == 2
    for ours, theirs in zip(detached, attached, strict=True):
        assert ours["environ"] == theirs["environ"], (ours["environ"], theirs["environ"])
        assert ours["environ"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
        trained, reference = ours["plain"], theirs["plain"]
        assert trained["mixed_precision"] == reference["mixed_precision"] == "bf16"
        assert trained["distributed_type"] == "DistributedType.MULTI_CPU"
        assert trained["num_processes"] == 2
        assert trained["losses"] == pytest.approx(reference["losses"], abs=1e-4)
