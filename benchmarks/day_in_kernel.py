"""A day in one kernel: launches and pool cells of every kind, in one real Jupyter kernel.

``stress_launch.py --day N`` runs it (``tests/kernel/test_day.py`` runs a short day in the default
suite). Steps rotate through :data:`KINDS`:

- ``ok``: the README tour function through ``notebook_launcher`` (value checked).
- ``raise``: rank 1 raises ``ValueError`` while rank 0 waits in a collective.
- ``crash``: rank 1 SIGKILLs itself while rank 0 waits in a collective.
- ``timeout``: both ranks hang; ``timeout=1``.
- ``children``: each rank starts a child process (a tokenizer server, a DataLoader worker)
  and returns while it still runs.
- ``large``: each rank returns a 32 MiB tensor (values checked).
- ``push``: ``%dist_push`` of a 16 MiB tensor, a ``%%distributed`` cell that reduces it,
  ``%dist_pull`` of the result (values checked).
- ``pool_raise``: a ``%%distributed`` cell whose rank 1 raises ``KeyError``.
- ``pool_ok``: a ``%%distributed`` cell that prints and returns its rank.

Kernel RSS is reported as measured and after ``malloc_trim`` (what glibc keeps cached for the
next allocation is handed back, so the second figure is what the kernel really holds).

The kernel is fresh, and its very first launch is checked on its own (``first_launch`` in the
report): each rank starts a child and a ``setsid``'d daemon and returns; none may run 2 s later.
Then one step of each kind runs before the day starts (imports, first pool cell, first widget
view), so the figures are what the day itself adds.

Counted: *wrong* (a step that should succeed returned something else), *misnamed* (a failure of
the wrong type, or without its rank), *hung* (a step over 60 s, or a cell that timed out), and
leaks at the end against the start: processes (the kernel's descendants other than the fork
server and the pool's ranks, and every process a ``children`` step started that still runs),
kernel fds (less IPython's history database, which IPython opens and closes itself),
``/dev/shm/nbaccel-*`` segments, temp folders, full-output logs (files, bytes),
live ipywidgets, and kernel RSS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KINDS = ["ok", "raise", "crash", "timeout", "children", "large", "push", "pool_raise", "pool_ok"]

# Sent verbatim to the kernel: the helpers every chunk of steps uses.
SETUP = (
    f"KINDS = {KINDS!r}\n"
    + r"""
import collections, gc, json, os, signal, subprocess, sys, tempfile, time
import psutil, torch
from IPython import get_ipython
from ipywidgets.widgets import widget as _widget
from nbaccel import LaunchTimeout, RankCrashed, notebook_launcher
from nbaccel.launch.host.log_store import store as _logs
from nbaccel.notebook.kernel.pool import get_pool

_CHILD_TAG = "nbaccel-day-child"
_LARGE = 8 << 20  # float32 elements: 32 MiB
_PUSH = 4 << 20  # 16 MiB
_ip = get_ipython()
_ip.run_line_magic("load_ext", "nbaccel")
_RANK = "import os\nRANK_ID = int(os.environ['RANK'])\n"  # pool cells: the pool may restart


def tour(lr):
    from nbaccel import PartialState

    state = PartialState()
    print(f"rank {state.process_index} of {state.num_processes} on {state.device}")
    return state.process_index * lr


def raising():
    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == 1:
        raise ValueError("injected")
    state.wait_for_everyone()


def crashing():
    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    state.wait_for_everyone()
    time.sleep(30)


def hanging():
    time.sleep(3600)


def with_child(tag):
    import subprocess, sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", tag])
    return child.pid > 0


def large(n):
    import os, torch

    return torch.arange(n, dtype=torch.float32) + int(os.environ["RANK"])


def _processes():
    me = psutil.Process()
    server_pids = set()
    kids = []
    for p in me.children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "forkserver" in line or "nbaccel.launch.launchers" in line:
            server_pids.add(p.pid)
        kids.append(p)
    pool = get_pool()
    ranks = set(pool.pids.values()) if pool is not None else set()
    stray = [p.pid for p in kids if p.pid not in server_pids and p.pid not in ranks]
    children = []
    for p in psutil.process_iter(["cmdline"]):
        if _CHILD_TAG in (p.info["cmdline"] or []):
            children.append(p.pid)
    return stray, children


def _shm():
    from nbaccel.launch.wire.transport import shm_dir

    return {f for f in os.listdir(shm_dir()) if f.startswith("nbaccel")}


def _new_shm():
    return len(_shm() - DAY["shm_before"]) if "DAY" in globals() else 0


