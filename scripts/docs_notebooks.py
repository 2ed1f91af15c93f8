#!/usr/bin/env python3
"""Execute the example notebooks into a folder, for the documentation's example pages.

    python scripts/docs_notebooks.py build/docs-notebooks

Each notebook of ``notebooks/`` runs top to bottom in a fresh kernel of this interpreter
(nbclient, the same runner as ``nbaccel.notebook.kernel.run_headless``): it launches real ranks
(2 CPU ranks each; the Ray notebook 4, on a local Ray it starts when ``RAY_ADDRESS`` names no
cluster; a few minutes for all of them on 2 cores). The executed copies are written to
the folder; ``scripts/docs`` points the site at it (``NBACCEL_DOCS_NOTEBOOKS``), so the pages show
the outputs. Notebooks that need machines a docs build does not have (other hosts, a TPU) are not
executed: their pages show the code as stored, under a note that says what running them needs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_markdown_cell

from nbaccel.notebook.kernel.run_headless import execute_notebook

ROOT = Path(__file__).resolve().parents[1]
# notebook -> what running it needs, said on its page (shown without outputs)
NEEDS = {
    "many_hosts": "two or more machines that this one reaches with `ssh` (or a SLURM allocation)",
    "colab_kaggle_tpu": "a TPU runtime (Colab, Kaggle) or torch-xla installed",
}


def shown_as_stored(path: Path) -> nbformat.NotebookNode:
    """The notebook with a note under its title saying why its page has no outputs."""
    notebook = nbformat.read(str(path), as_version=4)
    note = (
        f"> **Shown without outputs.** Running this notebook needs {NEEDS[path.stem]}; "
        "the code is shown as it is, to read or to run on such machines."
    )
    notebook.cells.insert(1, new_markdown_cell(note))
    return notebook


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if path.stem in NEEDS:
            nbformat.write(shown_as_stored(path), str(out / path.name))
            print(f"{path.name}: shown without outputs (it needs {NEEDS[path.stem]})")
            continue
        started = time.monotonic()
        executed = execute_notebook(path, timeout=300, allow_errors=False)
        nbformat.write(executed, str(out / path.name))
        print(f"{path.name}: executed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
