"""Execute a notebook headless in a real kernel and print what a user would see.

``python -m nbaccel.notebook.kernel.run_headless notebooks/quickstart.ipynb``
(``--output executed.ipynb`` keeps the result)
runs every cell with nbclient (a real IPython kernel of this interpreter), prints each cell's
source and outputs (streams, rich results as text, errors), and exits non-zero on an
unexpected error. The README's main command uses it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["execute_notebook", "main", "output_text"]


def execute_notebook(path: str | Path, timeout: int = 600, allow_errors: bool = True) -> Any:
    """Run ``path`` in a fresh kernel of this interpreter and return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=allow_errors,
        # output may trail a cell's reply on a busy machine: wait for it, never drop it
        iopub_timeout=60,
        raise_on_iopub_timeout=True,
        store_widget_state=True,
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    client.execute()
    return nb


def output_text(output: dict[str, Any]) -> str:
    """The text a user sees for one output (stream text, a result's text, or an error)."""
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind in ("execute_result", "display_data"):
        data = output.get("data", {})
        if "application/vnd.jupyter.widget-view+json" in data and kind == "display_data":
            return ""  # a live widget; nbaccel prints its text twin when the launch ends
        if "text/plain" in data:
            return data["text/plain"] + "\n"
        return f"<{', '.join(sorted(data))}>\n"
    if kind == "error":
        notes = "".join(f"{note}\n" for note in _error_notes(output))
        return f"{output.get('ename')}: {output.get('evalue')}\n{notes}"
    return ""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _error_notes(output: dict[str, Any]) -> list[str]:
    """The notes IPython prints under an error's last line (``add_note``: the rank a launch's
    failure came from, a hint), which the error's ``evalue`` does not hold."""
    lines = [_ANSI.sub("", line) for line in output.get("traceback", [])]
    head = f"{output.get('ename')}:"
    last = max((i for i, line in enumerate(lines) if line.startswith(head)), default=None)
    return [] if last is None else [line for line in lines[last + 1 :] if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--output", help="also save the executed notebook here")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    nb = execute_notebook(args.notebook, timeout=args.timeout)
    failed = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        # the kernel's execution count, the number its tracebacks name ("Cell In[4]")
        number = cell.get("execution_count") or " "
        print(f"\n\033[1mIn [{number}]:\033[0m " + cell.source.replace("\n", "\n         "))
        for output in cell.get("outputs", []):
            text = output_text(output)
            if output.get("output_type") == "error":
                text = "\n".join(output.get("traceback", [])) + "\n"
            sys.stdout.write(text)
            if output.get("output_type") == "error" and "raises-exception" not in cell.get(
                "metadata", {}
            ).get("tags", []):
                failed = True
    if args.output:
        import nbformat

        nbformat.write(nb, args.output)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
