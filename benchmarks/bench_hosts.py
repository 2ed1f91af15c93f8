"""Many hosts from one notebook: launch, warm pool cell, interrupt and a killed host, timed.

Run as root with the hosts lane up (``sudo bash scripts/hosts/up 2``), then
``.venv/bin/python benchmarks/bench_hosts.py``. In one real Jupyter kernel (nbclient):

- launch-to-return of a no-op on 2 namespace hosts x 2 ranks over ssh: the first launch (it
  starts each host's agent, which imports torch) and warm launches (the agents kept from the
  first), vs the same 4 ranks on this machine (fork server), medians of REPEATS each, alternated;
- a warm empty ``%%distributed`` cell on a pool across the 2 hosts (median of CELLS);
- time from the stop button (SIGINT in the kernel) to the launch's return, every rank stopped;
- time from killing a host's agent (SIGKILL over ssh) to the error naming that host.

Results go to benchmarks/results/hosts.json. Never run in CI. ``measure_cross_host()`` measures
the launch figures alone (first, warm, one host, ratio) for ``benchmarks/gate``;
``hosts_lane_up()`` says whether it can run here.

``--first-step`` (:func:`measure_first_step`) times real work instead: the workload of
``bench_first_step.py`` (the notebook imports torch and transformers; the launched function
builds a small Llama, prepares it with nbaccel's ``Accelerator`` and takes 3 AdamW steps), from
the ``notebook_launcher`` call to the last rank's first optimizer step, on 2 hosts x 1 rank and
2 hosts x 2 ranks against the same ranks on this machine. The first launch on the hosts starts
their agents (each imports torch, then the notebook's modules); the warm launches after it are
measured against local launches of the same ranks, alternated, medians of ``--repeats``.
Results: benchmarks/results/hosts_first_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 5
CELLS = 20
HOSTS = ["nbh1:2", "nbh2:2"]
SSH_CONFIG = "/var/lib/nbaccel-hosts/ssh_config"

SETUP = f"""
import json, os, signal, statistics, subprocess, tempfile, threading, time
from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
HOSTS = {HOSTS!r}
def noop():
    return None
notebook_launcher(noop, num_processes=4, renderer=Renderer())  # warm the local fork server
"""

FIRST = """
t0 = time.perf_counter()
notebook_launcher(noop, num_processes=4, hosts=HOSTS, renderer=Renderer())  # starts the agents
first_s = time.perf_counter() - t0
"""

LAUNCH = """
remote_s, local_s = [], []
for _ in range({repeats}):
    t0 = time.perf_counter()
    notebook_launcher(noop, num_processes=4, hosts=HOSTS, renderer=Renderer())
    remote_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); notebook_launcher(noop, num_processes=4, renderer=Renderer())
    local_s.append(time.perf_counter() - t0)
print(json.dumps(dict(first_launch_s=first_s, warm_launch_s=statistics.median(remote_s),
                      one_host_s=statistics.median(local_s), warm_all=remote_s,
                      one_host_all=local_s)))
"""  # .format(repeats=...)

POOL = f"""
%load_ext nbaccel
t0 = time.perf_counter()
get_ipython().run_cell_magic("distributed", "--quiet --hosts " + ",".join(HOSTS), "x = 1")
pool_start_s = time.perf_counter() - t0
cell_s = []
for _ in range({CELLS}):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("distributed", "--quiet", "pass")
    cell_s.append(time.perf_counter() - t0)
get_ipython().run_line_magic("dist_shutdown", "")
"""

FAULTS = f"""
def sleeper(folder):
    import os, time
    open(os.path.join(folder, os.environ["RANK"]), "w").close()
    time.sleep(300)

def when_up(folder, action):
    def run():
        while len(os.listdir(folder)) < 4:
            time.sleep(0.05)
        time.sleep(0.5)
        action()
    threading.Thread(target=run, daemon=True).start()

marks = {{}}
folder = tempfile.mkdtemp(dir="/var/tmp")
def press_stop():
    marks["stop"] = time.perf_counter()
    os.kill(os.getpid(), signal.SIGINT)
