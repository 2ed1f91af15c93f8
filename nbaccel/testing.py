"""Run a test function on N real processes (CPU, gloo) and report every rank's failure.

``run_on_ranks(fn, num_processes=2)`` starts fresh processes from a forkserver that has torch
preloaded (a launch costs a fork, not an ``import torch``), sets the torchrun-style variables,
calls ``fn(*args)`` on every rank and returns the per-rank results. If any rank fails, a
:class:`RankFailures` error carries every failing rank's traceback; a rank that hangs past
``timeout`` is killed and reported, so no test can hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from nbaccel.launch.plan import free_port

__all__ = ["RankFailures", "free_port", "run_on_ranks"]

_PRELOAD = [
    "torch",
    "torch.distributed",
    "nbaccel.distributed.state",
    "nbaccel.distributed.collectives",
]
_PEER_GRACE_S = 5.0


class RankFailures(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _death(exitcode: int | None) -> str:
    """Describe a process that exited without sending a result."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"process was killed by {name} (out of memory or a crash in native code?)"
    return f"process exited with code {exitcode} without a result"


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(payload: bytes, rank: int, env: dict[str, str], conn: Any) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    try:
        fn, args = cloudpickle.loads(payload)
        result = ("ok", cloudpickle.dumps(fn(*args)))
    except BaseException as exc:
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send(result)
    finally:
        conn.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_on_ranks(
    fn: Callable[..., Any],
    num_processes: int = 2,
    args: Sequence[Any] = (),
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``num_processes`` real ranks; return results indexed by rank.

    ``fn`` and ``args`` travel with cloudpickle. Ranks start from a forkserver, which imports the
    caller's ``__main__`` like ``spawn`` does: in a script, call this under
    ``if __name__ == "__main__":``. Raises :class:`RankFailures` naming every failing rank.
    """
    ctx = _context()
    payload = cloudpickle.dumps((fn, tuple(args)))
    base_env = {
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NBACCEL_CPU": "1",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs, conns = [], []
    for rank in range(num_processes):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(payload, rank, base_env, child_end), daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    results: list[Any] = [None] * num_processes
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    pending = set(range(num_processes))
    peer_failed = False
    while pending:
        for rank in sorted(pending):
            conn = conns[rank]
            if conn.poll(0.02):
                try:
                    status, value = conn.recv()
                except EOFError:
                    procs[rank].join(1.0)
                    status, value = "error", _death(procs[rank].exitcode)
                if status == "ok":
                    results[rank] = cloudpickle.loads(value)
                else:
                    failures[rank] = value
                pending.discard(rank)
            elif not procs[rank].is_alive() and not conn.poll(0):
                failures[rank] = _death(procs[rank].exitcode)
                pending.discard(rank)
        if failures and pending and not peer_failed:
            # A failed rank usually leaves its peers stuck in a collective: give them a moment.
            peer_failed = True
            deadline = min(deadline, time.monotonic() + _PEER_GRACE_S)
        if time.monotonic() > deadline:
            for rank in pending:
                failures[rank] = (
                    f"still running {_PEER_GRACE_S:.0f} s after another rank failed (killed)"
                    if peer_failed
                    else f"timed out after {timeout:g} s (killed)"
                )
            break
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    for conn in conns:
        conn.close()
    if failures:
        text = "\n".join(f"--- rank {rank} ---\n{msg}" for rank, msg in sorted(failures.items()))
        raise RankFailures(f"{len(failures)} of {num_processes} ranks failed:\n{text}")
    return results
