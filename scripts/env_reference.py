#!/usr/bin/env python3
"""The environment variables' reference page: every ``NBACCEL_*`` name the code reads or sets.

    python scripts/env_reference.py     # print the Markdown page

The docs build calls :func:`render` (``scripts/docs_hooks.py``). The names are collected from
the source of ``nbaccel/`` (every ``NBACCEL_...`` string, with the modules it appears in); what
each does is said in ``_MEANINGS``. A name found in the code that ``_MEANINGS`` does not
describe, or one described that the code no longer holds, is an error that fails the build, so
the page cannot fall behind the code.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nbaccel"

__all__ = ["MEANING", "collect", "render"]

# What each variable does, one entry a paragraph: "NAME (setting)" for what a user may set,
# "NAME (set)" for what nbaccel sets in its ranks; the lines below it are the description.
_MEANINGS = """
NBACCEL_DEBUG_MODE (setting)
    `true`: collectives first compare the shapes every rank passes and fail naming the mismatch
    (Accelerate's `ACCELERATE_DEBUG_MODE` works too).

NBACCEL_LOG_LEVEL (setting)
    The level of nbaccel's rank-aware loggers (`get_logger`); `ACCELERATE_LOG_LEVEL` works too.

NBACCEL_TORCH_DEVICE (setting)
    Force the torch device the state objects pick (`cuda:1`, `cpu`); `ACCELERATE_TORCH_DEVICE`
    works too.

NBACCEL_USE_FSDP (setting)
    `true`: an `Accelerator` without a plugin takes its FSDP options from the `FSDP_*` variables
    (set by `nbaccel launch --use_fsdp`; `ACCELERATE_USE_FSDP` works too).

NBACCEL_USE_DEEPSPEED (setting)
    `true`: an `Accelerator` without a plugin takes its DeepSpeed options from the environment
    (set by `nbaccel launch --use_deepspeed`; `ACCELERATE_USE_DEEPSPEED` works too).

NBACCEL_DEEPSPEED_SHM (setting)
    `1`: let DeepSpeed use its shared-memory CPU communication backend on CPU ranks (off by
    default).

NBACCEL_FP8_EMULATE (setting)
    `1`: FP8 training is emulated (torchao) on a GPU without FP8 instead of refused before the
    launch.

NBACCEL_INIT_INCLUDE_BUFFERS (setting)
    `true`: `init_empty_weights()` puts buffers on the meta device too (its `include_buffers`
    default).

NBACCEL_RENDERER (setting)
    `text` or `widgets`: force how a launch shows itself in the notebook (default: widgets where
    the front end shows them).

NBACCEL_LIVE_VIEWS (setting)
    How many launch views stay live in the notebook (default 3); older ones are replaced by
    their final text.

NBACCEL_LOG_DIR (setting)
    Where the full logs of every rank go (default: `<tmp>/nbaccel-logs-<uid>`).

NBACCEL_LOG_BUDGET_MB (setting)
    The most a process's full log may hold on disk, in MB (default 256); past it the log says
    what was left out.

NBACCEL_KEEP_LOGS (setting)
    `1`: keep the full logs when the kernel exits (removed by default).

NBACCEL_RUNS_DIR (setting)
    Where detached runs keep their folders and their supervisor's socket (default:
    `~/.nbaccel/runs`); private to its user (mode 0700).

NBACCEL_RUN_LOG_MB (setting)
    The most one detached run's journal (its lines and events) may hold on disk, in MB
    (default 512); past it, later lines are dropped, once announced, and counted.

NBACCEL_SUPERVISOR_IDLE (setting)
    Seconds the supervisor of detached runs waits without a run before it exits (default 600).

NBACCEL_RUNS_MAX_AGE_DAYS (setting)
    Set in the environment that starts the supervisor: it removes the folders of detached runs
    that ended more than this many days ago, at start and hourly (default: never).

NBACCEL_SHM_DIR (setting)
    The folder (on a tmpfs) for tensors shared with the ranks (default: `/dev/shm`).

NBACCEL_HUGE_PAGES (setting)
    `0`: the fork server does not collapse its memory into huge pages.

NBACCEL_KEEP_FREED_MEMORY (setting)
    `0`: ranks keep glibc's own malloc thresholds instead of keeping freed memory (blocks under
    8 MiB from the heap, up to 32 MiB free kept at its top) for their next step.

