"""Run the lanes one after the other and print one table: lane, result, tests, seconds.

Run through ``scripts/test-lanes`` (``--help`` for the options). Each lane is its own
``scripts/test-<lane>`` command, run with no standard input in its own process group, its output
streamed as it comes. A lane that needs what this machine does not have (a CUDA GPU) is not
started: the table says skipped and why. ``--ci`` runs the lanes sized for CI (the low-bit lane
on a small Llama instead of the ~1B one) under a time limit each, and leaves out the lanes CI
cannot run, each with its reason. Exits 1 when a lane failed or ran past its limit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|error).*?)\s*=*$")
PROGRESS = re.compile(r"^[.sFExX]+(\s+\[\s*\d+%\])?$")  # pytest -q's dots: no verdict


def _no_gpu() -> str | None:
    """Why the GPU lane cannot run here, or None when a CUDA GPU answers."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "needs a CUDA GPU: no nvidia-smi on this machine"
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or "GPU" not in done.stdout:
        return "needs a CUDA GPU: nvidia-smi lists none"
    return None


def _not_root() -> str | None:
    return None if os.geteuid() == 0 else "needs root (network namespaces, sshd, slurmd)"


@dataclass
class Lane:
    name: str
    what: str
    needs: object = None  # () -> reason it cannot run here, or None
    ci_env: dict[str, str] = field(default_factory=dict)
    ci_limit_s: int = 900
    not_in_ci: str = ""  # why CI leaves it out ("" = CI runs it)
    ci_deselect: dict[str, str] = field(default_factory=dict)  # test id -> why CI leaves it out

    @property
    def command(self) -> list[str]:
        return ["bash", str(ROOT / "scripts" / f"test-{self.name}")]

    def argv(self, ci: bool) -> list[str]:
        """The command, less the tests CI leaves out (pytest's --deselect) when ``ci``."""
        extra = [arg for test in self.ci_deselect for arg in ("--deselect", test)] if ci else []
        return [*self.command, *extra]


#: where CI keeps DeepSpeed's JIT builds between runs on one machine (torch's own default is
#: ~/.cache/torch_extensions; a fresh clone's .torch-extensions/ would build them every run)
CI_EXTENSIONS = os.path.expanduser("~/.cache/nbaccel-torch-extensions")
#: the extras lane's venvs, one per extra (made once per machine; nbaccel reinstalled each run)
CI_EXTRAS_DIR = os.path.expanduser("~/.cache/nbaccel-extras")
#: and the torch-xla lane's venv (torch 2.9 with its CUDA libraries: a few GB to download)
CI_XLA_VENV = os.path.expanduser("~/.cache/nbaccel-xla-venv")

LANES = [
    Lane(
        "hosts",
        "ssh hosts in network namespaces (the Trainer in bf16 vs accelerate launch included)",
        _not_root,
        ci_limit_s=900,
    ),
    Lane("slurm", "one-node SLURM cluster", _not_root, ci_limit_s=420),
    Lane(
        "ray",
        "2-node Ray cluster on this machine (the Trainer in bf16 vs accelerate launch included)",
        ci_limit_s=900,
    ),
    Lane(
        "deepspeed",
        "DeepSpeed on 2 CPU ranks, long tests (JIT-built ops) included",
        ci_env={"TORCH_EXTENSIONS_DIR": CI_EXTENSIONS},
        ci_limit_s=1500,
    ),
    Lane(
        "hf",
        "Accelerate's launch contract; Trainer/PEFT/TRL vs accelerate launch; a detached Trainer",
        ci_env={"TORCH_EXTENSIONS_DIR": CI_EXTENSIONS},
        ci_limit_s=1200,
    ),
    Lane(
        "lowbit",
        "8-bit and nf4 Llama vs transformers (CI: the small Llama)",
        ci_env={"NBACCEL_LOWBIT_SIZE": "small"},
        ci_limit_s=420,
    ),
    Lane("parallel-8", "TP 2 x HSDP 2x2 on 8 ranks", ci_limit_s=600),
    Lane("browser", "JupyterLab + headless Chromium, docs screenshots", ci_limit_s=600),
    Lane(
        "xla",
        "torch-xla on the CPU device (first run: a few GB of wheels)",
        ci_env={"NBACCEL_XLA_VENV": CI_XLA_VENV},
        ci_limit_s=1800,
        not_in_ci=(
            "torch-xla pins its own torch: a fresh machine downloads a few GB of wheels (12.5 "
            "min here), which would take CI's run past its time budget's margin"
        ),
    ),
    Lane("gpu", "tests marked gpu + offload benchmark", _no_gpu, ci_limit_s=300),
    Lane(
        "extras",
        "each extra in a venv holding only nbaccel[<extra>], with its smoke check",
        # CI: the Ray extra (its venv made afresh costs about 8 minutes, the four together
        # about 26, which with the other lanes would come near CI's 90-minute budget); the
        # others run with `scripts/test-extras` before a release
        ci_env={"NBACCEL_EXTRAS_DIR": CI_EXTRAS_DIR, "NBACCEL_EXTRAS": "ray"},
        ci_limit_s=1200,
    ),
]


@dataclass
class Row:
    lane: str
    result: str
    detail: str
    seconds: float