def _lasting_shm():
    # segments of this kernel still there after 2 s (other programs' come and go meanwhile)
    lasting = _shm() - DAY["shm_before"]
    for _ in range(4):
        time.sleep(0.5)
        lasting &= _shm()
    return len(lasting)


def _fd_targets():
    # what each of the kernel's fds points at (a leak's report names it), less IPython's own
    # history database: its saving thread and sqlite open and close it on their own schedule
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith(_ip.profile_dir.location + os.sep):
            found[int(fd)] = target
    return found


def _rss_mb():
    return psutil.Process().memory_info().rss / 2**20


def resources():
    gc.collect()
    me = psutil.Process()
    stray, children = _processes()
    folder = os.environ.get("NBACCEL_LOG_DIR") or os.path.join(
        tempfile.gettempdir(), f"nbaccel-logs-{os.getuid()}")
    logs = [os.path.join(folder, f) for f in os.listdir(folder)] if os.path.isdir(folder) else []
    return {
        "procs": len(stray),
        "child_procs": len(children),
        "fds": len(_fd_targets()),
        "shm": _new_shm(),
        "tmp": len([f for f in os.listdir(tempfile.gettempdir())
                    if f.startswith(f"nbaccel-{me.pid}-")]),
        "logs": len(logs),
        "log_mb": round(sum(os.path.getsize(p) for p in logs if os.path.exists(p)) / 2**20, 2),
        "widgets": len(_widget._instances),
        "rss_mb": round(me.memory_info().rss / 2**20, 1),
        # what the C allocator keeps cached, handed back: the rest is what is really held
        "rss_trimmed_mb": round(_trimmed_rss() / 2**20, 1),
    }


def _trimmed_rss():
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def _expect_failure(call, kind, expected, text):
    try:
        call()
    except expected as exc:
        shown = "\n".join([str(exc), *getattr(exc, "__notes__", ())])  # message, then notes
        if all(t in shown for t in text):
            return "ok"
        return f"misnamed: {type(exc).__name__}: {str(exc)[:160]}"
    except BaseException as exc:
        return f"misnamed: {type(exc).__name__}: {str(exc)[:160]}"
    return "wrong: no error"


def step(kind):
    if kind == "ok":
        got = notebook_launcher(tour, (0.1,), num_processes=2)
        return "ok" if got == [0.0, 0.1] else f"wrong: {got!r}"
    if kind == "raise":
        return _expect_failure(lambda: notebook_launcher(raising, num_processes=2), kind,
                               ValueError, ["injected", "raised on rank 1"])
    if kind == "crash":
        return _expect_failure(lambda: notebook_launcher(crashing, num_processes=2), kind,
                               RankCrashed, ["rank 1", "SIGKILL"])
    if kind == "timeout":
        return _expect_failure(
            lambda: notebook_launcher(hanging, num_processes=2, timeout=1), kind,
            LaunchTimeout, ["timeout=1"])
    if kind == "children":
        got = notebook_launcher(with_child, (_CHILD_TAG,), num_processes=2)
        return "ok" if got == [True, True] else f"wrong: {got!r}"
    if kind == "large":
        got = notebook_launcher(large, (_LARGE,), num_processes=2)
        good = all(torch.equal(t, torch.arange(_LARGE, dtype=torch.float32) + r)
                   for r, t in enumerate(got))
        return "ok" if good else "wrong: large values"
    if kind == "push":
        _ip.user_ns["day_x"] = torch.ones(_PUSH)
        _ip.run_line_magic("dist_push", "day_x")
        cell = _RANK + "day_s = float(day_x.sum()) * (1 + RANK_ID)"
        _ip.run_cell_magic("distributed", "-n 2", cell)
        _ip.run_line_magic("dist_pull", "day_s --all")
        got = _ip.user_ns.get("day_s")
        return "ok" if got == [float(_PUSH), 2.0 * _PUSH] else f"wrong: {got!r}"
    if kind == "pool_raise":
        return _expect_failure(
            lambda: _ip.run_cell_magic(
                "distributed", "-n 2", _RANK + "if RANK_ID == 1:\n    raise KeyError('missing')"),
            kind, KeyError, ["missing", "raised on rank 1"])
    if kind == "pool_ok":
        _ip.run_cell_magic("distributed", "-n 2", _RANK + "day_r = RANK_ID\nprint('cell', day_r)")
        _ip.run_line_magic("dist_pull", "day_r --all")
        got = _ip.user_ns.get("day_r")
        return "ok" if got == [0, 1] else f"wrong: {got!r}"
    raise ValueError(kind)


