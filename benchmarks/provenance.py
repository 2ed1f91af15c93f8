"""Where a benchmark figure comes from: the date, the commit and the machine of the run.

Every benchmark stores ``stamp()`` under the key ``"provenance"`` of the JSON it writes to
``benchmarks/results/``; the documentation's benchmark tables (``scripts/bench_tables.py``) print
it beside the figures. Only the standard library is used, and torch when it is already imported.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def commit() -> str:
    """The checkout's commit, with ``+changes`` when tracked files differ from it."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "unknown (not a git checkout)"
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("+changes" if changed else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> str:
    """One line: CPU model and count, RAM, accelerators, torch and Python versions."""
    parts = [f"{os.cpu_count()} x {_cpu_model()}"]
    ram = _ram_gib()
    if ram is not None:
        parts.append(f"{ram:g} GiB RAM")
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_available():
            names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
            parts.append(f"{torch.cuda.device_count()} x {', '.join(sorted(names))}")
        else:
            parts.append("no GPU")
        parts.append(f"torch {torch.__version__}")
    parts.append(f"Python {platform.python_version()}, {platform.system()} {platform.machine()}")
    return "; ".join(parts)


def stamp() -> dict[str, str]:
    """``{"date", "commit", "machine"}`` of this run (the date in UTC, ISO 8601)."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {"date": now.isoformat(), "commit": commit(), "machine": machine()}


def write_results(name: str, result: dict) -> Path:
    """Stamp ``result`` (see :func:`stamp`) and write it to ``benchmarks/results/<name>``; print
    it and return the path."""
    import json

    result["provenance"] = stamp()
    path = Path(__file__).resolve().parent / "results" / name
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return path
