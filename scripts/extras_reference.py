#!/usr/bin/env python3
"""The install page's table of extras, generated from ``pyproject.toml``.

    python scripts/extras_reference.py     # print the Markdown table

The docs build puts :func:`render` where ``install.md`` says ``{{ extras }}``
(``scripts/docs_hooks.py``): each extra of ``[project.optional-dependencies]``, the packages it
brings, and what it enables, read from the comment written beside the extra (or on the lines
just above it) in ``pyproject.toml``. An extra added there appears without editing the page.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

__all__ = ["MARKER", "extras", "render"]

#: what install.md holds where the table goes
MARKER = "{{ extras }}"


def _section(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("[project.optional-dependencies]") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    return lines[start:end]


def extras(text: str | None = None) -> dict[str, tuple[list[str], str]]:
    """Extra -> (the requirements it lists, its comment) from ``pyproject.toml``'s text."""
    lines = _section(PYPROJECT.read_text() if text is None else text)
    found: dict[str, tuple[list[str], str]] = {}
    above: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        head = re.match(r"^([a-z0-9_-]+)\s*=\s*\[(.*)$", line)
        if head is None:
            stripped = line.strip()
            above = [*above, stripped.lstrip("# ")] if stripped.startswith("#") else []
            i += 1
            continue
        body, _, comment = head.group(2).partition("#")
        block = [body]
        while "]" not in re.sub(r'"[^"]*"', "", block[-1]) and i + 1 < len(lines):
            i += 1
            block.append(lines[i].split("#", 1)[0])
        requirements = re.findall(r'"([^"]+)"', " ".join(block))
        found[head.group(1)] = (requirements, comment.strip() or " ".join(above))
        above = []
        i += 1
    return found


def render() -> str:
    """The Markdown table: extra, what to install, what it brings, what it enables."""
    rows = ["| extra | install | brings | enables |", "|---|---|---|---|"]
    for name, (requirements, comment) in extras().items():
        brings = ", ".join(f"`{r}`" for r in requirements)
        rows.append(f'| `{name}` | `pip install ".[{name}]"` | {brings} | {comment} |')
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
