"""Ranks on a Ray cluster from one notebook: first and warm launch, a warm pool cell, vs the same
ranks on this machine and vs Ray Train's ``TorchTrainer.fit()`` of the same function.

``.venv/bin/python benchmarks/bench_ray.py`` starts a 2-node Ray cluster on this machine (a head
and one more node, each ``ray start --block`` with its own folder and ports: ``tests/ray_cluster``;
stopped by its own handles at the end, never ``ray stop``), then in one real Jupyter kernel
(nbclient), all on that cluster and in the same run:

- launch-to-return of a no-op function on 4 ranks (2 per node, gloo): the first launch (it
  places the placement group, starts the keeper actors and each node's agent, which imports
  torch) and warm launches (the allocation kept warm by the first), vs the same 4 ranks on this
  machine (fork server), medians of REPEATS each, alternated;
- ``TorchTrainer(fn, ScalingConfig(num_workers=4)).fit()`` of the same no-op, first and again
  (each ``fit()`` starts its controller and worker actors anew; nbaccel's allocation released
  first so that Ray Train gets the same CPUs);
- a warm empty ``%%distributed`` cell on a pool of 4 Ray ranks (median of CELLS), vs a local pool.

Results go to benchmarks/results/ray.json with the date, commit and machine. Never run in CI.

``--first-step`` (:func:`measure_first_step`) times real work instead, on the same kind of
cluster: the workload of ``bench_first_step.py`` (the notebook imports torch and transformers;
the launched function builds a small Llama, prepares it with nbaccel's ``Accelerator`` and takes
3 AdamW steps), from the call to the last rank's first optimizer step:

- on 2 nodes x 1 rank and 2 nodes x 2 ranks (``ray_placement="spread"``), warm launches (the
  allocation, its agents and their fork servers kept from a first launch of the same shape)
  against the same ranks on this machine, alternated, medians of ``--repeats``;
- (e) 4 ranks on the 2 nodes: nbaccel's warm launch against Ray Train's
  ``TorchTrainer(fn, ScalingConfig(num_workers=4)).fit()`` running the same training function
  (from the ``fit()`` call to the last worker's first step; nbaccel's allocation released first
  so that Ray Train gets the same CPUs).

Results: benchmarks/results/ray_first_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_hosts import first_step_cells  # noqa: E402
from ray_cluster import RayCluster  # noqa: E402

REPEATS = 5
CELLS = 20

SETUP = """
import json, os, statistics, tempfile, time
import ray
from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
ADDRESS = {address!r}
def noop():
    return None
notebook_launcher(noop, num_processes=4, renderer=Renderer())  # warm the local fork server
"""

FIRST = """
t0 = time.perf_counter()
notebook_launcher(noop, num_processes=4, launcher="ray", ray_address=ADDRESS, renderer=Renderer())
first_s = time.perf_counter() - t0
"""

LAUNCH = """
ray_s, local_s = [], []
for _ in range({repeats}):
    t0 = time.perf_counter()
    notebook_launcher(noop, num_processes=4, launcher="ray", renderer=Renderer())
    ray_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    notebook_launcher(noop, num_processes=4, renderer=Renderer())
    local_s.append(time.perf_counter() - t0)
from nbaccel.launch.remote.ray.allocation import release_all
release_all()  # the CPUs go back to the cluster, for Ray Train
"""

TRAIN = """
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
storage = tempfile.mkdtemp()
train_s = []
for attempt in range(2):
    trainer = TorchTrainer(
        lambda config: None,
        scaling_config=ScalingConfig(num_workers=4, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name=f"noop-{attempt}"),
    )
    t0 = time.perf_counter()
    trainer.fit()
    train_s.append(time.perf_counter() - t0)
"""

POOL = """
from nbaccel.notebook.kernel import pool as pool_module
from nbaccel.launch.request import LaunchRequest
ip = get_ipython()
ip.run_line_magic("load_ext", "nbaccel")
cells = {{}}
for where, line in (("ray", f"--launcher ray --ray_address {{ADDRESS}} -n 4"), ("local", "-n 4")):
    t0 = time.perf_counter()
    ip.run_cell_magic("distributed", line, "pass\\n")
    start = time.perf_counter() - t0
    samples = []
    for _ in range({cells}):
        t0 = time.perf_counter()
        ip.run_cell_magic("distributed", "", "pass\\n")
        samples.append((time.perf_counter() - t0) * 1000)
    cells[where] = dict(start_s=start, cell_ms=statistics.median(samples), all_ms=samples)
    ip.run_line_magic("dist_shutdown", "")
print(json.dumps(dict(
    first_launch_s=first_s, warm_launch_s=statistics.median(ray_s),
    local_launch_s=statistics.median(local_s), warm_all=ray_s, local_all=local_s,
    train_fit_s=train_s, pool_start_s=cells["ray"]["start_s"],
    warm_cell_ms=cells["ray"]["cell_ms"], local_cell_ms=cells["local"]["cell_ms"],
    cell_all_ms=cells["ray"]["all_ms"])))
"""


FIRST_STEP_RUN = """
ADDRESS = {address!r}
RAY = dict(launcher="ray", ray_address=ADDRESS, ray_placement="spread")
wait_preloaded()  # the local fork server has imported the notebook's modules
local_first = first_step(2)
figures, first_launches = {{}}, {{}}
for name, n in (("2 nodes x 1 rank", 2), ("2 nodes x 2 ranks", 4)):
    # a new shape: its allocation, keepers and agents start (each agent imports torch and then
    # the notebook's modules); later launches of the shape take it warm
    first_launches[name] = first_step(n, **RAY)["first_step_s"]
    remote, local = [], []
    for _ in range({repeats}):
        remote.append(first_step(n, **RAY))
        local.append(first_step(n))
    figures[name] = summary(remote, local)
