"""The first launch of fresh kernels, one after another: does each name the rank that exited?

Each round starts a new real Jupyter kernel (nbclient) and makes one launch in it, whose rank 1
calls ``os._exit(3)`` while rank 0 waits in a barrier. Rank 0 sees its peer vanish (gloo's
"Connection reset/closed by peer"); the notebook must still name the cause::

    .venv/bin/python benchmarks/first_launch_stress.py            # 20 fresh kernels
    .venv/bin/python benchmarks/first_launch_stress.py --kernels 50

Prints one line per kernel and the count named correctly; exits 1 if any was misnamed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from faults import FIRST_LAUNCH_CELLS, FIRST_LAUNCH_NAMED
from kernel import cell_text, run_notebook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=20, help="fresh kernels (default 20)")
    args = parser.parse_args()
    named = 0
    for index in range(args.kernels):
        started = time.monotonic()
        nb = run_notebook(FIRST_LAUNCH_CELLS)
        raised = [line for line in cell_text(nb.cells[2]).splitlines() if "RAISED" in line]
        ok = raised == [FIRST_LAUNCH_NAMED]
        named += ok
        shown = raised[0][:120] if raised else "(nothing raised)"
        print(f"kernel {index + 1:3d}: {time.monotonic() - started:5.1f} s  {shown}", flush=True)
    print(f"named the exited rank and its code: {named} of {args.kernels} fresh kernels")
    return 0 if named == args.kernels else 1


if __name__ == "__main__":
    sys.exit(main())