def with_daemon(tag):
    import subprocess, sys

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", tag]
    subprocess.Popen(sleeper)
    subprocess.run(["setsid", "-f", *sleeper], check=True)  # daemonised: a session of its own
    return True


def _first_launch():
    # The kernel's very first launch (its ranks forked while the fork server imports): the
    # child and the setsid'd daemon each rank starts are gone 2 s after it returns.
    tag = _CHILD_TAG + "-first"
    got = notebook_launcher(with_daemon, (tag,), num_processes=2)
    time.sleep(2)
    left = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if tag in (p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except psutil.Error:
            pass
    return {"returned": got, "left": left}


FIRST_LAUNCH = _first_launch()
_ip.run_cell_magic("distributed", "-n 2", _RANK)
for _kind in KINDS:  # warm up: every code path has run once before the day is counted
    step(_kind)
time.sleep(0.5)
DAY = {"shm_before": _shm(), "fds_before": _fd_targets()}
DAY.update({"before": resources(), "counts": collections.Counter(), "bad": collections.Counter(),
       "slowest": 0.0, "steps": 0, "kinds": collections.Counter(), "started": time.time(),
            "rss_by_kind": collections.Counter()})


def run(kinds, first, count):
    for i in range(first, first + count):
        kind = kinds[i % len(kinds)]
        start, rss = time.monotonic(), _rss_mb()
        verdict = step(kind)
        took = time.monotonic() - start
        DAY["rss_by_kind"][kind] += _rss_mb() - rss
        DAY["slowest"] = max(DAY["slowest"], took)
        if took > 60:
            verdict = f"hung: {kind} took {took:.0f} s"
        DAY["steps"] += 1
        DAY["kinds"][kind] += 1
        category = verdict.split(":")[0]
        DAY["counts"][category] += 1
        if verdict != "ok":
            DAY["bad"][f"{kind}: {verdict[:200]}"] += 1
    print("DAY-PROGRESS", DAY["steps"], dict(DAY["counts"]))


def report():
    before = DAY["before"]
    after = resources()
    deadline = time.monotonic() + 10  # processes still exiting, fds still closing: settle first
    leaks = ("procs", "child_procs", "fds", "shm", "tmp", "logs")
    while any(after[k] > before[k] for k in leaks) and time.monotonic() < deadline:
        time.sleep(0.5)
        after = resources()
    after["shm"] = _lasting_shm()
    fds_now = _fd_targets()
    new_fds = {fd: target for fd, target in fds_now.items()
               if DAY["fds_before"].get(fd) != target}
    return {
        "first_launch": FIRST_LAUNCH,
        "steps": DAY["steps"],
        "kinds": dict(DAY["kinds"]),
        "results": dict(DAY["counts"]),
        "problems": dict(DAY["bad"].most_common(10)),
        "slowest_step_s": round(DAY["slowest"], 2),
        "rss_mb_by_kind": {k: round(v, 1) for k, v in DAY["rss_by_kind"].items()},
        "seconds": round(time.time() - DAY["started"], 1),
        "before": before,
        "after": after,
        "growth": {k: round(after[k] - before[k], 2) for k in before},
        "new_fds": {str(fd): target for fd, target in sorted(new_fds.items())},
    }
"""
)


def run_day(steps: int, chunk: int = 25, timeout: int = 900, env: dict | None = None) -> dict:
    """Run ``steps`` steps in one fresh kernel, ``chunk`` steps per notebook cell; the report.
    A cell that times out counts as a hang (the day stops there)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from kernel import cell_errors, cell_text, run_notebook

    cells = [SETUP]
    for first in range(0, steps, chunk):
        cells.append(f"run({KINDS!r}, {first}, {min(chunk, steps - first)})")
    cells.append("print('DAY-JSON ' + json.dumps(report()))")
    try:
        nb = run_notebook(cells, timeout=timeout, env=env, shutdown=True)
    except Exception as exc:  # nbclient's CellTimeoutError: a hang
        return {"steps": steps, "results": {"hung": 1}, "error": f"{type(exc).__name__}: {exc}"}
    for index, cell in enumerate(nb.cells):
        errors = cell_errors(cell)
        if errors:
            return {
                "steps": steps,
                "results": {"error": 1},
                "error": f"cell {index}: {errors[0].ename}: {errors[0].evalue}",
                "text": cell_text(cell)[-3000:],
            }
    for line in cell_text(nb.cells[-1]).splitlines():
        if line.startswith("DAY-JSON "):
            return json.loads(line[len("DAY-JSON ") :])
    raise RuntimeError(f"the kernel printed no report:\n{cell_text(nb.cells[-1])[-3000:]}")
