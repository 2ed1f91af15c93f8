"""The torch-xla lane (``scripts/test-xla``): PJRT_DEVICE=CPU, torch 2.9 + torch-xla 2.9.

The launcher tests come first: torch-xla refuses to start processes once this process has used
the XLA device, and the Accelerator tests below do use it.
"""

import os
import signal

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")


# -- launcher: xmp-style processes, fork inheritance, signals ------------------------------------
def _where(model):
    import torch_xla.runtime as xr

    return xr.global_ordinal(), xr.world_size(), model.weight.data_ptr(), os.getpid()


def test_launch_xla_forks_shares_the_model_and_returns_results():
    from nbaccel.launch.run import launch_xla

    model = nn.Linear(256, 256)
    results = launch_xla(_where, (model,), num_processes=None, start_method="fork")
    assert [r[:2] for r in results] == [(0, 1)]
    ordinal, world, pointer, pid = results[0]
    assert pid != os.getpid()  # ran in a child process...
    assert pointer == model.weight.data_ptr()  # ...that inherited the model instead of a copy


def _collectives():
    import torch_xla.runtime as xr

    from nbaccel import broadcast, gather, gather_object, reduce
    from nbaccel.distributed.state import PartialState
    from nbaccel.training.strategies import xla

    state = PartialState()
    t = torch.tensor([2.0], device=xla.xla_device())
    return {
        "world": (state.num_processes, state.distributed_type.value, xr.world_size()),
        # torch-xla's collectives themselves (one replica: the XLA CPU backend deadlocks with two)
        "all_gather": xla.all_gather(t).cpu().tolist(),
        "all_reduce": xla.all_reduce_sum(t).cpu().tolist(),
        "broadcast_": xla.broadcast_(t.clone(), 0).cpu().tolist(),
        "exchange": xla.exchange_objects({"rank": 0}),
        # nbaccel.distributed.collectives on the XLA device
        "gather": gather(t).cpu().tolist(),
        "reduce": reduce(t, "sum").cpu().tolist(),
        "broadcast": broadcast(t.clone()).cpu().tolist(),
        "objects": gather_object([0]),
    }


def test_collectives_on_the_xla_device():
    from nbaccel.launch.run import launch_xla

    (r,) = launch_xla(_collectives, num_processes=None)
    assert r["world"] == (1, "XLA", 1)
    assert r["all_gather"] == r["all_reduce"] == r["broadcast_"] == [2.0]
    assert r["exchange"] == [{"rank": 0}]
    assert r["gather"] == r["reduce"] == r["broadcast"] == [2.0]
    assert r["objects"] == [0]


def _killed():
    os.kill(os.getpid(), signal.SIGKILL)


def _fails():
    raise ValueError("bad batch")


def test_launch_xla_names_a_killed_process_and_the_host_ram_hint():
    from nbaccel.launch.errors import RankCrashed
    from nbaccel.launch.run import launch_xla

    with pytest.raises(RankCrashed) as info:
        launch_xla(_killed, num_processes=None)
    assert "SIGKILL" in str(info.value) and "host RAM" in str(info.value)
    assert info.value.rank == 0
    with pytest.raises(ValueError, match=r"\[rank 0\] bad batch"):
        launch_xla(_fails, num_processes=None)


def test_notebook_launcher_takes_the_xla_path(monkeypatch):
    import nbaccel.notebook.kernel.launcher as launcher

    # On a real TPU host the launcher detects it; PJRT_DEVICE=CPU is deliberately not "a TPU",
    # so the lane asks for the XLA path explicitly.
    monkeypatch.setenv("NBACCEL_XLA_LAUNCH", "1")
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="devices"):
        results = launcher.notebook_launcher(_where, (model,))
    assert results[0][:3] == (0, 1, model.weight.data_ptr())


# -- the Accelerator on the XLA device (this process) ---------------------------------------------
def _data():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
    )


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _train(model, optimizer, loader, accelerator=None, clip=False):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        if accelerator is None:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            accelerator.backward(loss)
            if clip:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_accelerator_trains_on_the_xla_device():
    from nbaccel.distributed.state import DistributedType
    from nbaccel.training.accelerator import Accelerator
    from nbaccel.training.strategies.xla import XLADeviceLoader

    accelerator = Accelerator()
    assert accelerator.device.type == "xla"
    assert accelerator.distributed_type == DistributedType.XLA
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(_data(), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert isinstance(loader, XLADeviceLoader) and len(loader) == 4
    assert next(iter(loader))[0].device.type == "xla"
    _train(model, optimizer, loader, accelerator, clip=True)

    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    _train(reference, ref_opt, torch.utils.data.DataLoader(_data(), batch_size=8), clip=True)
    got = {k: v.cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5)


def test_bf16_autocast_on_xla():
    from nbaccel.training.accelerator import Accelerator
    from nbaccel.training.strategies.xla import autocast, configure_bf16

    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(_model())
    x = torch.randn(4, 8, device=accelerator.device)
    with accelerator.autocast():
        inner = model[0](x)
    assert inner.dtype == torch.bfloat16  # autocast reaches XLA tensors
    assert model(x).dtype == torch.float32  # prepared forward returns float32
    with autocast():
        assert model[0](x).dtype == torch.bfloat16
    assert configure_bf16("bf16", downcast_bf16=True) == {
        "XLA_DOWNCAST_BF16": "1",
        "XLA_USE_BF16": "0",
    }
    os.environ.pop("XLA_DOWNCAST_BF16")
    os.environ.pop("XLA_USE_BF16")


def test_colab_kaggle_tpu_notebook_runs_on_the_xla_path(monkeypatch):
    from pathlib import Path

    from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

    monkeypatch.setenv("NBACCEL_XLA_LAUNCH", "1")  # the kernel inherits it: take the XLA path
    path = Path(__file__).resolve().parents[1] / "notebooks" / "colab_kaggle_tpu.ipynb"
    nb = execute_notebook(path, timeout=600, allow_errors=False)
    text = "".join(output_text(o) for o in nb.cells[-1].outputs)
    assert "trained on xla" in text
    assert "('XLA', 'xla')" in text
