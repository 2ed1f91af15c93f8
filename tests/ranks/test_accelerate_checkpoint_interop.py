"""Checkpoints across the two libraries: nbaccel resumes what Accelerate's ``save_state`` wrote,
and Accelerate resumes what nbaccel's wrote.

- A tiny folder in Accelerate's layout (``tests/fixtures/accelerate_checkpoint``, written by
  :func:`write_accelerate_layout` below:
  ``python tests/ranks/test_accelerate_checkpoint_interop.py`` writes it again) loads into
  nbaccel without accelerate installed.
- With accelerate installed, both directions on 2 real ranks: weights, optimizer, scheduler,
  registered object, every generator of every rank, the step and a stateful loader's position.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from nbaccel.testing import run_on_ranks

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "accelerate_checkpoint"


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self, count: int = 0):
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def write_accelerate_layout(folder: Path) -> None:
    """The files Accelerate's ``save_state`` writes for one process, one model, one optimizer,
    one scheduler and one registered object, at step 5."""
    import numpy as np
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model, optimizer, scheduler = _objects()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    torch.save(scheduler.state_dict(), folder / "scheduler.bin")
    torch.save(Counter(7).state_dict(), folder / "custom_checkpoint_0.pkl")
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    states = {
        "step": 5,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(states, folder / "random_states_0.pkl")


def _draws() -> tuple[float, float, float]:
    import numpy as np

    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_nbaccel_loads_a_folder_in_accelerates_layout():
    import numpy as np

    from nbaccel import Accelerator

    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(*_objects())
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.load_state(str(FIXTURE))
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    expected = _draws()
    accelerator.load_state(str(FIXTURE))
    assert _draws() == expected
    assert accelerator.step == 5 and counter.count == 7
    assert scheduler.state_dict()["last_epoch"] == 1
    assert optimizer.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0
    reference, _, _ = _objects()
    assert not torch.equal(model.weight, reference.weight)  # the trained weights came back


def test_a_folder_in_accelerates_layout_missing_a_file_is_named(tmp_path):
    import shutil

    from nbaccel import Accelerator

    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, folder)
    (folder / "optimizer.bin").unlink()
    accelerator = Accelerator()
    accelerator.prepare(*_objects())
    with pytest.raises(FileNotFoundError, match=r"Accelerate's layout\) lacks \['optimizer.bin'\]"):
        accelerator.load_state(str(folder))


# -- both directions with the real accelerate ---------------------------------------------------
def _train_and_save(library: str, folder: str) -> dict:
    """Train two steps, save mid-epoch, report what the loader must resume with."""
    import importlib

    from torch.utils.data import DataLoader, TensorDataset

    lib = importlib.import_module(library)
    utils = importlib.import_module(f"{library}.utils")
    config = utils.DataLoaderConfiguration(use_stateful_dataloader=True)
    kwargs = {"cpu": True} if library == "accelerate" else {}
    accelerator = lib.Accelerator(dataloader_config=config, **kwargs)
    utils.set_seed(11)
    data = torch.arange(32.0).reshape(16, 2)
    dl = DataLoader(TensorDataset(data), batch_size=2, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler, dl = accelerator.prepare(model, optimizer, scheduler, dl)
    counter = Counter(3 + accelerator.process_index)
    accelerator.register_for_checkpointing(counter)
    batches = iter(dl)
    for _ in range(2):
        with accelerator.accumulate(model):
            (xb,) = next(batches)
            accelerator.backward(model(xb).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state(folder)
    return {
        "draws": _draws(),
        "next_batch": next(batches)[0].tolist(),
        "weight": accelerator.unwrap_model(model)[0].weight.detach().clone(),
        "momentum": next(iter(optimizer.state_dict()["state"].values()))["momentum_buffer"],
        "last_epoch": scheduler.state_dict()["last_epoch"],
        "step": accelerator.step,
    }


def _load_and_report(library: str, folder: str) -> dict:
    import importlib

    from torch.utils.data import DataLoader, TensorDataset

    lib = importlib.import_module(library)
    utils = importlib.import_module(f"{library}.utils")
    config = utils.DataLoaderConfiguration(use_stateful_dataloader=True)
    kwargs = {"cpu": True} if library == "accelerate" else {}
    accelerator = lib.Accelerator(dataloader_config=config, **kwargs)
    utils.set_seed(11)  # as the saving run did: the loader's shuffling starts alike
    data = torch.arange(32.0).reshape(16, 2)
    dl = DataLoader(TensorDataset(data), batch_size=2, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler, dl = accelerator.prepare(model, optimizer, scheduler, dl)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    _draws()  # generators moved on: only the checkpoint gives the saved draws back
    accelerator.load_state(folder)
    return {
        "draws": _draws(),
        "next_batch": next(iter(dl))[0].tolist(),
        "weight": accelerator.unwrap_model(model)[0].weight.detach().clone(),
        "momentum": next(iter(optimizer.state_dict()["state"].values()))["momentum_buffer"],
        "last_epoch": scheduler.state_dict()["last_epoch"],
        "step": accelerator.step,
        "counter": counter.count,
    }


@pytest.mark.parametrize(
    ("saver", "loader"), [("accelerate", "nbaccel"), ("nbaccel", "accelerate")]
)
def test_one_library_resumes_what_the_other_saved(tmp_path, saver, loader):
    pytest.importorskip("accelerate", reason="the comparison needs accelerate (the bench extra)")
    folder = str(tmp_path / "ckpt")
    saved = run_on_ranks(_train_and_save, args=(saver, folder), timeout=150)
    loaded = run_on_ranks(_load_and_report, args=(loader, folder), timeout=150)
    for rank, (before, after) in enumerate(zip(saved, loaded)):
        assert after["draws"] == before["draws"], f"rank {rank}: generators not restored"
        assert after["next_batch"] == before["next_batch"], f"rank {rank}: loader position"
        assert torch.equal(after["weight"], before["weight"])
        assert torch.equal(after["momentum"], before["momentum"])
        assert after["last_epoch"] == before["last_epoch"] > 0
        assert after["step"] == before["step"]
        assert after["counter"] == 3  # rank 0's object, saved once


if __name__ == "__main__":  # writes the checked-in fixture again
    write_accelerate_layout(FIXTURE)
    sys.exit(0)
