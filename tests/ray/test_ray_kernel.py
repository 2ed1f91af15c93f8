"""From a real kernel, ranks on a real 2-node Ray cluster on this machine.

One cluster and one kernel for the whole story (a cluster costs about 20 s, a first placement as
much): 4 ranks all-reduce over gloo across the nodes and return their values, labelled with rank
and node; a warm second launch; a rank's ValueError comes back as ValueError naming rank and
node; a ``%%distributed`` pool keeps state across cells and shuts down clean; a node killed
mid-launch (its raylet SIGKILLed) is named with its ranks, and nothing of the launch stays on the
cluster (actors, placement groups, reserved CPUs).
"""

from __future__ import annotations

import ast
import re

import pytest
from kernel import cell_errors, cell_text, run_notebook
from ray_cluster import RayCluster

SETUP = """
import os, time, threading, json
import ray
from nbaccel import notebook_launcher
ADDRESS = {address!r}
KILL_PORT = {kill_port}

def reduce_and_report(x):
    import os
    import torch
    import torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()
    t = torch.tensor([float(state.process_index + 1)])
    dist.all_reduce(t)
    print(f"local {{os.environ['LOCAL_RANK']}} of {{os.environ['LOCAL_WORLD_SIZE']}} "
          f"on node {{os.environ['NODE_RANK']}}", flush=True)
    return (state.process_index, int(os.environ["LOCAL_RANK"]), int(os.environ["NODE_RANK"]),
            int(os.environ["LOCAL_WORLD_SIZE"]), t.item(), x, dist.get_backend())

def leftovers(settle=20):
    from ray.util import placement_group_table
    deadline = time.monotonic() + settle  # Ray's resource view follows a release in a second
    while time.monotonic() < deadline and (
        ray.cluster_resources().get("CPU", 0) != ray.available_resources().get("CPU", 0)
    ):
        time.sleep(0.2)
    groups = [g["state"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
    actors = [a for a in ray._private.state.state.actor_table(None).values()
              if a["State"] != "DEAD"]
    held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
    return {{"groups": groups, "actors": len(actors), "cpus_held": held}}
"""

FIRST = """
t0 = time.perf_counter()
values = notebook_launcher(reduce_and_report, (7,), num_processes=4, launcher="ray",
                           ray_address=ADDRESS)
print("VALUES", values)
print("first launch took %.2f s" % (time.perf_counter() - t0))
"""

WARM = """
t0 = time.perf_counter()
again = notebook_launcher(reduce_and_report, (8,), num_processes=4, launcher="ray")
print("AGAIN", again)
print("warm launch took %.2f s" % (time.perf_counter() - t0))
"""

RAISES = """
def refuse():
    import time
    from nbaccel import PartialState
    state = PartialState()
    if state.process_index == 2:
        raise ValueError("rank two says no")
    time.sleep(60)  # the peers: stopped when rank 2 fails

try:
    notebook_launcher(refuse, num_processes=4, launcher="ray", timeout=50)
except ValueError as exc:
    print("CAUGHT", type(exc).__name__, exc, exc.__notes__)

class ShardLost(Exception):
    def __init__(self, shard, *, host):
        super().__init__(f"shard {shard} lost on {host}")
        self.shard = shard

def refuse_with(kind):
    from nbaccel import PartialState
    if PartialState().process_index == 3:
        if kind == "os":
            raise OSError("model foo/bar not found")
        raise ShardLost(7, host="a ray node")
    return "ok"

for kind in ("os", "user"):
    try:
        notebook_launcher(refuse_with, (kind,), num_processes=4, launcher="ray", timeout=50)
    except (OSError, ShardLost) as exc:
        print("CAUGHT", type(exc).__name__, isinstance(exc, ShardLost), exc.args,
              getattr(exc, "shard", "-"), "|", exc, exc.__notes__)
"""

TOO_BIG = """
try:
    notebook_launcher(reduce_and_report, (0,), num_processes=2, launcher="ray",
                      ray_resources={"GPU": 1, "CPU": 1})
except ValueError as exc:
    print("REFUSED", exc)
print("LEFT", json.dumps(leftovers(settle=0)))
"""

POOL_START = """%%distributed --launcher ray --ray_address {address} -n 4
import os
import torch.distributed as dist
kept = dist.get_rank() * 10 + int(os.environ["NODE_RANK"])
print("set", kept)
"""

POOL_AGAIN = """%%distributed
print("kept", kept + 1)
"""

LEFT = "%dist_shutdown\nprint('LEFT', json.dumps(leftovers()))"