when_up(folder, press_stop)
try:
    notebook_launcher(sleeper, (folder,), num_processes=4, hosts=HOSTS, renderer=Renderer())
except KeyboardInterrupt:
    interrupt_s = time.perf_counter() - marks["stop"]
left = [subprocess.run(["ssh", "-F", {SSH_CONFIG!r}, h.split(":")[0], "pgrep -c python || true"],
                       capture_output=True, text=True).stdout.strip() for h in HOSTS]

folder = tempfile.mkdtemp(dir="/var/tmp")
def kill_agent():
    marks["kill"] = time.perf_counter()
    subprocess.run(["ssh", "-F", {SSH_CONFIG!r}, "nbh2",
                    "pkill -KILL -f 'nbaccel[.]launch[.]remote[.]agent'"])
when_up(folder, kill_agent)
try:
    notebook_launcher(sleeper, (folder,), num_processes=4, hosts=HOSTS, renderer=Renderer())
except Exception as exc:
    lost_s = time.perf_counter() - marks["kill"]
    lost_error = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(dict(
    first_launch_s=first_s, remote_launch_s=statistics.median(remote_s),
    local_launch_s=statistics.median(local_s), remote_all=remote_s, local_all=local_s,
    pool_start_s=pool_start_s, warm_cell_ms=1000 * statistics.median(cell_s),
    interrupt_to_return_s=interrupt_s,
    python_on_hosts_after_interrupt=left,  # 2 each: the warm agent and its fork server
    killed_host_reported_s=lost_s, killed_host_error=lost_error[:300],
)))
"""


FIRST_STEP_LAYOUTS = {"2 hosts x 1 rank": ["nbh1:1", "nbh2:1"], "2 hosts x 2 ranks": HOSTS}

#: the helper every first-step benchmark's kernel defines (``bench_ray`` too): launch the
#: workload, read back each rank's figures (written to a folder every host sees)
FIRST_STEP_HELPER = """
import json, os, shutil, statistics, tempfile, time
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.launchers.forkserver.launcher import wait_preloaded

def first_step(n, **where):
    folder = tempfile.mkdtemp(prefix="first-step-", dir="/var/tmp")
    called = time.time()
    notebook_launcher(train, args=(folder,), num_processes=n, renderer=Renderer(), **where)
    out = [json.load(open(os.path.join(folder, f"rank{i}.json"))) for i in range(n)]
    shutil.rmtree(folder, ignore_errors=True)
    return {"first_step_s": max(r["first_step"] for r in out) - called,
            "imports_s": max(r["imports_s"] for r in out),
            "losses": [r["losses"] for r in out], "load": os.getloadavg()[0]}

def summary(remote, local):
    median = lambda runs: statistics.median(r["first_step_s"] for r in runs)
    return {"remote_s": median(remote), "local_s": median(local),
            "ratio": median(remote) / median(local),
            "remote_all": [round(r["first_step_s"], 3) for r in remote],
            "local_all": [round(r["first_step_s"], 3) for r in local],
            "rank_imports_s": max(r["imports_s"] for r in remote),
            "same_losses": all(a["losses"] == b["losses"] for a, b in zip(remote, local)),
            "load": [round(r["load"], 2) for r in remote + local]}
"""


def first_step_cells() -> list[str]:
    """The notebook's top (the launcher, torch and transformers imported, as
    ``bench_first_step.py`` does) and the launched function, with the helper."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_first_step import FUNCTION, IMPORTS

    return [
        "from nbaccel import notebook_launcher\n" + IMPORTS,
        FUNCTION.format(lib="nbaccel") + FIRST_STEP_HELPER,
    ]


FIRST_STEP_RUN = """
wait_preloaded()  # the local fork server has imported the notebook's modules
local_first = first_step({n0})
t0 = time.perf_counter()
remote_first = first_step({n0}, hosts={hosts0!r})  # starts the agents
agents_started_s = time.perf_counter() - t0
figures = {{}}
for name, hosts in {layouts!r}.items():
    n = sum(int(h.split(":")[1]) for h in hosts)
    remote, local = [], []
    for _ in range({repeats}):
        remote.append(first_step(n, hosts=hosts))
        local.append(first_step(n))
    figures[name] = summary(remote, local)
print(json.dumps(dict(first_launch_on_hosts_s=remote_first["first_step_s"],
                      first_local_launch_s=local_first["first_step_s"], warm=figures)))
"""


