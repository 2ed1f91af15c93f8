#!/usr/bin/env python3
"""Execute the example notebooks into a folder, for the documentation's example pages.

    python scripts/docs_notebooks.py build/docs-notebooks

Each notebook of ``notebooks/`` runs top to bottom in a fresh kernel of this interpreter
(nbclient, the same runner as ``nbaccel.notebook.kernel.run_headless``): it launches real ranks
(2 CPU ranks each; the Ray notebook 4, on a local Ray it starts when ``RAY_ADDRESS`` names no
cluster; a few minutes for all of them on 2 cores). The executed copies are written to
the folder; ``scripts/docs`` points the site at it (``NBACCEL_DOCS_NOTEBOOKS``), so the pages show
the outputs. Notebooks that need a lane this machine may not have are not executed here and are
shown as stored: their pages say which lane runs them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat

from nbaccel.notebook.kernel.run_headless import execute_notebook

ROOT = Path(__file__).resolve().parents[1]
# notebook -> the lane that runs it (it needs more than one machine with a CPU)
NEEDS_A_LANE = {
    "many_hosts": "the hosts lane (sudo bash scripts/test-hosts)",
    "colab_kaggle_tpu": "the torch-xla lane (scripts/test-xla)",
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if path.stem in NEEDS_A_LANE:
            print(f"{path.name}: shown as stored (it runs in {NEEDS_A_LANE[path.stem]})")
            (out / path.name).unlink(missing_ok=True)
            continue
        started = time.monotonic()
        executed = execute_notebook(path, timeout=300, allow_errors=False)
        nbformat.write(executed, str(out / path.name))
        print(f"{path.name}: executed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
