"""Warm empty ``%%distributed`` round trip on 2 ranks in a real kernel: nbaccel vs nbdistributed.

    .venv/bin/python benchmarks/bench_magics.py [--rounds 30]
    .venv/bin/python benchmarks/bench_magics.py --detached [--repeats 3]

For each tool, a fresh Jupyter kernel (nbclient) loads the extension, starts 2 workers, runs 5
warm-up cells, then measures ``rounds`` empty ``%%distributed`` cells two ways:

* cell: the kernel's busy period for the cell as the client saw it (``iopub.status.busy`` to
  ``iopub.status.idle``), i.e. everything the extension does for a cell, hooks included;
* magic: ``run_cell_magic("distributed", "", "pass")`` timed with ``perf_counter`` inside the
  kernel (the magic alone).

Each measured cell follows a plain ``pass`` cell in the same kernel (the kernel's own cost of a
cell, measured alternately, so that the two see the same machine: a plain cell's cost drifts by a
millisecond and more between kernels and minutes here); ``cell_minus_plain_ms_median`` is the
median of those pairwise differences.

nbdistributed (``pip install --no-deps nbdistributed``; its ``jupyter`` metapackage dependency is
not needed to run) starts its workers with ``python`` from PATH, so the venv's ``bin`` is put
first on the kernel's PATH. Writes ``benchmarks/results/magics.json``; nothing is asserted.

``--detached`` compares instead a detached pool's warm cell after ``%dist_attach`` (one kernel
starts ``%%distributed -n 2 --detach`` and ends; a second kernel attaches and is measured) with
a kernel's own pool, alternately, ``--repeats`` times each; it writes the medians of the
per-kernel medians and their ratio to ``benchmarks/results/magics_detached.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kernel import cell_text, run_notebook  # noqa: E402

_TIMED = (
    "%config InlineBackend.figure_format = 'png'\n"  # a leading magic: stays local in auto modes
    "import json, time\n"
    "_samples = []\n"
    "for _ in range({rounds}):\n"
    "    _t = time.perf_counter()\n"
    "    get_ipython().run_cell_magic('distributed', '', 'pass\\n')\n"
    "    _samples.append(time.perf_counter() - _t)\n"
    "print('SAMPLES', json.dumps(_samples))"
)

_PAUSE = "import time\ntime.sleep(1.0)"
_FIRST = 3 + 5  # the first measured cell: after load, start, pause and 5 warm-up cells

TOOLS = {
    "nbaccel": {"load": "%load_ext nbaccel", "start": "%%distributed -n {ranks}\npass", "stop": ""},
    "nbdistributed": {
        "load": "%load_ext nbdistributed",
        "start": "%dist_init -n {ranks}",
        "stop": "%dist_shutdown",
    },
}


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _busy_seconds(cell) -> float:
    timing = cell.metadata["execution"]
    return _stamp(timing["iopub.status.idle"]) - _stamp(timing["iopub.status.busy"])


def _peer_workers() -> set[psutil.Process]:
    """nbdistributed's worker processes: they outlive its kernel (``%dist_shutdown`` leaves
    them running, reparented to init), and a dozen of them left from earlier runs take
    gigabytes of memory and skew every later figure."""
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        if any("nbdistributed/worker.py" in part for part in process.info["cmdline"] or ()):
            found.add(process)
    return found


def _end(processes: set[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(list(processes), timeout=5)


def measure(tool: str, rounds: int, ranks: int = 2) -> dict:
    """One fresh kernel for ``tool``: pool start, then warm empty cells (also for the gate)."""
    spec = TOOLS[tool]
    empty = "%%distributed\npass"
    start = spec["start"].format(ranks=ranks)
    # Warm means settled: the pause lets the just-started workers (and nbaccel's fork server,
    # which tidies its memory once at its first idle moment, ~0.3 s of CPU) go quiet, as they
    # are when a person types the next cell; without it the first cells share the 2 cores.
    pairs = [cell for _ in range(rounds) for cell in ("pass", empty)]
    cells = [spec["load"], start, _PAUSE, *[empty] * 5, *pairs, _TIMED.format(rounds=rounds)]
    if spec["stop"]:
        cells.append(spec["stop"])
    if tool == "nbaccel":  # a warm pool restart
        cells.append("%dist_restart")
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    started = time.perf_counter()
    before = _peer_workers()
    try:
        nb = run_notebook(cells, timeout=300, env=env)
    finally:
        _end(_peer_workers() - before)
    wall = time.perf_counter() - started
    extra = {}
    if tool == "nbaccel":
        extra["warm_restart_cell_s"] = _busy_seconds(nb.cells[-1])
    return {
        **extra,
        **_figures(nb, rounds),
        "start_cell_s": _busy_seconds(nb.cells[1]),
        "notebook_wall_s": wall,
    }


def measure_detached(rounds: int, ranks: int = 2) -> dict:
    """A detached pool: one kernel starts it and ends; a fresh kernel attaches and measures."""
    import tempfile

    root = tempfile.mkdtemp(prefix="bench-pools-", dir="/tmp")
    env = {"NBACCEL_RUNS_DIR": root, "NBACCEL_SUPERVISOR_IDLE": "3"}
    start = f"%%distributed -n {ranks} --detach\npass"
    run_notebook(["%load_ext nbaccel", start], timeout=300, env=env, shutdown=True)
    empty = "%%distributed\npass"
    pairs = [cell for _ in range(rounds) for cell in ("pass", empty)]
    cells = ["%load_ext nbaccel", "%dist_attach", _PAUSE, *[empty] * 5, *pairs,
             _TIMED.format(rounds=rounds), "%dist_shutdown"]  # fmt: skip
    nb = run_notebook(cells, timeout=300, env=env, shutdown=True)
    return {**_figures(nb, rounds), "attach_cell_s": _busy_seconds(nb.cells[1])}


def _figures(nb, rounds: int) -> dict:
    """The warm-cell figures of a notebook laid out as ``measure`` lays it out."""
    text = cell_text(nb.cells[_FIRST + 2 * rounds])
    samples_line = next((line for line in text.splitlines() if line.startswith("SAMPLES ")), None)
    if samples_line is None:
        raise RuntimeError(f"no timing output: {text[-2000:]}")
    magic = json.loads(samples_line.split(" ", 1)[1])
    measured = nb.cells[_FIRST : _FIRST + 2 * rounds]
    plain = [_busy_seconds(c) for c in measured[0::2]]
    cell = [_busy_seconds(c) for c in measured[1::2]]
    errors = [c for c in nb.cells if any(o.output_type == "error" for o in c.outputs)]
    return {
        "plain_pass_cell_ms_median": statistics.median(plain) * 1e3,
        "cell_minus_plain_ms_median": statistics.median(c - p for c, p in zip(cell, plain)) * 1e3,
        "cell_ms_median": statistics.median(cell) * 1e3,
        "magic_ms_median": statistics.median(magic) * 1e3,
        "cell_ms": [round(s * 1e3, 3) for s in cell],
        "magic_ms": [round(s * 1e3, 3) for s in magic],
        "cells_with_errors": len(errors),
    }


def detached_main(rounds: int, repeats: int) -> None:
    """``--detached``: a detached pool after attach vs a kernel's own pool, alternately."""
    runs: dict[str, list[dict]] = {"own pool": [], "detached, attached": []}
    for _ in range(repeats):
        runs["own pool"].append(measure("nbaccel", rounds))
        runs["detached, attached"].append(measure_detached(rounds))
    keys = ("cell_ms_median", "magic_ms_median", "cell_minus_plain_ms_median")
    results: dict = {
        "benchmark": "warm empty %%distributed cell on 2 CPU ranks, real kernel: a detached "
        "pool after %dist_attach vs the kernel's own pool",
        "rounds": rounds,
        "repeats": repeats,
        "medians": {
            mode: {k: statistics.median(r[k] for r in found) for k in keys}
            for mode, found in runs.items()
        },
        "runs": runs,
    }
    ours, peer = results["medians"]["detached, attached"], results["medians"]["own pool"]
    results["ratio_cell"] = ours["cell_ms_median"] / peer["cell_ms_median"]
    results["ratio_magic"] = ours["magic_ms_median"] / peer["magic_ms_median"]
    from provenance import stamp

    results["provenance"] = stamp()
    out = ROOT / "benchmarks" / "results" / "magics_detached.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    for mode, data in results["medians"].items():
        print(f"{mode:20s} cell {data['cell_ms_median']:7.2f} ms   magic "
              f"{data['magic_ms_median']:7.2f} ms")  # fmt: skip
    print(f"detached / own: cell {results['ratio_cell']:.3f}, magic {results['ratio_magic']:.3f}")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--detached", action="store_true", help="a detached pool vs own pool")
    parser.add_argument("--repeats", type=int, default=3, help="kernels per mode (--detached)")
    args = parser.parse_args()
    if args.detached:
        detached_main(args.rounds, args.repeats)
        return
    results: dict = {
        "benchmark": "warm empty %%distributed cell on 2 CPU ranks, real kernel (nbclient)",
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "tools": {},
    }
    for tool in TOOLS:
        try:
            results["tools"][tool] = measure(tool, args.rounds)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            results["tools"][tool] = {"unavailable": f"{type(exc).__name__}: {exc}"[:2000]}
    ours, peer = results["tools"]["nbaccel"], results["tools"].get("nbdistributed", {})
    if "cell_ms_median" in ours and "cell_ms_median" in peer:
        results["ratio_cell"] = ours["cell_ms_median"] / peer["cell_ms_median"]
        results["ratio_magic"] = ours["magic_ms_median"] / peer["magic_ms_median"]
    out = ROOT / "benchmarks" / "results" / "magics.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from provenance import stamp  # the date, commit and machine of this run

    results["provenance"] = stamp()
    out.write_text(json.dumps(results, indent=2) + "\n")
    for tool, data in results["tools"].items():
        if "unavailable" in data:
            print(f"{tool:14s} unavailable: {data['unavailable'][:200]}")
        else:
            print(
                f"{tool:14s} cell {data['cell_ms_median']:7.2f} ms   magic "
                f"{data['magic_ms_median']:7.2f} ms   (start {data['start_cell_s']:.1f} s)"
            )
    if "ratio_cell" in results:
        print(
            f"nbaccel / nbdistributed: cell {results['ratio_cell']:.3f}, "
            f"magic {results['ratio_magic']:.3f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