def _run(lane: Lane, ci: bool) -> Row:
    env = {**os.environ, **(lane.ci_env if ci else {})}
    limit = lane.ci_limit_s if ci else None
    argv = lane.argv(ci)
    print(f"\n==== lane {lane.name}: {' '.join(argv)} ====", flush=True)
    for test, why in (lane.ci_deselect if ci else {}).items():
        print(f"(CI leaves out {test}: {why})", flush=True)
    start = time.monotonic()
    tail: deque[str] = deque(maxlen=200)
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    stopped = threading.Event()
    timer = threading.Timer(limit or 0, _stop_group, args=(proc, stopped))
    timer.daemon = True
    if limit is not None:
        timer.start()
    reader = threading.Thread(target=_relay, args=(proc.stdout, tail), daemon=True)
    reader.start()
    code = proc.wait()
    timer.cancel()
    reader.join(30)  # a process the lane left behind may hold its output open: not waited for
    timed_out = stopped.is_set()
    seconds = time.monotonic() - start
    detail = summary(tail)
    if timed_out:
        return Row(lane.name, "FAILED", f"ran past its {limit} s limit; {detail}", seconds)
    if code != 0:
        return Row(lane.name, "FAILED", f"exit code {code}; {detail}", seconds)
    if ci and lane.ci_deselect:
        detail += f" ({len(lane.ci_deselect)} left out in CI: see the lane's first lines)"
    return Row(lane.name, "passed", detail, seconds)


def _relay(stream, tail: deque[str]) -> None:
    """The lane's output, printed as it comes; its last lines kept for the verdict."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))


def _stop_group(proc: subprocess.Popen, stopped: threading.Event) -> None:
    """Past the limit: TERM the lane's process group (its traps take hosts down), then KILL."""
    stopped.set()
    print(f"\n(lanes: time limit reached, stopping process group {proc.pid})", flush=True)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def summary(lines: deque[str] | list[str]) -> str:
    """The lane's own verdict: its last pytest count line ('12 passed, 1 skipped'), else its last
    line saying passed or failed, else its last line."""
    for line in reversed(lines):
        match = SUMMARY.match(line.strip())
        if match:
            return re.sub(r"\s+in [\d.]+s.*$", "", match.group(1))
    said = [line.strip() for line in lines if line.strip() and not PROGRESS.match(line.strip())]
    for line in reversed(said):
        if re.search(r"passed|fail", line, re.IGNORECASE):
            return line[-160:]
    return said[-1][-160:] if said else "no verdict printed"


def _provenance(started: float) -> str:
    """When (this run's start), which commit and which machine; the load as the table prints."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL,
    ).stdout.strip() or "unknown"  # fmt: skip
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    start = datetime.datetime.fromtimestamp(started, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"started {start}; commit {commit}; {platform.node()}: {os.cpu_count()} cores, "
        f"{platform.system()} {platform.machine()}; load average at the start {load}"
    )


def table(rows: list[Row]) -> str:
    head = ("lane", "result", "seconds", "tests / reason")
    cells = [(r.lane, r.result, f"{r.seconds:.0f}", r.detail) for r in rows]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(3)]
    out = []
    for c in [head, *cells]:
        out.append("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3])
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lanes", nargs="*", help="lanes to run (default: all)")
    parser.add_argument("--ci", action="store_true", help="CI's lanes, sized and time-limited")
    parser.add_argument("--list", action="store_true", help="list the lanes and exit")
    args = parser.parse_args()
    known = {lane.name: lane for lane in LANES}
    if args.list:
        for lane in LANES:
            ci = f"not in CI: {lane.not_in_ci}" if lane.not_in_ci else "in CI"
            print(f"{lane.name:11} {lane.what} ({ci})")
            for test, why in lane.ci_deselect.items():
                print(f"{'':11} CI leaves out {test}: {why}")
        return 0
    unknown = [n for n in args.lanes if n not in known]
    if unknown:
        parser.error(f"unknown lane(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    head = _provenance(time.time())  # the commit the lanes run on, read before they run
    rows = run_lanes([known[n] for n in args.lanes] if args.lanes else LANES, args.ci)
    failed = sum(r.result == "FAILED" for r in rows)
    passed = sum(r.result == "passed" for r in rows)
    skipped = sum(r.result == "skipped" for r in rows)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n==== lanes ({head}; load average at the end {load}) ====")
    print(table(rows))
    print(f"lanes: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


def skip_reason(lane: Lane, ci: bool) -> str | None:
    """Why ``lane`` does not run here (what it needs and this machine lacks; CI leaving it out)."""
    reason = lane.needs() if callable(lane.needs) else None
    if reason is None and ci and lane.not_in_ci:
        reason = f"left out of CI: {lane.not_in_ci}"
    return reason


def run_lanes(lanes: list[Lane], ci: bool) -> list[Row]:
    """Each lane in turn, a row each: those that cannot run here are skipped with the reason."""
    rows: list[Row] = []
    for lane in lanes:
        reason = skip_reason(lane, ci)
        if reason is not None:
            print(f"\n==== lane {lane.name}: skipped: {reason} ====", flush=True)
            rows.append(Row(lane.name, "skipped", reason, 0.0))
            continue
        rows.append(_run(lane, ci))
    return rows


if __name__ == "__main__":
    sys.exit(main())