KILL = """
import tempfile
marks = tempfile.mkdtemp()

def sleep_long(marks):
    import os, time
    from nbaccel import PartialState
    state = PartialState()
    open(os.path.join(marks, str(state.process_index)), "w").close()
    time.sleep(120)

node = next(n for n in ray.nodes() if n["Alive"] and n["NodeManagerPort"] == KILL_PORT)
victim = node["NodeID"][:6]
print("VICTIM", victim)
raylet = int(next(line.split()[0] for line in os.popen("ps -eo pid=,args=")
                  if "raylet" in line and f"--node_manager_port={KILL_PORT}" in line))
killed = {}

def kill_soon():
    while len(os.listdir(marks)) < 4:  # the ranks are up and in their sleep
        time.sleep(0.2)
    killed["at"] = time.perf_counter()
    os.kill(raylet, 9)

threading.Thread(target=kill_soon, daemon=True).start()
try:
    notebook_launcher(sleep_long, (marks,), num_processes=4, launcher="ray", timeout=150)
except Exception as exc:
    print("NAMED after %.1f s" % (time.perf_counter() - killed.get("at", float("nan"))))
    print("LOST", type(exc).__name__, exc)
time.sleep(2)
print("LEFT", json.dumps(leftovers()))
"""


@pytest.fixture(scope="module")
def cluster():
    with RayCluster(cpus=(2, 2)) as started:
        yield started


def _values(text: str, tag: str) -> list:
    line = next(line for line in text.splitlines() if line.startswith(tag))
    return ast.literal_eval(line[len(tag) :].strip())


def _left(text: str) -> dict:
    import json

    return json.loads(next(line for line in text.splitlines() if line.startswith("LEFT "))[5:])


def test_ranks_on_a_ray_cluster_from_a_kernel(cluster):
    cells = [
        SETUP.format(address=cluster.address, kill_port=cluster.node_manager_ports[1]),
        FIRST,
        WARM,
        RAISES,
        TOO_BIG,
        "%load_ext nbaccel",
        POOL_START.format(address=cluster.address),
        POOL_AGAIN,
        LEFT,
        KILL,
    ]
    nb = run_notebook(cells, timeout=300, shutdown=True)
    for index in (0, 1, 2, 3, 4, 6, 7, 8, 9):
        assert not cell_errors(nb.cells[index]), "\n-----\n".join(cell_text(c) for c in nb.cells)

    # 4 ranks on 2 nodes, numbered node by node, all-reduced over gloo: 1+2+3+4
    first = cell_text(nb.cells[1])
    nodes = re.search(r"on 2 Ray nodes \((\S+):2, (\S+):2;", first)
    assert nodes, first
    a, b = nodes.groups()
    assert a != b
    expected = [(r, r % 2, r // 2, 2, 10.0, 7, "gloo") for r in range(4)]
    assert _values(first, "VALUES") == expected
    for rank in range(4):
        node = (a, b)[rank // 2]
        assert f"[rank {rank} @ {node}] local {rank % 2} of 2 on node {rank // 2}" in first

    # the same cluster (the kernel is connected now), the same shape: the warm allocation
    warm = cell_text(nb.cells[2])
    assert _values(warm, "AGAIN") == [(r, r % 2, r // 2, 2, 10.0, 8, "gloo") for r in range(4)]
    assert "starting a new agent" not in warm

    # the rank's own exception type, named with its rank and node
    raised = cell_text(nb.cells[3])
    assert f"CAUGHT ValueError rank two says no ['raised on rank 2 @ {b}']" in raised
    # an OSError of one message and a notebook class with a keyword-only argument: whole
    assert (
        "CAUGHT OSError False ('model foo/bar not found',) - | "
        f"model foo/bar not found ['raised on rank 3 @ {b}']"
    ) in raised, raised
    assert (
        "CAUGHT ShardLost True ('shard 7 lost on a ray node',) 7 | "
        f"shard 7 lost on a ray node ['raised on rank 3 @ {b}']"
    ) in raised, raised

    # a cluster that cannot hold the ranks: refused with what it has, before anything starts
    # (the warm allocation of the launches above is kept: nothing new was created)
    refused = cell_text(nb.cells[4])
    assert (
        "cannot hold 2 rank(s) of CPU=1, GPU=1 each: that is CPU=2, GPU=2, and the cluster "
        "has CPU=4, GPU=0 in all" in refused
    ), refused
    assert "Launching" not in refused
    assert _left(refused)["groups"] == ["CREATED"]  # the warm one, only

    # a pool on the cluster keeps its names across cells
    pool = cell_text(nb.cells[6]) + cell_text(nb.cells[7])
    for rank in range(4):
        node, value = (a, b)[rank // 2], rank * 10 + rank // 2
        assert f"[rank {rank} @ {node}] kept {value + 1}" in pool

    # after the pool's shutdown: nothing of it (nor of the warm launches) on the cluster
    assert _left(cell_text(nb.cells[8])) == {"groups": [], "actors": 0, "cpus_held": 0.0}

    # a node killed mid-launch: its ranks named with it; nothing left on the cluster
    killed = cell_text(nb.cells[9])
    print(killed)  # how long the node's loss took to be named (-s shows it)
    victim = re.search(r"VICTIM (\w+)", killed).group(1)
    lost = re.search(r"LOST (\w+) (.*)", killed)
    assert lost, killed
    assert re.search(rf"rank [0-3] @ \S+/{victim} was lost: host \S+/{victim} lost", lost.group(2))
    assert "NAMED after" in killed
    assert _left(killed) == {"groups": [], "actors": 0, "cpus_held": 0.0}
