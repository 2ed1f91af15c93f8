"""Accelerator/state behaviour code written for Accelerate relies on (each test names what
Accelerate documents): the device variable, flags on prepared objects, idempotent preparation,
a skipped optimizer step holding the scheduler, the reset-state error, dynamo kwargs."""

import pytest
import torch
from torch.utils.data import DataLoader

from nbaccel.distributed.environment_patch import patch_environment
from nbaccel.distributed.state import AcceleratorState, PartialState
from nbaccel.testing import run_on_ranks


@pytest.fixture(autouse=True)
def _fresh_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_torch_device_variable_picks_the_device():
    from nbaccel import Accelerator

    # ACCELERATE_TORCH_DEVICE (or NBACCEL_TORCH_DEVICE) overrides the default device.
    with patch_environment(ACCELERATE_TORCH_DEVICE="cpu:3"):
        assert str(Accelerator().device) == "cpu:3"
    AcceleratorState._reset_state(True)
    with patch_environment(NBACCEL_TORCH_DEVICE="gpu:x"), pytest.raises(ValueError, match="cuda:1"):
        PartialState()


def test_prepare_flags_objects_and_is_idempotent():
    from nbaccel import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(list(range(4)), batch_size=2)
    other = [1, 2]
    prepared = accelerator.prepare(model, optimizer, scheduler, loader, other)
    for obj in prepared[:4]:
        assert obj._is_nbaccel_prepared is True and obj._is_accelerate_prepared is True
    assert prepared[4] is other and not hasattr(other, "_is_nbaccel_prepared")
    # A prepared model is returned as it is and not tracked twice.
    assert accelerator.prepare_model(prepared[0]) is prepared[0]
    assert len(accelerator._models) == 1
    # base_dataloader: the prepared loader itself (an instance field, not a class one).
    assert prepared[3].base_dataloader is prepared[3]
    with pytest.raises(AttributeError):
        type(prepared[3]).base_dataloader  # noqa: B018


def test_quantized_model_with_offload_is_refused():
    from nbaccel import Accelerator

    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit = True
    model.hf_device_map = {"": "cpu"}
    with pytest.raises(ValueError, match="CPU or disk offload"):
        Accelerator().prepare_model(model)


def test_reset_state_explains_the_missing_field():
    state = PartialState()
    with pytest.raises(AttributeError, match="'PartialState' object has no attribute 'other'"):
        state.other  # noqa: B018
    PartialState._reset_state()
    with pytest.raises(AttributeError, match=r"This happens if `PartialState._reset_state\(\)`"):
        state.num_processes  # noqa: B018
    state.custom = 1  # ordinary attributes still work
    assert state.custom == 1


def _skipped_step_holds_lambda_lr():
    from nbaccel import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    optimizer._is_overflow = False
    scheduler.step()
    first = scheduler.get_last_lr()[0]
    optimizer._is_overflow = True  # what a skipped (fp16 overflow) step leaves
    assert optimizer.step_was_skipped
    scheduler.step()
    return first, scheduler.get_last_lr()[0]


def test_skipped_optimizer_step_holds_the_scheduler_on_2_ranks():
    # Accelerate: one prepared-scheduler step on 2 processes advances LambdaLR by 2; a step
    # after a skipped optimizer step does not advance it.
    assert run_on_ranks(_skipped_step_holds_lambda_lr, 2) == [(0.8, 0.8), (0.8, 0.8)]


def test_dynamo_plugin_kwargs_are_the_non_defaults():
    from nbaccel.utils import TorchDynamoPlugin

    with patch_environment(
        ACCELERATE_DYNAMO_BACKEND="inductor", ACCELERATE_DYNAMO_MODE="max-autotune"
    ):
        assert TorchDynamoPlugin().to_kwargs() == {"backend": "inductor", "mode": "max-autotune"}
    assert TorchDynamoPlugin().to_kwargs() == {}
    assert TorchDynamoPlugin(fullgraph=True).to_kwargs() == {"fullgraph": True}
