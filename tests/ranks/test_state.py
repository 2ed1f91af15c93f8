"""PartialState / AcceleratorState / GradientState: one process here, two real gloo ranks below."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nbaccel import AcceleratorState, DistributedType, GradientState, PartialState
from nbaccel.testing import run_on_ranks

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NBACCEL_LAUNCHER",
    "ACCELERATE_MIXED_PRECISION",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
)


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> PartialState:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return PartialState(cpu=True)


# -- two ranks ---------------------------------------------------------------------------------
def _log(path: str, text: str) -> None:
    with open(path, "a") as f:  # O_APPEND: each short line lands whole
        f.write(f"{text} {time.monotonic():.4f}\n")


def _identity_and_sync(workdir: str) -> dict[str, Any]:
    """Every property, the barrier, the ordering context managers and the decorators."""
    import contextlib
    import io
    import os
    import time

    import torch
    import torch.distributed as dist

    from nbaccel import AcceleratorState, PartialState

    state = PartialState()
    rank = state.process_index
    out: dict[str, Any] = {
        "process_index": rank,
        "local_process_index": state.local_process_index,
        "num_processes": state.num_processes,
        "is_main_process": state.is_main_process,
        "is_local_main_process": state.is_local_main_process,
        "is_last_process": state.is_last_process,
        "device": state.device,
        "distributed_type": state.distributed_type,
        "backend": state.backend,
        "use_distributed": state.use_distributed,
        "dist_backend": dist.get_backend(),
        "same_object_state": PartialState().__dict__ is state.__dict__,
        "accelerator_state_type": AcceleratorState().distributed_type,
        "repr": repr(state),
    }

    # wait_for_everyone: rank 0 writes a file late; rank 1 must see it after the barrier.
    marker = os.path.join(workdir, "barrier-marker")
    if rank == 0:
        time.sleep(0.3)
        open(marker, "w").close()
    state.wait_for_everyone()
    out["marker_seen_after_barrier"] = os.path.exists(marker)

    # main_process_first / local_main_process_first: rank 1 arrives first but must enter last.
    for name in ("main_process_first", "local_main_process_first"):
        log = os.path.join(workdir, f"{name}.log")
        if rank == 0:
            time.sleep(0.2)
        with getattr(state, name)():
            _log(log, f"enter {rank}")
            time.sleep(0.2)
            _log(log, f"exit {rank}")
    state.wait_for_everyone()

    # Decorators: each returns the rank where it runs and None elsewhere.
    def who() -> int:
        return rank

    out["on_main_process"] = state.on_main_process(who)()
    out["on_local_main_process"] = state.on_local_main_process(who)()
    out["on_last_process"] = state.on_last_process(who)()
    out["on_process_1"] = state.on_process(who, process_index=1)()
    out["on_local_process_1"] = state.on_local_process(local_process_index=1)(who)()

    @state.on_process(process_index=0)
    def decorated(x: int) -> int:
        """Keeps its docstring."""
        return x * 10

    out["decorated"] = decorated(7)
    out["decorated_doc"] = decorated.__doc__

    # print: only the local main process writes.
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        state.print("hello from", rank, sep="|")
    out["printed"] = buffer.getvalue()

    # set_seed: same stream everywhere; device_specific adds the process index.
    from nbaccel import set_seed

    set_seed(1234)
    out["same_seed"] = torch.rand(3)
    set_seed(1234, device_specific=True)
    out["device_specific"] = torch.rand(3)

    state.destroy_process_group()
    out["initialized_after_destroy"] = dist.is_initialized()
    return out


def _read_log(path: Path) -> list[tuple[str, int, float]]:
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(what, int(rank), float(t)) for what, rank, t in rows]


def test_state_on_two_ranks(tmp_path: Path) -> None:
    r0, r1 = run_on_ranks(_identity_and_sync, args=(str(tmp_path),))
    for rank, r in enumerate((r0, r1)):
        assert r["process_index"] == r["local_process_index"] == rank
        assert r["num_processes"] == 2
        assert r["is_main_process"] is (rank == 0)
        assert r["is_local_main_process"] is (rank == 0)
        assert r["is_last_process"] is (rank == 1)
        assert r["device"] == torch.device("cpu")
        assert r["distributed_type"] == DistributedType.MULTI_CPU
        assert r["accelerator_state_type"] == DistributedType.MULTI_CPU
        assert r["backend"] == r["dist_backend"] == "gloo"
        assert r["use_distributed"] is True
        assert r["same_object_state"] is True
        assert f"Process index: {rank}" in r["repr"] and "MULTI_CPU" in r["repr"]
        assert r["marker_seen_after_barrier"] is True
        assert r["initialized_after_destroy"] is False
        assert r["decorated_doc"] == "Keeps its docstring."

    assert (r0["on_main_process"], r1["on_main_process"]) == (0, None)
    assert (r0["on_local_main_process"], r1["on_local_main_process"]) == (0, None)
    assert (r0["on_last_process"], r1["on_last_process"]) == (None, 1)
    assert (r0["on_process_1"], r1["on_process_1"]) == (None, 1)
    assert (r0["on_local_process_1"], r1["on_local_process_1"]) == (None, 1)
    assert (r0["decorated"], r1["decorated"]) == (70, None)
    assert (r0["printed"], r1["printed"]) == ("hello from|0\n", "")

    assert torch.equal(r0["same_seed"], r1["same_seed"])
    assert not torch.equal(r0["device_specific"], r1["device_specific"])
    torch.manual_seed(1234 + 1)
    assert torch.equal(r1["device_specific"], torch.rand(3))

    for name in ("main_process_first", "local_main_process_first"):
        log = _read_log(tmp_path / f"{name}.log")
        assert [(what, rank) for what, rank, _ in log] == [
            ("enter", 0),
            ("exit", 0),
            ("enter", 1),
            ("exit", 1),
        ], log
        assert log[2][2] >= log[1][2]  # rank 1 entered after rank 0 left


def _auto_device() -> tuple[str, str, str]:
    from nbaccel import PartialState

    state = PartialState()
    return str(state.device), state.distributed_type.value, state.backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU default")
def test_no_gpu_defaults_to_multi_cpu_on_gloo() -> None:
    """Without ACCELERATE_USE_CPU or cpu=True, 2 ranks on a machine without GPUs are MULTI_CPU."""
    results = run_on_ranks(_auto_device, env={"ACCELERATE_USE_CPU": "False"})
    assert results == [("cpu", "MULTI_CPU", "gloo")] * 2


def _fails_in_main_first() -> str:
    from nbaccel import PartialState

    state = PartialState()
    try:
        with state.main_process_first():
            if state.is_main_process:
                raise KeyError("cache build failed")
    except KeyError:
        return "main raised"
    return "released"


def test_main_process_first_releases_others_when_main_raises() -> None:
    assert run_on_ranks(_fails_in_main_first, timeout=30) == ["main raised", "released"]


# -- one process -------------------------------------------------------------------------------
def test_single_process_state(single: PartialState) -> None:
    state = single
    assert (state.process_index, state.local_process_index, state.num_processes) == (0, 0, 1)
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert state.device == torch.device("cpu")
    assert state.distributed_type == DistributedType.NO
    assert state.use_distributed is False
    state.wait_for_everyone()  # no process group: returns at once
    with state.main_process_first(), state.local_main_process_first():
        pass
    with state.split_between_processes(["A", "B", "C"]) as share:
        assert share == ["A", "B", "C"]
    state.destroy_process_group()  # nothing to destroy: no error


def test_single_process_runs_every_decorated_function(single: PartialState) -> None:
    """As in Accelerate: outside a distributed run every decorated function executes."""
    calls: list[str] = []
    single.on_main_process(lambda: calls.append("main"))()
    single.on_main_process()(lambda: calls.append("main()"))()
    single.on_local_main_process(lambda: calls.append("local_main"))()
    single.on_last_process(lambda: calls.append("last"))()
    single.on_process(process_index=3)(lambda: calls.append("process 3"))()
    single.on_local_process(local_process_index=2)(lambda: calls.append("local 2"))()
    assert calls == ["main", "main()", "local_main", "last", "process 3", "local 2"]


def test_print_on_single_process(single: PartialState, capsys: pytest.CaptureFixture) -> None:
    single.print("a", 1, end="!\n")
    assert capsys.readouterr().out == "a 1!\n"


def test_state_is_shared_and_failed_setup_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="MASTER_ADDR/MASTER_PORT are not set"):
        PartialState(cpu=True)
    assert not PartialState._shared_state  # no half-built state left behind
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    first, second = PartialState(cpu=True), PartialState()
    assert first.__dict__ is second.__dict__ and second.num_processes == 1


def test_bad_launch_variable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        PartialState(cpu=True)


def test_accelerator_state_mixed_precision(single: PartialState) -> None:
    state = AcceleratorState(mixed_precision="BF16", cpu=True)
    assert state.mixed_precision == "bf16"
    assert state.distributed_type == DistributedType.NO and state.num_processes == 1
    assert AcceleratorState().mixed_precision == "bf16"  # shared
    with pytest.raises(ValueError, match="already set up with mixed_precision='bf16'"):
        AcceleratorState(mixed_precision="fp16")
    AcceleratorState._reset_state()
    with pytest.raises(ValueError, match="Unknown mixed_precision 'fp4'"):
        AcceleratorState(mixed_precision="fp4")
    assert AcceleratorState(mixed_precision="fp8").mixed_precision == "fp8"  # torchao / TE
    AcceleratorState._reset_state()


def test_accelerator_state_reads_mixed_precision_env(
    single: PartialState, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert AcceleratorState().mixed_precision == "fp16"


def test_gradient_state_tracks_dataloaders() -> None:
    class Loader:
        end_of_dataloader = True
        remainder = 3

    class Plugin:
        def to_kwargs(self) -> dict[str, Any]:
            return {"num_steps": 4, "adjust_scheduler": True}

    state = GradientState(Plugin())
    assert GradientState().__dict__ is state.__dict__
    assert (state.num_steps, state.adjust_scheduler, state.sync_with_dataloader) == (4, True, True)
    assert state.sync_gradients and not state.in_dataloader and state.remainder == -1
    loader = Loader()
    state._add_dataloader(loader)
    assert state.in_dataloader and state.end_of_dataloader and state.remainder == 3
    state._remove_dataloader(loader)
    assert not state.in_dataloader and not state.end_of_dataloader
    state._set_sync_gradients(False)
    assert GradientState().sync_gradients is False