NBACCEL_PRELOAD (setting)
    What ranks start with imported besides torch, when a launch does not pass `preload=`:
    `auto` (default: in a notebook kernel, the libraries it imported, preloaded in the fork
    server), `on`, `off`, module names to add (`peft,mylib`), `-name` to keep one out.

NBACCEL_NO_WARMUP (setting)
    `1`: `import nbaccel` in a kernel does not start the fork server in the background (it
    starts at the first launch).

NBACCEL_DETACH (setting)
    `1` in the environment of a process a rank starts: the process is meant to outlive the
    launch and is not stopped with it.

NBACCEL_REMOTE_PYTHON (setting)
    The Python interpreter on other hosts (ssh, SLURM) when `python=` is not given.

NBACCEL_XLA_LAUNCH (setting)
    `1`: `notebook_launcher` takes the torch-xla path even where no TPU is detected.

NBACCEL_XLA_CACHE (setting)
    The folder of torch-xla's persistent compile cache (default `$XDG_CACHE_HOME/nbaccel/xla`);
    `off` turns it off.

NBACCEL_LAUNCHER (set)
    In a rank: which launcher started it (also how a rank knows it is one).

NBACCEL_FORK_LAUNCHED (set)
    In a rank: `1` when it was forked by the fork server.

NBACCEL_INIT_METHOD (set)
    In a rank: the process group's rendezvous (`env://` by default; a private file store for
    local launches).

NBACCEL_PERSISTENT_GROUP (set)
    In a `%%distributed` pool's ranks: `1`, the process group outlives each cell.

NBACCEL_HOST (set)
    In a rank on another host: that host's name as the launch knows it.

NBACCEL_XLA_PROCESS (set)
    In a torch-xla rank: its local index.

NBACCEL_AGENT_CONFIG (set)
    In a SLURM step: the agent's configuration (keys included), read and removed by the agent
    before anything starts.
"""


def _parse(text: str) -> dict[str, tuple[str, str]]:
    """``_MEANINGS`` as name -> (kind, description)."""
    meaning = {}
    for block in text.strip().split("\n\n"):
        head, _, body = block.partition("\n")
        name, _, kind = head.partition(" (")
        meaning[name] = (kind.rstrip(")"), " ".join(body.split()))
    return meaning


MEANING = _parse(_MEANINGS)

_NAME = re.compile(r"NBACCEL_[A-Z0-9_]*")


def collect() -> dict[str, list[str]]:
    """Every ``NBACCEL_*`` name in ``nbaccel/``'s source -> the modules it appears in."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for name in _NAME.findall(path.read_text()):
            if name == "NBACCEL_":  # the bare prefix (``f"NBACCEL_{name}"``), not a variable
                continue
            found.setdefault(name, set()).add(module)
    return {name: sorted(modules) for name, modules in sorted(found.items())}


def render() -> str:
    """The Markdown page; ValueError when the code and ``_MEANINGS`` disagree."""
    found = collect()
    missing = sorted(set(found) - set(MEANING))
    stale = sorted(set(MEANING) - set(found))
    if missing or stale:
        problems = [f"describe {name} in _MEANINGS (the code uses it)" for name in missing]
        problems += [f"remove {name} from _MEANINGS (no longer in the code)" for name in stale]
        raise ValueError("scripts/env_reference.py: " + "; ".join(problems))
    lines = [
        "# Environment variables",
        "",
        "Every `NBACCEL_*` variable nbaccel reads or sets, collected from its source when the "
        "site is built. Options of a launch are better given as keywords or flags "
        "([launch options](launch-options.md)); these are for what a launch does not take, and "
        "for scripts started by `nbaccel launch`. Where Accelerate has the same variable "
        "(`ACCELERATE_*`), both are read. The settings of a launch reach the ranks as "
        "Accelerate's own variables (`ACCELERATE_MIXED_PRECISION`, `ACCELERATE_USE_CPU`, "
        "`FSDP_*`, ...): see [Accelerate's launch environment](../launching.md"
        "#accelerates-launch-environment).",
        "",
    ]
    for kind, title in (("setting", "Settings"), ("set", "Set by nbaccel in its ranks")):
        lines += [f"## {title}", "", "| variable | what | read or set in |", "|---|---|---|"]
        for name, modules in found.items():
            if MEANING[name][0] != kind:
                continue
            shown = f"`{name}*`" if name.endswith("_") else f"`{name}`"
            where = ", ".join(f"`{m}`" for m in modules)
            lines.append(f"| {shown} | {MEANING[name][1]} | {where} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
