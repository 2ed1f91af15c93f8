"""A warm pool call on N ranks after an idle gap, against the bare round trip of N processes.

    .venv/bin/python benchmarks/bench_call_path.py [--ranks 8] [--seconds 4]

Why: a `%%distributed` cell's call follows seconds (a person) or milliseconds (the gate's
back-to-back cells) of idle cores, and on these VMs a call's cost depends on that gap far more
than on its code: the same 8-rank call takes ~0.45 ms back to back and ~1.5 ms after 50 ms
idle, with every process's CPU per call growing alike. This separates the two:

* pool: ``Pool.run_cell("pass")`` on a warm pool, after gaps of 0, 3, 10 and 50 ms; wall time
  (median) and CPU per call of the notebook's process and of the ranks (all their threads,
  less what they use idle);
* floor: the same gaps for N forked processes (torch imported, as ranks have) that echo 200
  bytes over a socket pair: what waking N processes and hearing back costs with no Python of
  ours on either side;
* lean: the same processes speaking the smallest Python call protocol (the notebook pickles
  ``(call, id, source)`` once and sends it to each; a process unpickles it, ``exec``s the
  source in its namespace and sends back a pickled ``(result, id, None)``): what a pool call
  could cost with no duties (memory sample, flush, stop button, output, crash watch) and no
  engine around it. The pool's distance from this row is our protocol's cost.

Writes ``benchmarks/results/call_path.json``; nothing is asserted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import platform
import selectors
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GAPS = (0.0, 0.003, 0.01, 0.05)


def _cpu(pids: list[int]) -> float:
    """CPU seconds used so far by every thread of ``pids``, from the scheduler's own clock
    (``schedstat``: ``stat``'s tick-sampled times misattribute short wake-ups that fall on a
    tick, as gloo's 10 ms timer does)."""
    total = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                    total += int(handle.read().split()[0])
            except FileNotFoundError:
                continue
    return total / 1e9


def _idle_rate(pids: list[int], seconds: float = 2.0) -> float:
    """CPU seconds per second the processes use with no call (gloo's loop thread wakes every
    10 ms in each rank): taken out of the per-call figures, which would grow with the gap."""
    before = _cpu(pids)
    time.sleep(seconds)
    return (_cpu(pids) - before) / seconds


def _measure(call, pids: list[int], seconds: float) -> dict[str, dict[str, float]]:
    out = {}
    idle = _idle_rate(pids)
    for gap in GAPS:
        rounds = max(20, int(seconds / (gap + 0.002)))
        own, theirs, walls = _cpu([os.getpid()]), _cpu(pids), []
        begun = time.perf_counter()
        for _ in range(rounds):
            if gap:
                time.sleep(gap)
            started = time.perf_counter()
            call()
            walls.append(time.perf_counter() - started)
        out[f"{gap * 1e3:g} ms"] = {
            "wall_ms": statistics.median(walls) * 1e3,
            "notebook_cpu_ms": (_cpu([os.getpid()]) - own) / rounds * 1e3,
            "ranks_cpu_ms": (_cpu(pids) - theirs - idle * (time.perf_counter() - begun))
            / rounds
            * 1e3,
        }
    out["idle_ranks_cpu_ms_per_s"] = idle * 1e3
    return out


def _pool(ranks: int, seconds: float) -> dict:
    from nbaccel.notebook.kernel import pool as pool_module

    pool = pool_module.start_pool(num_processes=ranks)
    try:
        for _ in range(20):
            pool.run_cell("pass\n")
        time.sleep(1.0)  # the fork server's first idle moment tidies its memory
        return _measure(lambda: pool.run_cell("pass\n"), list(pool.pids.values()), seconds)
    finally:
        pool_module.shutdown_pool()


def _echo(far: socket.socket) -> None:
    while data := far.recv(65536):
        far.sendall(data)


def _lean(far: socket.socket) -> None:
    namespace: dict = {}
    while data := far.recv(65536):
        _, call_id, source = pickle.loads(data)
        exec(compile(source, "<lean-cell>", "exec"), namespace)
        far.sendall(pickle.dumps(("result", call_id, None)))


def _bare(ranks: int, seconds: float, serve, message, decode) -> dict:
    """``ranks`` forked processes running ``serve`` on their end of a socket pair; a call sends
    ``message(call_id)`` to each and waits until each has answered (``decode`` reads it)."""
    import torch  # noqa: F401  (the children's memory looks like a rank's)

    ends, pids = [], []
    for _ in range(ranks):
        near, far = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            near.close()
            serve(far)
            os._exit(0)
        far.close()
        ends.append(near)
        pids.append(pid)
    selector = selectors.DefaultSelector()
    for end in ends:
        selector.register(end, selectors.EVENT_READ)
    call_ids = itertools.count()

    def call() -> None:
        frame = message(next(call_ids))
        for end in ends:
            end.sendall(frame)
        heard = 0
        while heard < ranks:
            for key, _ in selector.select():
                decode(key.fileobj.recv(65536))
                heard += 1

    try:
        time.sleep(1.0)
        return _measure(call, pids, seconds)
    finally:
        for end in ends:
            end.close()
        for pid in pids:
            os.waitpid(pid, 0)


def _call_frame(call_id: int) -> bytes:
    return pickle.dumps(("call", call_id, "pass\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="per gap and side")
    args = parser.parse_args()
    results = {
        "benchmark": f"warm pool call on {args.ranks} ranks after idle gaps, vs a lean protocol "
        "and a bare echo",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "pool": _pool(args.ranks, args.seconds),
        "floor": _bare(args.ranks, args.seconds, _echo, lambda _: b"x" * 200, len),
        "lean": _bare(args.ranks, args.seconds, _lean, _call_frame, pickle.loads),
    }
    out = ROOT / "benchmarks" / "results" / "call_path.json"
    from provenance import stamp  # the date, commit and machine of this run

    results["provenance"] = stamp()
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("wall (median) and CPU per call, notebook / ranks, in ms")
    print(f"{'gap':>6}  {'pool':>19}  {'lean protocol':>19}  {'floor (echo)':>19}")
    for gap in (f"{g * 1e3:g} ms" for g in GAPS):
        cells = [
            f"{r['wall_ms']:5.3f} ({r['notebook_cpu_ms']:4.2f}/{r['ranks_cpu_ms']:4.2f})"
            for r in (results[side][gap] for side in ("pool", "lean", "floor"))
        ]
        print(f"{gap:>6}  " + "  ".join(f"{c:>19}" for c in cells))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
