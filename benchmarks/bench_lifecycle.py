"""How fast a launch ends when asked or when a rank dies, in a real Jupyter kernel (nbclient):

- stop: the stop button (Jupyter's interrupt: SIGINT to the kernel's process group) pressed
  while every rank of a launch or a ``%%distributed`` cell is busy: in Python code, asleep, or
  ignoring SIGINT (they honour SIGTERM); seconds from the press to the cell's reply.
- shutdown: a kernel with a live ``%%distributed`` pool asked to shut down (the restart
  button) against a plain kernel.
- chatty: a rank SIGKILLed while a process it started keeps writing to its stdout; seconds from
  the kill until the launch raises (in this process).

    .venv/bin/python benchmarks/bench_lifecycle.py [--repeat 3]

Writes ``benchmarks/results/lifecycle.json``. Never asserted in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kernel import _kernel_manager  # noqa: E402

# each rank writes MARKER-<rank> once busy: the button is pressed when every rank is
BUSY = {
    "python": "    while True:\n        sum(range(10_000))\n",
    "sleep": "    import time\n    time.sleep(3600)\n",
    "ignores_sigint": (
        "    import signal, time\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    while True:\n        time.sleep(0.01)\n"
    ),
}
_WORK = "def work():\n    import os\n    open(MARKER + '-' + os.environ['RANK'], 'w').close()\n"


async def _kernel(cells_then, spec_root):
    manager = _kernel_manager(spec_root)
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    await client.wait_for_ready(timeout=60)
    try:
        return await cells_then(manager, client)
    finally:
        manager.shutdown_wait_time = 5.0
        await manager.shutdown_kernel(now=False)
        client.stop_channels()


async def _stop_seconds(busy: str, front: str) -> float:
    marker = tempfile.mktemp(prefix="nbaccel-bench-")

    async def scenario(manager, client):
        work = _WORK.replace("MARKER", repr(marker)) + BUSY[busy]
        setup = ["%load_ext nbaccel", work]
        if front == "pool":
            setup.append("%%distributed -n 2\nx = 1")
            setup.append("%dist_push work")
            cell = "%%distributed\nwork()"
        else:
            cell = "from nbaccel import notebook_launcher\nnotebook_launcher(work, num_processes=2)"
        for source in setup:
            reply = await client.execute_interactive(source, timeout=120)
            assert reply["content"]["status"] == "ok", reply
        msg_id = client.execute(cell)
        waited = time.monotonic() + 120
        while not all(os.path.exists(f"{marker}-{rank}") for rank in (0, 1)):
            if time.monotonic() > waited:
                raise RuntimeError(f"the ranks of {front}/{busy} never got busy")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # busy for a moment
        for rank in (0, 1):
            os.unlink(f"{marker}-{rank}")
        start = time.perf_counter()
        await manager.interrupt_kernel()
        while True:
            msg = await client.get_shell_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id:
                return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as spec_root:
        return await _kernel(scenario, spec_root)


async def _shutdown_seconds(cells: list[str]) -> float:
    with tempfile.TemporaryDirectory() as spec_root:
        manager = _kernel_manager(spec_root)
        await manager.start_kernel()
        client = manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        for cell in cells:
            reply = await client.execute_interactive(cell, timeout=120)
            assert reply["content"]["status"] == "ok", reply
        manager.shutdown_wait_time = 30.0
        start = time.perf_counter()
        await manager.shutdown_kernel(now=False)
        took = time.perf_counter() - start
        client.stop_channels()
    return took


def _chatty_rank(record: str) -> None:
    import signal
    import subprocess

    if os.environ["RANK"] == "1":
        code = "import time\nwhile True:\n    print('chatter', flush=True)\n    time.sleep(0.01)"
        subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.5)
        with open(record, "w") as handle:
            handle.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def chatty_seconds() -> float:
    from nbaccel import notebook_launcher
    from nbaccel.launch.driver.renderer import Renderer

    with tempfile.TemporaryDirectory() as folder:
        record = os.path.join(folder, "killed")
        try:
            notebook_launcher(
                _chatty_rank, (record,), num_processes=2, timeout=30, renderer=Renderer()
            )
        except BaseException as exc:  # what was raised is part of the figure
            with open(record) as handle:
                took = time.time() - float(handle.read())
            print(f"  chatty child: {type(exc).__name__} after {took:.2f} s")
            return took
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lifecycle.json"))
    args = parser.parse_args()
    median = statistics.median
    results: dict = {"stop_s": {}}
    for front in ("launch", "pool"):
        for busy in BUSY:
            runs = [asyncio.run(_stop_seconds(busy, front)) for _ in range(args.repeat)]
            results["stop_s"][f"{front}/{busy}"] = round(median(runs), 2)
            print(f"stop {front}/{busy}: {median(runs):.2f} s  {[round(r, 2) for r in runs]}")
    plain = [asyncio.run(_shutdown_seconds(["x = 1"])) for _ in range(args.repeat)]
    pool = ["%load_ext nbaccel", "%%distributed -n 2\nx = 1"]
    with_pool = [asyncio.run(_shutdown_seconds(pool)) for _ in range(args.repeat)]
    results["shutdown_s"] = {
        "plain_kernel": round(median(plain), 2),
        "kernel_with_pool": round(median(with_pool), 2),
    }
    print("shutdown:", results["shutdown_s"])
    results["chatty_child_detect_s"] = round(
        median(chatty_seconds() for _ in range(args.repeat)), 2
    )
    print("chatty child:", results["chatty_child_detect_s"])
    from provenance import stamp  # the date, commit and machine of this run

    results["provenance"] = stamp()
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
