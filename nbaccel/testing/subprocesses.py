"""Running launch commands and helper scripts from tests: the ``nbaccel launch`` command line,
subprocesses whose output is streamed and whose failure raises with stderr attached, paths to
files shipped inside the package, and a free port per test worker."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbaccel.testing.markers import device_count

__all__ = [
    "DEFAULT_LAUNCH_COMMAND",
    "SubprocessCallException",
    "execute_subprocess_async",
    "get_launch_command",
    "get_torch_dist_unique_port",
    "path_in_accelerate_package",
    "path_in_nbaccel_package",
    "pytest_xdist_worker_id",
    "run_command",
]

_PACKAGE = Path(__file__).resolve().parent.parent
# Accelerate's test-utils folders, as they are laid out in nbaccel.
_RELOCATED = {("test_utils", "scripts"): ("testing", "scripts"), ("test_utils",): ("testing",)}


def path_in_nbaccel_package(*components: str) -> Path:
    """A path inside the installed nbaccel package (``test_utils/scripts/...`` is found under
    ``testing/scripts``)."""
    parts = tuple(components)
    for old, new in _RELOCATED.items():
        if parts[: len(old)] == old:
            parts = new + parts[len(old) :]
            break
    return _PACKAGE.joinpath(*parts)


path_in_accelerate_package = path_in_nbaccel_package


def get_launch_command(**kwargs: Any) -> list[str]:
    """``["nbaccel", "launch", "--key=value", ...]``; a True value gives a bare ``--key``."""
    command = ["nbaccel", "launch"]
    for key, value in kwargs.items():
        if isinstance(value, bool):
            if value:
                command.append(f"--{key}")
        elif value is not None:
            command.append(f"--{key}={value}")
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count, monitor_interval=0.1)


class SubprocessCallException(Exception):
    """A command run by :func:`run_command` failed; the message holds its output."""


def run_command(
    command: list[str], return_stdout: bool = False, env: dict[str, str] | None = None
) -> Any:
    """Run ``command``; raise :class:`SubprocessCallException` with its output on failure."""
    command = [str(c) for c in command]
    if command and command[0] == "python":
        command[0] = sys.executable
    try:
        output = subprocess.check_output(command, stderr=subprocess.STDOUT, env=env)
    except subprocess.CalledProcessError as exc:
        raise SubprocessCallException(
            f"Command `{' '.join(command)}` failed with:\n{exc.output.decode(errors='replace')}"
        ) from exc
    if return_stdout:
        return output.decode("utf-8", errors="replace") if hasattr(output, "decode") else output
    return None


@dataclass
class _RunOutput:
    returncode: int
    stdout: list[str]
    stderr: list[str]


async def _pump(stream: asyncio.StreamReader, sink: list[str], echo: Any) -> None:
    while True:
        line = await stream.readline()
        if not line:
            return
        text = line.decode("utf-8", errors="replace").rstrip()
        sink.append(text)
        if echo is not None:
            print(text, file=echo)


async def _run(
    cmd: list[str], env: Any, stdin: Any, timeout: float, quiet: bool, echo: bool
) -> _RunOutput:
    if echo:
        print("\nRunning:", " ".join(shlex.quote(str(c)) for c in cmd))
    process = await asyncio.create_subprocess_exec(
        str(cmd[0]), *[str(c) for c in cmd[1:]], stdin=stdin, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out: list[str] = []
    err: list[str] = []
    try:
        await asyncio.wait_for(
            asyncio.gather(
                _pump(process.stdout, out, None if quiet else sys.stdout),
                _pump(process.stderr, err, None if quiet else sys.stderr),
            ),
            timeout=timeout,
        )
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise
    return _RunOutput(await process.wait(), out, err)


def execute_subprocess_async(
    cmd: list,
    env: dict[str, str] | None = None,
    stdin: Any = None,
    timeout: float = 180,
    quiet: bool = False,
    echo: bool = True,
) -> _RunOutput:
    """Run ``cmd`` streaming its output; a non-zero exit raises RuntimeError with its stderr."""
    cmd = [str(c) for c in cmd]
    if cmd and cmd[0] == "nbaccel":  # the console script of this very interpreter
        cmd = [sys.executable, "-m", "nbaccel", *cmd[1:]]
    result = asyncio.run(_run(cmd, env, stdin, timeout, quiet, echo))
    if result.returncode != 0:
        raise RuntimeError(
            f"'{' '.join(cmd)}' failed with returncode {result.returncode}\n\n"
            f"The combined stderr from workers follows:\n" + "\n".join(result.stderr)
        )
    return result


def pytest_xdist_worker_id() -> int:
    """The pytest-xdist worker number (0 without xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw") or 0)


def get_torch_dist_unique_port() -> int:
    """A rendezvous port per xdist worker: 29500 + worker id."""
    return 29500 + pytest_xdist_worker_id()
