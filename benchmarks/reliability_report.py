"""Each injected fault, what the user sees, time to report, leaks: results/reliability.json.

Run: .venv/bin/python benchmarks/reliability_report.py  (uses the same faults as
tests/ranks/test_reliability.py). The documentation's benchmark page renders the JSON
(scripts/bench_tables.py); the table is generated, never hand-edited.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from faults import FAULTS, succeed  # noqa: E402

from nbaccel import notebook_launcher  # noqa: E402
from nbaccel.launch.driver.renderer import Renderer  # noqa: E402
from nbaccel.launch.launchers.forkserver.launcher import get_forkserver  # noqa: E402


def _resources() -> tuple[int, int, int, int]:
    me = psutil.Process()
    workers = len(psutil.Process(get_forkserver().pid).children(recursive=True))
    shm = len([f for f in os.listdir("/dev/shm") if f.startswith("nbaccel-")])
    tmp = len([f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"nbaccel-{me.pid}-")])
    return workers, me.num_fds(), shm, tmp


def main() -> None:
    notebook_launcher(succeed, num_processes=2, renderer=Renderer())
    rows = []
    for name, (function, _, _) in FAULTS.items():
        before = _resources()
        start = time.monotonic()
        try:
            notebook_launcher(
                function,
                num_processes=2,
                renderer=Renderer(),
                timeout=1 if "timeout" in name else 30,
            )
            seen = "no error (unexpected)"
        except BaseException as exc:
            seen = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        took = time.monotonic() - start
        next_ok = notebook_launcher(succeed, num_processes=2, renderer=Renderer()) == ["ok"] * 2
        time.sleep(0.3)
        leaks = [a - b for a, b in zip(_resources(), before)]
        rows.append((name, seen, took, next_ok, leaks))
    from provenance import stamp  # the date, commit and machine of this run

    report = {
        "benchmark": "injected faults, 2 CPU ranks: rank 1 misbehaves while rank 0 runs or "
        "waits in a collective; leaks counted after each fault",
        "faults": [
            {
                "fault": name,
                "seen": seen,
                "seconds_to_report": round(took, 2),
                "next_launch_works": next_ok,
                "leaks": dict(zip(("procs", "fds", "shm", "tmp"), leaks)),
            }
            for name, seen, took, next_ok, leaks in rows
        ],
        "provenance": stamp(),
    }
    out = ROOT / "benchmarks" / "results" / "reliability.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
