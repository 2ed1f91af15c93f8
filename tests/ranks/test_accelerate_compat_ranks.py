"""Code written for Hugging Face Accelerate runs with ``accelerate`` replaced by ``nbaccel``.

The user functions below follow the examples of Accelerate's documentation (quick tour,
logging, big-model inference, tracking, utilities reference) with the import lines exactly as
users write them and the word swapped literally. They run for real: 2 gloo ranks through
``nbaccel.testing.run_on_ranks``, real files for offload and checkpoints.

The first half checks the façade itself: every path of the alias table imports, every name it
lists resolves to the object of nbaccel's own tree, and the table holds no implementation.

This file holds the checks that start ranks; the others are in
tests/unit/test_accelerate_compat.py."""

from __future__ import annotations

import logging

import torch

from nbaccel.testing import run_on_ranks


# -- scripts on 2 gloo ranks --------------------------------------------------------------------
def _logging_script():
    """Docs, "Logging with Accelerate": main-process logs, all-process logs, in-order logs."""
    from nbaccel import Accelerator
    from nbaccel.logging import get_logger

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = get_logger("compat.user", log_level="INFO")
    logger.logger.addHandler(Keep())
    accelerator = Accelerator(cpu=True)
    logger.info("main only")
    logger.info("every rank", main_process_only=False)
    logger.info("in order", main_process_only=False, in_order=True)
    logger.warning_once("once")
    logger.warning_once("once")
    accelerator.wait_for_everyone()
    return records


def test_get_logger_on_two_ranks():
    rank0, rank1 = run_on_ranks(_logging_script, timeout=120)
    assert rank0 == [
        "[RANK 0] main only",
        "[RANK 0] every rank",
        "[RANK 0] in order",
        "[RANK 0] once",
    ]
    assert rank1 == ["[RANK 1] every rank", "[RANK 1] in order"]


def _quicktour_script():
    """Docs, "Quicktour": prepare, backward, gather_for_metrics, save; with utils imports."""
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator
    from nbaccel.utils import set_seed, tqdm, wait_for_everyone

    set_seed(42)
    x = torch.randn(64, 1)
    dataset = TensorDataset(x, 3 * x + 2)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataloader = DataLoader(dataset, batch_size=8, shuffle=True)
    accelerator = Accelerator(cpu=True)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    losses = []
    for _epoch in range(3):
        for inputs, targets in tqdm(dataloader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():  # the docs' evaluation loop
        predictions = accelerator.gather_for_metrics(model(x[:6]))
    wait_for_everyone()
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    return {"first": losses[0], "last": losses[-1], "n": len(predictions), "w": weights}


def test_quicktour_training_on_two_ranks():
    rank0, rank1 = run_on_ranks(_quicktour_script, timeout=150)
    assert rank0["last"] < rank0["first"] / 4
    assert torch.equal(rank0["w"], rank1["w"])  # DDP kept the replicas identical
    assert rank0["n"] == rank1["n"] == 12  # 6 rows from each of the 2 ranks


def _operations_script():
    """Utilities reference: copy_tensor_to_devices, gather of a tensor that requires grad,
    verify_operation's shape check in debug mode, main-process-only tqdm."""
    from nbaccel import PartialState
    from nbaccel.utils import (
        DistributedOperationException,
        copy_tensor_to_devices,
        patch_environment,
        tqdm,
    )
    from nbaccel.utils.operations import gather, verify_operation

    state = PartialState(cpu=True)
    sent = copy_tensor_to_devices(torch.arange(4.0).view(2, 2) if state.is_main_process else None)
    bar = tqdm(range(3))

    @verify_operation
    def check(tensor):
        return gather(tensor)

    with patch_environment(ACCELERATE_DEBUG_MODE="1"):
        try:
            check(torch.ones(state.process_index + 1))
            error = None
        except DistributedOperationException as exc:
            error = str(exc)
    return {"sent": sent, "bar_disabled": bar.disable, "error": error}


def test_operations_on_two_ranks():
    rank0, rank1 = run_on_ranks(_operations_script, timeout=120)
    assert torch.equal(rank0["sent"], torch.arange(4.0).view(2, 2))
    assert torch.equal(rank1["sent"], rank0["sent"])
    assert rank0["bar_disabled"] is False and rank1["bar_disabled"] is True
    for rank in (rank0, rank1):
        assert "Process 0: [1]" in rank["error"] and "Process 1: [2]" in rank["error"]


def _custom_tracker_script(logging_dir):
    """Docs, "Experiment trackers": a custom GeneralTracker registered by name."""
    from nbaccel import Accelerator
    from nbaccel.tracking import (
        LOGGER_TYPE_TO_CLASS,
        GeneralTracker,
        on_main_process,
        register_tracker_class,
    )

    @register_tracker_class
    class ListTracker(GeneralTracker):
        name = "compat_list"
        requires_logging_directory = False

        def __init__(self, run_name="run", **kwargs):
            super().__init__()
            self.logged = []

        @property
        def tracker(self):
            return self.logged

        @on_main_process
        def log(self, values, step=None, **kwargs):
            self.logged.append((step, values))

    accelerator = Accelerator(cpu=True, log_with="compat_list", project_dir=logging_dir)
    accelerator.init_trackers("compat")
    accelerator.log({"loss": 1.0}, step=0)
    tracker = accelerator.get_tracker("compat_list", unwrap=True)
    accelerator.end_training()
    return {
        "registered": LOGGER_TYPE_TO_CLASS["compat_list"].__name__,
        "logged": list(tracker) if isinstance(tracker, list) else [],
    }


def test_custom_tracker_registered_by_name(tmp_path):
    rank0, rank1 = run_on_ranks(_custom_tracker_script, args=(str(tmp_path),), timeout=120)
    assert rank0["registered"] == rank1["registered"] == "ListTracker"
    assert rank0["logged"] == [(0, {"loss": 1.0})] and rank1["logged"] == []
