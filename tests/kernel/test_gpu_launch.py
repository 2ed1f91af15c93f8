"""GPU lane: launching from a kernel that already used CUDA (``notebook_launcher`` and
``%%distributed``), in a real kernel. Each rank is on ``cuda:LOCAL_RANK`` (one rank per GPU, at
most 2; a one-GPU machine runs a world of one), NCCL's ``all_reduce`` works, results come back,
a CUDA error on one rank is raised with its type, and afterwards no process of the launch is
left holding GPU memory. Also: ``CUDA_VISIBLE_DEVICES``, ``num_processes`` above the GPU count,
``start_method="fork"`` after CUDA, and a preloaded library that initialises CUDA.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from _gpu import gpu_count, holders, ranks, visible_uuids
from kernel import cell_errors, cell_text, run_notebook

pytestmark = pytest.mark.gpu

SETUP = """import json, os, torch
torch.cuda.init()
warm = torch.ones(1024, device="cuda:0") * 2   # the kernel holds a CUDA context and a tensor
from nbaccel import notebook_launcher
N = {n}
print("KERNEL", json.dumps([torch.cuda.is_initialized(), float(warm.sum())]))"""

# nbaccel starts no process group for a world of one (a one-GPU machine): the cells make one,
# so that NCCL's all_reduce runs on every machine.
WORLD_OF_ONE = """if not dist.is_initialized():
    dist.init_process_group("nccl", init_method=os.environ.get("NBACCEL_INIT_METHOD", "env://"),
                            rank=0, world_size=1, device_id=state.device)"""

WHERE = """def where():
    import os, torch, torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()
    if not dist.is_initialized():  # a world of one
        dist.init_process_group("nccl", init_method=os.environ.get("NBACCEL_INIT_METHOD", "env://"),
                                rank=0, world_size=1, device_id=state.device)
    t = torch.full((4,), float(state.process_index + 1), device=state.device)
    dist.all_reduce(t)
    return {"rank": state.process_index, "local_rank": int(os.environ["LOCAL_RANK"]),
            "device": str(state.device), "current": torch.cuda.current_device(),
            "tensor_device": str(t.device), "backend": dist.get_backend(),
            "sum": t.tolist(), "pid": os.getpid(), "visible": torch.cuda.device_count()}
results = notebook_launcher(where, num_processes=N)
print("RESULT", json.dumps(results))"""

CUDA_ERROR = """def fails_on_last_rank():
    import os, torch, torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()
    print("PID", os.getpid())
    if state.process_index == state.num_processes - 1:
        torch.empty(1 << 50, dtype=torch.uint8, device=state.device)  # 1 PiB: CUDA out of memory
    dist.barrier()   # the other ranks wait in an NCCL collective
try:
    notebook_launcher(fails_on_last_rank, num_processes=N)
except torch.OutOfMemoryError as exc:
    print("CAUGHT", type(exc).__name__, json.dumps([str(exc)[:300], exc.rank, exc.__notes__]))"""

AFTER = """import subprocess, psutil
pids = [r["pid"] for r in results]
print("PIDS", json.dumps(pids))
print("AGAIN", json.dumps([r["sum"] for r in notebook_launcher(where, num_processes=N)]))"""

TOO_MANY = """try:
    notebook_launcher(where, num_processes=torch.cuda.device_count() + 1)
except ValueError as exc:
    print("REFUSED", json.dumps(str(exc)))"""

FORK = """try:
    notebook_launcher(where, num_processes=1, start_method="fork")
except RuntimeError as exc:
    print("FORK", json.dumps(str(exc)))"""

MAGIC = (
    """%%distributed -n {n}
import json, os, torch, torch.distributed as dist
from nbaccel import PartialState
s = state = PartialState()
"""
    + WORLD_OF_ONE
    + """
