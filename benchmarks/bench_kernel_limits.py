"""Two kernel-level figures of the reliability work, in a real Jupyter kernel (nbclient):

- restart: a kernel with nbaccel imported and a live ``%%distributed`` pool is asked to shut
  down (Jupyter's polite request, as the restart button does); seconds until it is gone, and
  whether its private temp folder is left. Compared with a plain kernel.
- flood: a ``%%distributed -n 2`` cell printing 200,000 lines per rank; seconds for the cell,
  characters shown in the notebook, and lines kept in the full log the notice names.

    .venv/bin/python benchmarks/bench_kernel_limits.py

Writes ``benchmarks/results/kernel_limits.json``. Never asserted in CI.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kernel import _kernel_manager, cell_text, run_notebook  # noqa: E402

FLOOD = "%%distributed -n 2\nfor i in range(200_000):\n    print(f'line {i}')\n"


async def _shutdown_seconds(cells: list[str]) -> tuple[float, int, list[str]]:
    with tempfile.TemporaryDirectory() as spec_root:
        manager = _kernel_manager(spec_root)
        await manager.start_kernel()
        client = manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        pid = manager.provisioner.process.pid
        for cell in cells:
            reply = await client.execute_interactive(cell, timeout=120)
            assert reply["content"]["status"] == "ok", reply
        manager.shutdown_wait_time = 30.0
        start = time.perf_counter()
        await manager.shutdown_kernel(now=False)
        took = time.perf_counter() - start
        client.stop_channels()
    return took, pid, glob.glob(os.path.join(tempfile.gettempdir(), f"nbaccel-{pid}-*"))


def restart() -> dict:
    plain, _, _ = asyncio.run(_shutdown_seconds(["x = 1"]))
    pool = ["%load_ext nbaccel", "%%distributed -n 2\nx = 1"]
    nbaccel, pid, left = asyncio.run(_shutdown_seconds(pool))
    return {"plain_kernel_s": round(plain, 2), "nbaccel_pool_s": round(nbaccel, 2), "left": left}


def flood() -> dict:
    cells = [
        "%load_ext nbaccel",
        "%%distributed -n 2\npass",  # the pool is up before the clock starts
        "import time\n_start = time.perf_counter()",
        FLOOD,
        "print('SECONDS', time.perf_counter() - _start)",
    ]
    with tempfile.TemporaryDirectory() as logs:
        nb = run_notebook(cells, timeout=600, env={"NBACCEL_LOG_DIR": logs})
        took = float(cell_text(nb.cells[4]).split("SECONDS", 1)[1].split()[0])
        text = cell_text(nb.cells[3])
        found = re.findall(r"the full output is in (\S+\.log)", text)
        with open(found[0]) as handle:
            logged = sum(1 for line in handle if "line " in line)
    return {
        "lines_printed": 400_000,
        "cell_seconds": round(took, 2),
        "chars_shown": len(text),
        "lines_in_log": logged,
    }


def main() -> None:
    report = {"restart": restart(), "flood": flood()}
    out = ROOT / "benchmarks" / "results" / "kernel_limits.json"
    from provenance import stamp  # the date, commit and machine of this run

    report["provenance"] = stamp()
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
