"""The torch-xla lane (``scripts/test-xla``): PJRT_DEVICE=CPU, torch 2.9 + torch-xla 2.9, with
CPU_NUM_DEVICES devices (the lane sets 8, a v5e-8's count).

On PJRT's CPU device torch-xla runs one process with one thread per device (it starts no more
processes on a CPU host), so "ranks" here are the devices of one forked process. Its collectives
between those threads deadlock on the CPU (each thread's graph gets its own collective op id), so
the collectives test runs on one device. The launcher tests come first: torch-xla refuses to
start processes once this process has used the XLA device, and the Accelerator tests below do.
"""

import os
import signal

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
DEVICES = int(os.environ.get("CPU_NUM_DEVICES", "1"))


def _runtime_initialised_here() -> bool:
    return torch_xla._XLAC._xla_runtime_is_initialized()


# -- launcher: xmp-style processes, fork inheritance, signals ------------------------------------
def _where(model):
    import torch_xla.runtime as xr

    return xr.global_ordinal(), xr.world_size(), model.weight.data_ptr(), os.getpid()


def test_launch_xla_forks_shares_the_model_and_returns_results():
    from nbaccel.launch.run import launch_xla

    model = nn.Linear(256, 256)
    results = launch_xla(_where, (model,), num_processes=None, start_method="fork")
    assert [r[:2] for r in results] == [(i, DEVICES) for i in range(DEVICES)]
    pids = {r[3] for r in results}
    assert len(pids) == 1 and os.getpid() not in pids  # one forked child, a thread per device...
    assert {r[2] for r in results} == {model.weight.data_ptr()}  # ...that inherited the model
    assert not _runtime_initialised_here()  # the kernel (this process) never started XLA


def test_default_is_every_local_device_and_the_fork_server_never_loads_xla():
    from nbaccel.launch.launchers.forkserver.launcher import get_forkserver
    from nbaccel.launch.plan import default_num_processes
    from nbaccel.launch.request import Front

    assert default_num_processes(Front.LAUNCHER, xla=True) == DEVICES
    server = get_forkserver()
    server.wait_ready()
    with open(f"/proc/{server.pid}/maps") as maps:
        loaded = maps.read()
    assert "libtorch" in loaded  # torch is preloaded there...
    assert "_XLAC" not in loaded and "torch_xla" not in loaded  # ...torch-xla never is
    assert not _runtime_initialised_here()


def _compile_and_count(size):
    import torch_xla.debug.metrics as met

    x = torch.ones(size, size, device=torch_xla.device())
    value = float((x @ x + 1).sum().cpu())
    compiled = met.metric_data("CompileTime")
    return {
        "value": value,
        "miss": met.counter_value("PersistentCacheMiss") or 0,
        "hit": met.counter_value("PersistentCacheHit") or 0,
        "found_unloadable": met.counter_value("PersistentCacheDeserializeFailure") or 0,
        "compiles": compiled[0] if compiled else 0,
    }


def test_compile_cache_persists_across_launches(tmp_path, monkeypatch):
    """The second launch (a fresh process) finds the first one's compiled graph on disk. On a
    backend that loads it (TPU) nothing compiles; PJRT's CPU client cannot deserialise an
    executable (UNIMPLEMENTED in torch-xla 2.9), so here it finds the entry and recompiles."""
    from nbaccel.launch.run import launch_xla

    monkeypatch.setenv("NBACCEL_XLA_CACHE", str(tmp_path / "cache"))
    first = launch_xla(_compile_and_count, (48,))[0]  # metrics are per process: all devices
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert first["miss"] >= 1 and first["hit"] == 0 and len(entries) >= 1  # compiled, written
    second = launch_xla(_compile_and_count, (48,))[0]  # a fresh process, same function
    assert second["value"] == first["value"] == 48 * 48 * 49
    assert second["hit"] + second["found_unloadable"] >= 1  # the first launch's graph, found
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries  # nothing new
    if second["hit"]:  # the backend loads compiled executables: no compile at all
        assert second["compiles"] == 0 and second["miss"] == 0
    else:
        assert second["found_unloadable"] >= 1


def _touch_nothing(model):
    return model.weight.shape[0]