x = torch.full((3,), float(s.process_index + 1), device=s.device)
dist.all_reduce(x)
print("POOL", json.dumps([s.process_index, str(s.device), str(x.device), x.tolist(),
                          dist.get_backend(), os.getpid()]))"""
)

MEMORY = """def hold(mib):
    import time, torch
    from nbaccel import PartialState
    block = torch.empty(mib << 20, dtype=torch.uint8, device=PartialState().device)
    time.sleep(1.5)   # the memory sampler reports twice a second
    return [torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
            torch.cuda.max_memory_allocated()]
print("MEMORY", json.dumps(notebook_launcher(hold, (256,), num_processes=N)))"""


@pytest.fixture(scope="module")
def nb():
    n = ranks()
    cells = [
        SETUP.format(n=n),  # 0
        WHERE,  # 1
        CUDA_ERROR,  # 2
        AFTER,  # 3
        TOO_MANY,  # 4
        FORK,  # 5
        "import json\n%load_ext nbaccel",  # 6
        MAGIC.format(n=n),  # 7
        "%dist_shutdown",  # 8
        MEMORY,  # 9
    ]
    return run_notebook(cells, timeout=300).cells


def _json(cell, tag: str):
    """Every ``TAG <json>`` line a cell printed, decoded."""
    text = cell_text(cell)
    found = [json.loads(m) for m in re.findall(rf"^(?:\[rank \d+\] )?{tag} (.*)$", text, re.M)]
    assert found, f"no {tag} line in the cell's output:\n{text}\nerrors: {cell_errors(cell)}"
    return found


def test_kernel_used_cuda_before_launching(nb):
    assert not cell_errors(nb[0])
    assert _json(nb[0], "KERNEL") == [[True, 2048.0]]


def test_each_rank_on_cuda_local_rank(nb):
    (results,) = _json(nb[1], "RESULT")
    assert [r["rank"] for r in results] == list(range(ranks()))
    for r in results:
        assert r["device"] == r["tensor_device"] == f"cuda:{r['local_rank']}"
        assert r["current"] == r["local_rank"]


def test_nccl_all_reduce_results_come_back(nb):
    (results,) = _json(nb[1], "RESULT")
    n = ranks()
    total = float(n * (n + 1) // 2)
    assert all(r["backend"] == "nccl" for r in results)
    assert [r["sum"] for r in results] == [[total] * 4] * n
    assert "Launching on" in cell_text(nb[1]) and "GPU" in cell_text(nb[1])


def test_cuda_error_on_one_rank_is_raised_with_its_type(nb):
    name, (message, rank, notes) = _split(nb[2])
    assert name == "OutOfMemoryError" and "out of memory" in message.lower()
    assert rank == ranks() - 1 and notes[-1] == f"raised on rank {rank}"


def _split(cell):
    line = next(x for x in cell_text(cell).splitlines() if x.startswith("CAUGHT "))
    _, name, payload = line.split(" ", 2)
    return name, json.loads(payload)


def test_no_process_of_the_launch_holds_gpu_memory_afterwards(nb):
    (pids,) = _json(nb[3], "PIDS")
    failed = _json(nb[2], "PID")  # the ranks of the failed launch, killed in a collective too
    assert len(pids) == len(failed) == ranks()
    assert holders(pids + failed) == []
    # and the kernel can launch again on the same GPUs after the failed launch of cell 2
    n = ranks()
    assert _json(nb[3], "AGAIN") == [[[float(n * (n + 1) // 2)] * 4] * n]


def test_num_processes_above_the_gpu_count_is_refused_with_the_count(nb):
    (message,) = _json(nb[4], "REFUSED")
    count = gpu_count()
    assert f"num_processes={count + 1}" in message and f"{count} GPU(s)" in message


def test_fork_start_method_is_refused_after_cuda_init_and_names_the_fix(nb):
    (message,) = _json(nb[5], "FORK")
    assert "CUDA is already initialised" in message and "start_method='auto'" in message


def test_distributed_magic_after_kernel_used_cuda_runs_nccl(nb):
    assert not cell_errors(nb[7]), cell_text(nb[7])
    rows = sorted(_json(nb[7], "POOL"))
    n = ranks()
    total = float(n * (n + 1) // 2)
    assert [r[0] for r in rows] == list(range(n))
    for rank, device, tensor_device, value, backend, _pid in rows:
        assert device == tensor_device == f"cuda:{rank}"
        assert value == [total] * 3 and backend == "nccl"


def test_pool_shutdown_leaves_no_process_holding_gpu_memory(nb):
    assert not cell_errors(nb[8]), cell_text(nb[8])
    pids = [r[5] for r in _json(nb[7], "POOL")]
    assert holders(pids) == []


_SIZE = re.compile(r"device cuda ([\d.]+) (B|KiB|MiB|GiB) of ([\d.]+) (B|KiB|MiB|GiB)")
_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def test_memory_summary_shows_each_ranks_cuda_peak(nb):
    (measured,) = _json(nb[9], "MEMORY")
    summary = cell_text(nb[9])
    assert "Memory peak per rank" in summary
    peaks = [float(v) * _UNIT[u] for v, u, _, _ in _SIZE.findall(summary)]
    assert len(peaks) == ranks(), summary
    for (allocated, reserved, peak), shown in zip(measured, peaks):
        assert allocated >= 256 << 20 and reserved >= allocated and peak >= allocated
        assert shown >= 256 << 20  # the monitor saw the 256 MiB block on every rank
    assert "reserved" in summary


def test_cuda_visible_devices_is_respected():
    """The kernel sees only the last GPU: one rank by default, on that very GPU."""
    last = gpu_count() - 1
    uuid = visible_uuids()[last]
    cells = [
        "import json, torch\nfrom nbaccel import notebook_launcher",
        """def which():
    import torch
    from nbaccel import PartialState
    device = PartialState().device
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return [str(device), torch.cuda.device_count(), uuid]
print("WHICH", json.dumps([torch.cuda.device_count(), notebook_launcher(which)]))""",
    ]
    nb = run_notebook(cells, timeout=300, env={"CUDA_VISIBLE_DEVICES": str(last)}).cells
    ((kernel_count, results),) = _json(nb[1], "WHICH")
    assert kernel_count == 1
    assert results == [["cuda:0", 1, uuid]]
    assert "num_processes was not given: using the 1 GPU(s) found" in cell_text(nb[1])


CUDA_AT_IMPORT = "import torch\ntorch.cuda.init()  # a library that initialises CUDA at import\n"


def _pid():
    import os

    return os.getpid()


def test_preloaded_library_initialising_cuda_is_kept_out_and_the_launch_goes_on(
    tmp_path, monkeypatch
):
    from recorder import Recorder

    from nbaccel.launch.launchers.forkserver.launcher import preload_report, shutdown_forkserver
    from nbaccel.launch.plan import LaunchPlan
    from nbaccel.launch.request import Front, LaunchRequest
    from nbaccel.launch.run import run_function

    (tmp_path / "gpu_lib_at_import.py").write_text(CUDA_AT_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    request = LaunchRequest(num_processes=1, preload=["off", "gpu_lib_at_import"])
    plan = LaunchPlan.create(Front.TESTING, request)
    shown = Recorder()
    try:
        report = run_function(plan, _rank_device_index, renderer=shown)
        assert report.values() == [0]  # the rank uses the GPU: its server never touched CUDA
        assert any(
            n.startswith("gpu_lib_at_import is not preloaded") and "initialised CUDA" in n
            for n in shown.notices
        ), shown.notices
        assert "gpu_lib_at_import" in preload_report()["refused"]
    finally:
        shutdown_forkserver()


def _rank_device_index():
    import torch

    torch.ones(1, device="cuda")
    return torch.cuda.current_device()


def _rank_device():
    import torch

    from nbaccel import PartialState

    state = PartialState()
    x = torch.ones(2, device=state.device)
    return str(state.device), str(x.device), torch.cuda.current_device()


def test_run_on_ranks_puts_each_rank_on_its_gpu():
    from nbaccel.testing import run_on_ranks

    got = run_on_ranks(_rank_device, num_processes=ranks(), cpu=False, timeout=120)
    assert got == [(f"cuda:{i}", f"cuda:{i}", i) for i in range(ranks())]
    assert torch.cuda.is_available()