from nbaccel.launch.remote.ray.allocation import release_all
release_all()  # the CPUs go back to the cluster, for Ray Train

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
storage = tempfile.mkdtemp(dir="/var/tmp")
fits = []
for attempt in range({repeats}):
    folder = tempfile.mkdtemp(prefix="first-step-", dir="/var/tmp")
    trainer = TorchTrainer(
        lambda config: train(config["folder"]),
        train_loop_config={{"folder": folder}},
        scaling_config=ScalingConfig(num_workers=4, use_gpu=False,
                                     resources_per_worker={{"CPU": 1}}),
        run_config=RunConfig(storage_path=storage, name=f"first-step-{{attempt}}"),
    )
    called = time.time()
    trainer.fit()
    returned = time.time() - called
    out = [json.load(open(os.path.join(folder, f"rank{{i}}.json"))) for i in range(4)]
    shutil.rmtree(folder, ignore_errors=True)
    fits.append({{"first_step_s": max(r["first_step"] for r in out) - called,
                 "fit_s": returned, "imports_s": max(r["imports_s"] for r in out),
                 "losses": [r["losses"] for r in out], "load": os.getloadavg()[0]}})
shutil.rmtree(storage, ignore_errors=True)
four = figures["2 nodes x 2 ranks"]  # local: that shape's runs, 4 ranks
train_first = statistics.median(f["first_step_s"] for f in fits)
print(json.dumps(dict(
    first_local_launch_s=local_first["first_step_s"], first_launch_of_shape_s=first_launches,
    warm=figures,
    ray_train=dict(first_step_s=train_first,
                   first_step_all=[round(f["first_step_s"], 3) for f in fits],
                   fit_s=[round(f["fit_s"], 3) for f in fits],
                   worker_imports_s=max(f["imports_s"] for f in fits),
                   same_losses_as_nbaccel=fits[0]["losses"] == local[0]["losses"],
                   load=[round(f["load"], 2) for f in fits]),
    ratio_warm_4_ranks_to_ray_train=four["remote_s"] / train_first,
)))
"""


def measure_first_step(repeats: int = 3) -> dict:
    """Time to the first optimizer step of ``bench_first_step``'s workload on a 2-node Ray
    cluster started here: warm launches against the same ranks on this machine, and 4 ranks
    against Ray Train's ``TorchTrainer.fit()`` of the same function."""
    import ray

    loads = [os.getloadavg()[0]]
    with RayCluster(cpus=(3, 3)) as cluster:  # 6 CPUs: Ray Train's 4 workers and its controller
        run = FIRST_STEP_RUN.format(address=cluster.address, repeats=repeats)
        result = _run([*first_step_cells(), run], warm_up=True)
    loads.append(os.getloadavg()[0])
    result["repeats"] = repeats
    result["load_average"] = {"start": loads[0], "end": loads[1]}
    result["setup"] = (
        f"a 2-node Ray {ray.__version__} cluster on this machine (3 CPUs each), ranks x 1 CPU "
        "placed with ray_placement='spread', gloo; a small Llama (hidden 256, 2 layers, "
        "vocabulary 32000) prepared with nbaccel's Accelerator, 3 AdamW steps; local: the same "
        "ranks forked from the kernel's fork server; Ray Train: 4 workers x 1 CPU"
    )
    return result


def _run(sources: list[str], warm_up: bool = False) -> dict:
    """Run ``sources`` as the cells of one fresh kernel; the JSON its last cell printed.
    ``warm_up``: the kernel starts its fork server when nbaccel is imported, as a notebook's
    does."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in sources]
    env = {**os.environ, "NBACCEL_RENDERER": "text", "NBACCEL_NO_WARMUP": "1"}
    if warm_up:
        env.pop("NBACCEL_NO_WARMUP")
    env.pop("RAY_ADDRESS", None)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--first-step",
        action="store_true",
        help="time the first optimizer step of real work instead (ray_first_step.json)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="warm launches per shape")
    args = parser.parse_args()
    if args.first_step:
        import torch  # noqa: F401 - the stamp names its version
        from provenance import write_results

        write_results("ray_first_step.json", measure_first_step(args.repeats))
        return 0
    import ray

    with RayCluster(cpus=(3, 3)) as cluster:  # 6 CPUs: Ray Train's 4 workers and its controller
        result = _run(
            [
                SETUP.format(address=cluster.address),
                FIRST,
                LAUNCH.format(repeats=REPEATS),
                TRAIN,
                POOL.format(cells=CELLS),
            ]
        )
    result["ratio_warm_to_local"] = result["warm_launch_s"] / result["local_launch_s"]
    result["ratio_first_to_train_fit"] = result["first_launch_s"] / result["train_fit_s"][0]
    result["ratio_warm_to_train_fit"] = result["warm_launch_s"] / min(result["train_fit_s"])
    result["ratio_cell_to_local"] = result["warm_cell_ms"] / result["local_cell_ms"]
    from provenance import stamp  # the date, commit and machine of this run

    result["setup"] = (
        f"a 2-node Ray {ray.__version__} cluster on this machine (3 CPUs each), 4 ranks x 1 CPU, "
        "gloo; local: the same 4 ranks from the fork server"
    )
    result["provenance"] = stamp()
    path = ROOT / "benchmarks" / "results" / "ray.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
