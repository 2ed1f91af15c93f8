"""Hundreds of launches in a row: spurious failures, misattributed failures, leaks.

Run in a real Jupyter kernel (the default, through nbclient) or in this process (``--where
script``)::

    .venv/bin/python benchmarks/stress_launch.py --runs 1000 --killed 100
    .venv/bin/python benchmarks/stress_launch.py --where script --runs 200
    .venv/bin/python benchmarks/stress_launch.py --day 1000     # a day in one kernel

``--day N`` runs ``benchmarks/day_in_kernel.py``: N steps in one real kernel rotating through
ok / raise / crash / timeout / children / large results / pushes / pool cells, counting wrong
results, misnamed failures, hangs and every leak (processes, fds, shm, temp folders, logs,
widgets, kernel RSS); the report goes under ``"day"`` in the results file.

Workloads, each launched ``--runs`` times on 2 ranks (``--killed`` times for ``killed``):

- ``tour``: the README's tour function (``PartialState()``, print, return ``rank * lr``).
- ``uneven``: ranks finish 0-50 ms apart after joining the process group.
- ``failing``: rank 1 raises ``ValueError`` while rank 0 waits in a collective.
- ``killed``: rank 1 SIGKILLs itself while rank 0 waits in a collective.

A run is *spurious* when a launch that should succeed fails, *misattributed* when a failing
launch names the wrong rank or type. Leaks are counted once at the end against the start: worker
processes, driver file descriptors, ``/dev/shm/nbaccel-*`` segments, ``nbaccel-*`` temp dirs,
and the driver's RSS. Results go to ``benchmarks/results/stress_launch.json``. Never asserted in
CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The loop below is sent verbatim to the kernel (or exec'd here), so it is source text.
LOOP = r"""
import collections, json, os, signal, tempfile, time
import psutil
from nbaccel import notebook_launcher, RankCrashed
from nbaccel.launch.driver.renderer import Renderer


def tour(lr):
    from nbaccel import PartialState

    state = PartialState()
    print(f"rank {state.process_index} of {state.num_processes} on {state.device}")
    return state.process_index * lr


def uneven(seed):
    import random

    from nbaccel import PartialState

    state = PartialState()
    random.seed(seed * 7919 + state.process_index)
    time.sleep(random.uniform(0, 0.05))
    return state.process_index


def failing():
    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == 1:
        raise ValueError("injected")
    state.wait_for_everyone()


def killed():
    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    state.wait_for_everyone()
    time.sleep(30)


def resources():
    me = psutil.Process()
    kids = [p for p in me.children(recursive=True) if "forkserver" not in " ".join(p.cmdline())]
    shm = [f for f in os.listdir("/dev/shm") if f.startswith("nbaccel")]
    tmp = [f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"nbaccel-{me.pid}-")]
    return {"procs": len(kids), "fds": me.num_fds(), "shm": len(shm), "tmp": len(tmp),
            "rss_mb": me.memory_info().rss / 2**20}


def attempt(kind, i):
    quiet = Renderer()
    try:
        if kind == "tour":
            got = notebook_launcher(tour, args=(0.1,), num_processes=2, renderer=quiet)
            return "ok" if got == [0.0, 0.1] else f"wrong result {got!r}"
        if kind == "uneven":
            got = notebook_launcher(uneven, args=(i,), num_processes=2, renderer=quiet)
            return "ok" if got == [0, 1] else f"wrong result {got!r}"
        if kind == "failing":
            notebook_launcher(failing, num_processes=2, renderer=quiet)
            return "no error"
        notebook_launcher(killed, num_processes=2, renderer=quiet, timeout=60)
        return "no error"
    except ValueError as exc:
        ok = kind == "failing" and getattr(exc, "rank", None) == 1
        return "ok" if ok else f"{type(exc).__name__}: {str(exc)[:160]}"
    except RankCrashed as exc:
        ok = kind == "killed" and "rank 1" in str(exc) and "SIGKILL" in str(exc)
        return "ok" if ok else f"{type(exc).__name__}: {str(exc)[:160]}"
    except BaseException as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def stress(plan):
    attempt("tour", -1)  # warm the fork server before counting resources
    time.sleep(0.5)
    before = resources()
    report = {"before": before, "workloads": {}}
    for kind, runs in plan.items():
        start = time.monotonic()
        bad = collections.Counter()
        for i in range(runs):
            verdict = attempt(kind, i)
            if verdict != "ok":
                bad[verdict.splitlines()[0][:200]] += 1
        report["workloads"][kind] = {
            "runs": runs,
            "failures": sum(bad.values()),
            "kinds": dict(bad.most_common(5)),
            "seconds": round(time.monotonic() - start, 2),
        }
    time.sleep(1.0)
    report["after"] = resources()
    return report
"""


def _plan(args: argparse.Namespace) -> dict[str, int]:
    return {"tour": args.runs, "uneven": args.runs, "failing": args.failing, "killed": args.killed}


def run_here(plan: dict[str, int]) -> dict:
    namespace: dict = {"__name__": "stress_launch_loop"}
    exec(compile(LOOP, "stress_launch_loop", "exec"), namespace)
    return namespace["stress"](plan)


def run_in_kernel(plan: dict[str, int], timeout: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from kernel import cell_text, run_notebook

    cell = LOOP + f"\nprint('STRESS-JSON ' + json.dumps(stress({plan!r})))\n"
    nb = run_notebook(["import nbaccel", cell], timeout=timeout)
    text = cell_text(nb.cells[1])
    for line in text.splitlines():
        if line.startswith("STRESS-JSON "):
            return json.loads(line[len("STRESS-JSON ") :])
    raise RuntimeError(f"the kernel printed no result:\n{text[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", choices=("kernel", "script"), default="kernel")
    parser.add_argument("--runs", type=int, default=200, help="launches of tour and uneven each")
    parser.add_argument("--failing", type=int, default=100)
    parser.add_argument("--killed", type=int, default=100)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/stress_launch.json"))
    parser.add_argument("--day", type=int, default=0, metavar="N", help="a day of N steps")
    args = parser.parse_args()
    plan = _plan(args)
    start = time.monotonic()
    if args.day:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from day_in_kernel import run_day

        report = run_day(args.day)
        report.update(where="day", total_seconds=round(time.monotonic() - start, 1))
        _save(args.output, "day", report)
        print(json.dumps(report, indent=1))
        return
    if args.where == "kernel":
        report = run_in_kernel(plan, timeout=max(600, 3 * sum(plan.values())))
    else:
        report = run_here(plan)
    report.update(where=args.where, total_seconds=round(time.monotonic() - start, 1))
    report["leaks"] = {k: report["after"][k] - report["before"][k] for k in report["before"]}
    print(json.dumps(report, indent=1))
    _save(args.output, args.where, report)


def _save(path: str, key: str, report: dict) -> None:
    results = {}
    if os.path.exists(path):
        with open(path) as handle:
            results = json.load(handle)
    from provenance import stamp  # the date, commit and machine of this run

    report["provenance"] = stamp()
    results[key] = report
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)
        handle.write("\n")


if __name__ == "__main__":
    main()