def measure_first_step(repeats: int = 3) -> dict:
    """Time to the first optimizer step of ``bench_first_step``'s workload, warm launches on
    the hosts lane against the same ranks on this machine, in one fresh kernel; needs the
    hosts lane (:func:`hosts_lane_up`)."""
    first = FIRST_STEP_LAYOUTS["2 hosts x 1 rank"]
    run = FIRST_STEP_RUN.format(
        n0=len(first), hosts0=first, layouts=FIRST_STEP_LAYOUTS, repeats=repeats
    )
    loads = [os.getloadavg()[0]]
    result = _run([*first_step_cells(), run], warm_up=True)
    loads.append(os.getloadavg()[0])
    result["repeats"] = repeats
    result["load_average"] = {"start": loads[0], "end": loads[1]}
    result["setup"] = (
        "hosts lane: network namespaces on this machine, sharing its cores; a small Llama "
        "(hidden 256, 2 layers, vocabulary 32000) prepared with nbaccel's Accelerator, 3 AdamW "
        "steps, gloo; the same ranks on this machine forked from the kernel's fork server"
    )
    return result


def hosts_lane_up() -> bool:
    """Whether the namespace hosts answer over ssh (``sudo bash scripts/hosts/up 2``)."""
    if not Path(SSH_CONFIG).is_file():
        return False
    probe = subprocess.run(
        ["ssh", "-F", SSH_CONFIG, HOSTS[0].split(":")[0], "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def _run(sources: list[str], warm_up: bool = False) -> dict:
    """Run ``sources`` as the cells of one fresh kernel; the JSON its last cell printed.
    ``warm_up``: the kernel starts its fork server when nbaccel is imported, as a notebook's
    does (else at its first local launch)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in sources]
    env = {**os.environ, "NBACCEL_RENDERER": "text", "NBACCEL_NO_WARMUP": "1"}
    if warm_up:
        env.pop("NBACCEL_NO_WARMUP")
    client = NotebookClient(nb, timeout=900, kernel_name="python3")
    with client.setup_kernel(env=env):
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
            errors = [o for o in cell.outputs if o.output_type == "error"]
            if errors:
                raise RuntimeError(
                    f"cell {index}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
                )
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return json.loads(out.strip().splitlines()[-1])


def measure_cross_host(repeats: int = REPEATS) -> dict:
    """First and warm launch of a no-op on 2 hosts x 2 ranks vs the same 4 ranks on this
    machine, in one fresh kernel: ``{first_launch_s, warm_launch_s, one_host_s,
    ratio_warm_to_one_host, ...}`` (warm and one host: medians of ``repeats``, alternated).
    Needs the hosts lane (:func:`hosts_lane_up`)."""
    result = _run([SETUP, FIRST, LAUNCH.format(repeats=repeats)])
    result["ratio_warm_to_one_host"] = result["warm_launch_s"] / result["one_host_s"]
    result["ratio_first_to_one_host"] = result["first_launch_s"] / result["one_host_s"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--first-step",
        action="store_true",
        help="time the first optimizer step of real work instead (hosts_first_step.json)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="warm launches per layout")
    args = parser.parse_args()
    if args.first_step:
        import torch  # noqa: F401 - the stamp names its version
        from provenance import write_results

        write_results("hosts_first_step.json", measure_first_step(args.repeats))
        return 0
    result = _run([SETUP, FIRST, LAUNCH.format(repeats=REPEATS), POOL, FAULTS])
    result["ratio_remote_to_local"] = result["remote_launch_s"] / result["local_launch_s"]
    result["machine"] = f"{os.cpu_count()} cores; hosts are network namespaces on this machine"
    path = ROOT / "benchmarks" / "results" / "hosts.json"
    from provenance import stamp  # the date, commit and machine of this run

    result["provenance"] = stamp()
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
