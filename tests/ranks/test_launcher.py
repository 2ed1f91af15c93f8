"""notebook_launcher and debug_launcher with real worker processes (this process drives)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
from recorder import Recorder

from nbaccel import (
    LaunchTimeout,
    RankCrashed,
    UnpicklableError,
    debug_launcher,
    notebook_launcher,
)
from nbaccel.launch.launchers.forkserver.launcher import get_forkserver


def _workers_alive() -> list[psutil.Process]:
    server = psutil.Process(get_forkserver().pid)
    return [p for p in server.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def no_leaks():
    yield
    deadline = time.monotonic() + 5
    while _workers_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _workers_alive() == []


def _state_and_output(scale):
    from nbaccel import PartialState

    state = PartialState()
    for i in range(50):
        print(f"rank {state.process_index} line {i} " + "x" * 200)
    os.write(1, f"c-level {state.process_index}\n".encode())
    print("to stderr", file=sys.stderr)
    return (state.process_index, state.num_processes, state.distributed_type.value, scale)


def test_results_and_whole_labelled_lines(no_leaks):
    rec = Recorder()
    results = notebook_launcher(_state_and_output, (7,), num_processes=2, renderer=rec)
    assert results == [(0, 2, "MULTI_CPU", 7), (1, 2, "MULTI_CPU", 7)]
    assert rec.announcement.startswith("Launching on 2 CPU processes (gloo)")
    for rank in (0, 1):
        mine = [text for r, stream, text in rec.lines if r == rank and stream == "stdout"]
        expected = [f"rank {rank} line {i} " + "x" * 200 for i in range(50)]
        assert [t for t in mine if t.startswith("rank ")] == expected  # whole lines, in order
        assert f"c-level {rank}" in mine
        assert (rank, "stderr", "to stderr") in rec.lines


def _fail_on_one():
    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == 1:
        raise ValueError("bad shard")
    state.wait_for_everyone()  # blocks: rank 1 never arrives


def test_error_keeps_type_and_names_rank_while_peer_blocked(no_leaks):
    # no launch timeout: rank 0 waits for rank 1 forever unless the failure stops it
    with pytest.raises(ValueError, match="bad shard") as info:
        notebook_launcher(_fail_on_one, num_processes=2, renderer=Recorder())
    assert str(info.value) == "bad shard" and info.value.rank == 1
    assert info.value.__notes__ == ["raised on rank 1"]
    cause = str(info.value.__cause__)
    assert "Traceback from rank 1" in cause
    assert 'raise ValueError("bad shard")' in cause
    assert "nbaccel/launch" not in cause  # launcher internals trimmed
    assert notebook_launcher(lambda: "ok", num_processes=2, renderer=Recorder()) == ["ok", "ok"]


_SLEPT = "slept through"  # what a rank prints if nothing stops its long sleep


def _sleep_long(seconds: float = 30) -> None:
    time.sleep(seconds)
    print(_SLEPT, flush=True)


def _exit_code():
    if int(os.environ["RANK"]) == 1:
        os._exit(3)
    _sleep_long()


def _sigkill():
    if int(os.environ["RANK"]) == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    _sleep_long()


def _segfault():
    import ctypes

    if int(os.environ["RANK"]) == 1:
        ctypes.string_at(0)
    _sleep_long()


@pytest.mark.parametrize(
    ("target", "rank", "pattern"),
    [
        (_exit_code, 1, "rank 1 exited with code 3"),
        (_sigkill, 0, "rank 0 was killed by SIGKILL.*RAM"),
        (_segfault, 1, "rank 1 was killed by SIGSEGV"),
    ],
)
def test_dead_rank_is_named(no_leaks, target, rank, pattern):
    rec = Recorder()
    with pytest.raises(RankCrashed, match=pattern) as info:
        notebook_launcher(target, num_processes=2, renderer=rec)
    assert info.value.rank == rank
    assert _SLEPT not in rec.text(), "the surviving rank was left to finish its sleep"


def test_timeout_stops_every_rank(no_leaks):
    rec = Recorder()
    with pytest.raises(LaunchTimeout, match=r"rank\(s\) \[0, 1\]"):
        notebook_launcher(_sleep_long, (60,), num_processes=2, timeout=1.5, renderer=rec)
    assert _SLEPT not in rec.text(), "a rank was left to finish its sleep"


def _hang_in_two_places() -> None:
    from nbaccel import PartialState

    PartialState()  # a gloo group of 2

    def waits_for_a_file() -> None:
        time.sleep(60)

    if os.environ["RANK"] == "1":
        waits_for_a_file()
    torch.distributed.barrier()  # rank 0 waits here for rank 1


def test_a_timeout_shows_where_each_rank_hung(no_leaks):
    """Before the late ranks are stopped, each prints every thread's Python stack: rank 0 in the
    barrier, rank 1 in the function it was sleeping in."""
    recorder = Recorder()
    with pytest.raises(LaunchTimeout, match="Their Python stacks at the timeout are above"):
        notebook_launcher(_hang_in_two_places, num_processes=2, timeout=3, renderer=recorder)
    by_rank = {
        rank: "\n".join(text for r, _, text in recorder.lines if r == rank) for rank in (0, 1)
    }
    assert re.search(r"line \d+ in barrier\n.*\n.*line \d+ in _hang_in_two_places", by_rank[0])
    assert re.search(r"line \d+ in waits_for_a_file\n.*line \d+ in _hang", by_rank[1])
    assert "Fatal Python error" not in by_rank[0] + by_rank[1]  # a dump, not a crash
    for shown in by_rank.values():  # the user's frames only: no watcher thread, no worker
        assert shown.count("(most recent call first)") == 1 and "nbaccel" not in shown


def test_bad_input_refused_before_start():
    lock = threading.Lock()
    with pytest.raises(UnpicklableError, match=r"args\[1\]\['lock'\].*lock"):
        notebook_launcher(print, (1, {"lock": lock}), num_processes=2, renderer=Recorder())
    with pytest.raises(ValueError, match="num_processes must be a positive integer"):
        notebook_launcher(print, num_processes=0)
    with pytest.raises(ValueError, match="Unknown mixed_precision 'fp4'.*no, fp16, bf16, fp8"):
        notebook_launcher(print, num_processes=2, mixed_precision="fp4")
    with pytest.raises(TypeError, match="needs a callable"):
        notebook_launcher("train", num_processes=2)
    with pytest.raises(ValueError, match=r"rdzv_conf=\{'timeout': 5\} is not supported.*use_port"):
        notebook_launcher(print, num_processes=2, rdzv_conf={"timeout": 5})
    with pytest.raises(ValueError, match="rdzv_id='run-1' is not supported"):
        notebook_launcher(print, num_processes=2, rdzv_id="run-1")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"use_port={port} is already in use"):
            notebook_launcher(print, num_processes=2, use_port=port)


def _accelerator_precision():
    from nbaccel import AcceleratorState

    return AcceleratorState().mixed_precision


def test_mixed_precision_reaches_the_ranks(no_leaks):
    got = notebook_launcher(
        _accelerator_precision, num_processes=2, mixed_precision="bf16", renderer=Recorder()
    )
    assert got == ["bf16", "bf16"]


def _touch_shared(t, model):
    rank = int(os.environ["RANK"])
    before = float(t[0])
    if rank == 0:
        t.add_(100)  # copy-on-write: rank 1 and the notebook must not see this
    time.sleep(0.3)
    w = model.weight
    return before, float(t[0]), float(w.sum()), model.weight is model.weight, w.shape


def _shm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("nbaccel-")}


def test_tensors_travel_through_shared_memory(no_leaks):
    before = _shm_segments()  # other programs on the machine may hold theirs
    t = torch.arange(1_000_000, dtype=torch.float32)
    model = torch.nn.Linear(512, 512)
    expected = float(model.weight.detach().sum())
    results = notebook_launcher(_touch_shared, (t, model), num_processes=2, renderer=Recorder())
    assert results[0][:2] == (0.0, 100.0)
    assert results[1][:2] == (0.0, 0.0)
    assert t[0] == 0  # the notebook's tensor is untouched
    for r in results:
        assert r[2] == pytest.approx(expected, rel=1e-5)
        assert r[4] == (512, 512)
    assert _shm_segments() - before == set()


def _views(whole, head, transposed, strided, small, small_head):
    head.add_(1)  # a view of ``whole``: the rank sees the change through both
    small_head.add_(1)
    return (
        float(whole[0]),
        head.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(),
        transposed.stride(),
        strided.stride(),
        float(small[0]),
    )


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_views_and_strides_survive_the_trip(start_method):
    """``(a, a[:512])`` arrive as a tensor and a view of it; a transposed tensor keeps its
    strides (large tensors travel by shared memory, small ones inside the pickle)."""
    whole = torch.zeros(100_000)
    matrix = torch.arange(300 * 400, dtype=torch.float32).reshape(300, 400)
    small = torch.zeros(8)
    results = notebook_launcher(
        _views,
        (whole, whole[:512], matrix.t(), matrix[:, ::2], small, small[:4]),
        num_processes=2,
        start_method=start_method,
        renderer=Recorder(),
    )
    assert results == [(1.0, True, (1, 400), (400, 2), 1.0)] * 2
    assert whole[0] == 0 and small[0] == 0  # the notebook's tensors are untouched


def _fail_first_time(marker):
    if not os.path.exists(marker):
        if int(os.environ["RANK"]) == 0:
            open(marker, "w").close()
        raise RuntimeError("first attempt fails")
    return "second attempt"


def test_max_restarts_restarts_and_reports(tmp_path, no_leaks):
    rec = Recorder()
    marker = str(tmp_path / "attempted")
    out = notebook_launcher(
        _fail_first_time, (marker,), num_processes=2, max_restarts=2, renderer=rec
    )
    assert out == ["second attempt"] * 2
    assert any("restart 1 of 2" in n for n in rec.notices)


def test_spawn_start_method_and_debug_launcher(no_leaks):
    rec = Recorder()
    got = notebook_launcher(
        _accelerator_precision, num_processes=2, start_method="spawn", renderer=rec
    )
    assert got == ["no", "no"]
    assert debug_launcher(_state_and_output, (1,))[1][:3] == (1, 2, "MULTI_CPU")


_NODE_SCRIPT = textwrap.dedent(
    """
    import sys
    from nbaccel import notebook_launcher
    from nbaccel.launch.driver.renderer import Renderer

    def world():
        import torch
        from nbaccel import PartialState, gather
        s = PartialState()
        return s.process_index, s.num_processes, gather(torch.tensor([s.process_index])).tolist()

    if __name__ == "__main__":
        node, port = int(sys.argv[1]), int(sys.argv[2])
        out = notebook_launcher(world, num_processes=1, num_nodes=2, node_rank=node,
                                use_port=port, renderer=Renderer())
        print("RESULT", out)
    """
)


def test_two_drivers_form_one_world(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(_NODE_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script), str(n), str(port)], stdout=subprocess.PIPE, text=True
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in nodes]
    assert "RESULT [(0, 2, [0, 1])]" in outs[0]
    assert "RESULT [(1, 2, [0, 1])]" in outs[1]


_INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import os, time
    from nbaccel import notebook_launcher

    def forever():
        from nbaccel import PartialState

        state = PartialState()
        print("started", os.getpid(), flush=True)
        if state.process_index == 0:
            state.wait_for_everyone()  # interrupted mid-collective: rank 1 never arrives
        while True:
            time.sleep(0.1)

    if __name__ == "__main__":
        try:
            notebook_launcher(forever, num_processes=2)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        print("NEXT", notebook_launcher(lambda: 1, num_processes=2), flush=True)
    """
)


def test_interrupt_stops_every_rank(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_INTERRUPT_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pids = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, "driver ended early"
        if "started" in line:
            pids.append(int(line.split()[-1]))
    os.killpg(proc.pid, signal.SIGINT)  # what Jupyter's stop button does
    try:
        rest = proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the interrupted launch did not end within 60 s (its ranks loop forever)")
    assert "INTERRUPTED" in rest and "NEXT [1, 1]" in rest
    assert not [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]


def test_works_from_a_terminal_ipython_session():
    code = (
        "from nbaccel import notebook_launcher\n"
        "def f(x):\n    print('hi', x)\n    return x * 2\n"
        "print('RESULT', notebook_launcher(f, (21,), num_processes=2))"
    )
    ipython = os.path.join(os.path.dirname(sys.executable), "ipython")
    out = subprocess.run([ipython, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RESULT [42, 42]" in out.stdout, out.stdout + out.stderr
    assert "[rank 0] hi 21" in out.stdout and "[rank 1] hi 21" in out.stdout