def test_host_ram_estimate_warns_before_ranks_materialise_a_meta_model():
    from nbaccel.launch.host.host_ram import HostRamWarning
    from nbaccel.launch.run import launch_xla

    with torch.device("meta"):
        huge = nn.Linear(1 << 19, 1 << 19, bias=False)  # 1 TiB of float32 that each rank builds
    with pytest.warns(HostRamWarning, match=rf"{DEVICES} ranks each materialising 1024.0 GiB"):
        results = launch_xla(_touch_nothing, (huge,))
    assert results == [1 << 19] * DEVICES  # a warning, not a refusal


def _kernel_env(devices: int) -> dict:
    return {"NBACCEL_XLA_LAUNCH": "1", "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}


def test_an_xla_runtime_initialised_in_the_kernel_is_refused_with_the_fix():
    from kernel import cell_errors, cell_text, run_notebook

    cells = [
        "import os, torch, torch_xla\nfrom nbaccel import notebook_launcher",
        "x = torch.ones(2, device=torch_xla.device()) * 2\nprint(x.cpu().tolist())",
        "notebook_launcher(lambda: os.getpid())",
    ]
    nb = run_notebook(cells, timeout=300, env=_kernel_env(max(DEVICES, 2))).cells
    assert "[2.0, 2.0]" in cell_text(nb[1])
    (error,) = cell_errors(nb[2])
    assert error["ename"] == "RuntimeError"
    assert "already initialised" in error["evalue"] and "Restart the kernel" in error["evalue"]


def test_one_device_runs_in_the_kernel_and_says_so():
    from kernel import cell_errors, cell_text, run_notebook

    cells = [
        "import os\nfrom nbaccel import notebook_launcher",
        "def where():\n    import torch_xla.runtime as xr\n"
        "    return os.getpid(), xr.world_size()\n"
        "print('SAME', notebook_launcher(where) == [(os.getpid(), 1)])",
    ]
    nb = run_notebook(cells, timeout=300, env=_kernel_env(1)).cells
    assert not cell_errors(nb[1]), cell_text(nb[1])
    text = cell_text(nb[1])
    assert "Running in this process on its one XLA device" in text
    assert "SAME True" in text


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


def test_collectives_on_the_xla_device(monkeypatch):
    from nbaccel.launch.run import launch_xla

    monkeypatch.setenv("CPU_NUM_DEVICES", "1")  # the forked process's runtime: one device
    (r,) = launch_xla(_collectives, num_processes=1)
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
    from nbaccel.launch.run import launch_xla
    from nbaccel.launch.wire.errors import RankCrashed

    with pytest.raises(RankCrashed) as info:
        launch_xla(_killed, num_processes=None)
    assert "SIGKILL" in str(info.value) and "host RAM" in str(info.value)
    assert info.value.rank == 0
    with pytest.raises(ValueError, match="bad batch") as failed:
        launch_xla(_fails, num_processes=None)
    assert failed.value.__notes__ == [f"raised on rank {failed.value.rank}"]


def test_notebook_launcher_takes_the_xla_path(monkeypatch):
    import nbaccel.notebook.kernel.launcher as launcher

    # On a real TPU host the launcher detects it; PJRT_DEVICE=CPU is deliberately not "a TPU",
    # so the lane asks for the XLA path explicitly.
    monkeypatch.setenv("NBACCEL_XLA_LAUNCH", "1")
    model = nn.Linear(4, 4)
    results = launcher.notebook_launcher(_where, (model,))  # default: every local device
    assert [r[:3] for r in results] == [
        (i, DEVICES, model.weight.data_ptr()) for i in range(DEVICES)
    ]
    with pytest.warns(UserWarning, match=f"torch-xla ran on {DEVICES} devices"):
        launcher.notebook_launcher(_where, (model,), num_processes=DEVICES + 1)


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
    from nbaccel.training.accelerator.core import Accelerator
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
    from nbaccel.training.accelerator.core import Accelerator
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
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")  # it trains with collectives: one device on CPU
    path = Path(__file__).resolve().parents[2] / "notebooks" / "colab_kaggle_tpu.ipynb"
    nb = execute_notebook(path, timeout=600, allow_errors=False)
    text = "".join(output_text(o) for o in nb.cells[-1].outputs)
    assert "trained on xla" in text
    assert "('XLA', 'xla')" in text
