"""One notebook, many hosts: real kernels (nbclient) launching over ssh onto the lane's hosts.

Run with ``sudo bash scripts/test-hosts`` (marker ``hosts``). The hosts nbh1, nbh2 are network
namespaces with their own sshd, /tmp and /dev/shm; they share only the filesystem and the
network with this kernel, which they reach at 10.77.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel import cell_errors, cell_text, stream_text
from kernel import run_notebook as _run_notebook

pytestmark = pytest.mark.hosts


def run_notebook(cells, **options):
    """A fresh kernel, shut down at the end as Jupyter does: its agents end with it."""
    return _run_notebook(cells, shutdown=True, **options)


NO_WARMUP = {"NBACCEL_NO_WARMUP": "1", "NBACCEL_RENDERER": "text"}


def _python_on(hosts, host: str) -> list[str]:
    """The Python processes (agents, fork servers, ranks) running on ``host``."""
    out = subprocess.run(
        hosts.ssh_argv(host, "ps -eo pid,args | grep '[p]ython' || true"),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture
def shared_tmp():
    """A folder the hosts see too (their /tmp is their own; the rest is shared)."""
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-lane-", dir="/var/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def clean_hosts(ssh_hosts):
    """Every test starts and ends with no nbaccel process on any host."""
    yield ssh_hosts
    deadline = time.monotonic() + 20
    left = {}
    while time.monotonic() < deadline:
        left = {h: _python_on(ssh_hosts, h) for h in ssh_hosts.names[:2]}
        if not any(left.values()):
            return
        time.sleep(0.5)
    pytest.fail(f"processes left on the hosts: {left}")


_WHERE = textwrap.dedent(
    """
    import os, socket, sys, torch
    import torch.distributed as dist
    from nbaccel import notebook_launcher

    def where(weights):
        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        print("hello from", socket.gethostname(), "local rank", os.environ["LOCAL_RANK"],
              "forwarded", os.environ.get("NBH_FORWARD_ME"), "home", os.environ.get("HOME"))
        with open("/proc/self/maps") as maps:  # the host's shared file the tensor lives in
            mapped = {x.split()[5].split("/")[-1] for x in maps if "/dev/shm/nbaccel-" in x}
        return (dist.get_rank(), socket.gethostname(), os.environ["NODE_RANK"], total.item(),
                float(weights.sum()), sorted(mapped), weights * (dist.get_rank() + 1))

    weights = torch.ones(1_000_000)
    results = notebook_launcher(where, (weights,), num_processes=4, hosts=["nbh1:2", "nbh2:2"],
                                python=sys.executable, env=["NBH_FORWARD_ME"])
    for row in results:
        print(row[:-1])
    # a 4 MB return value from another host reaches the notebook whole (inside the message:
    # the notebook cannot map a file in that host's /dev/shm)
    print("returned", [(float(row[-1].sum()), row[-1].shape[0]) for row in results])
    """
)


def test_launcher_results_labels_and_data_once_per_host(clean_hosts):
    nb = run_notebook([_WHERE], timeout=240, env={**NO_WARMUP, "NBH_FORWARD_ME": "yes"})
    text = cell_text(nb.cells[0])
    assert not cell_errors(nb.cells[0]), text
    assert "on 2 hosts (nbh1:2, nbh2:2) over ssh" in text
    assert "connect back to 10.77.0.1" in text
    rows = {}
    for rank, host, node in ((0, "nbh1", 0), (1, "nbh1", 0), (2, "nbh2", 1), (3, "nbh2", 1)):
        assert (
            f"[rank {rank} @ {host}] hello from {host} local rank {rank % 2} forwarded yes "
            "home /root"  # the host's own environment, plus what the launch forwards
        ) in text
        line = next(x for x in text.splitlines() if x.startswith(f"({rank}, '{host}', '{node}'"))
        assert f"({rank}, '{host}', '{node}', 6.0, 1000000.0, [" in line
        rows[rank] = line.split("[")[1]
    # the 4 MB tensor: one file in each host's own /dev/shm, mapped by both of its ranks
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2]
    assert "-0'" in rows[0] and "-1'" in rows[2], rows  # nbaccel-<token>-<node>
    sums = [(1e6 * (rank + 1), 1000000) for rank in range(4)]
    assert f"returned {sums}" in text, text


_FAIL = textwrap.dedent(
    """
    from nbaccel import notebook_launcher

    def fail_on_three():
        import os, time
        if os.environ["RANK"] == "3":
            raise ValueError("bad shard on the second host")
        time.sleep(60)

    notebook_launcher(fail_on_three, num_processes=4, hosts=["nbh1:2", "nbh2:2"])
    """
)


def test_first_failure_has_its_type_rank_and_host(clean_hosts):
    nb = run_notebook([_FAIL, "print('kernel still usable')"], timeout=240, env=NO_WARMUP)
    errors = cell_errors(nb.cells[0])
    assert [(e.ename, e.evalue) for e in errors] == [("ValueError", "bad shard on the second host")]
    assert "\nraised on rank 3 @ nbh2" in "\n".join(errors[0].traceback)
    assert "kernel still usable" in cell_text(nb.cells[1])


def _sleeper(folder: str, hosts: str = '["nbh1:1", "nbh2:1"]', flood: bool = False) -> str:
    """Ranks that say they are up (a file in ``folder``), then sleep, or print without pause."""
    wait = "while True:\n                print('flood ' * 20)" if flood else "time.sleep(300)"
    return textwrap.dedent(
        f"""
        from nbaccel import notebook_launcher

        def sleep_long(folder):
            import os, time
            open(os.path.join(folder, os.environ["RANK"]), "w").close()
            {wait}

        notebook_launcher(sleep_long, ({folder!r},), num_processes=2, hosts={hosts})
        """
    )


def test_interrupt_stops_every_rank_on_every_host(clean_hosts, shared_tmp):
    folder = shared_tmp / "up"
    folder.mkdir()
    nb = run_notebook(
        [_sleeper(str(folder)), "print('after the interrupt')"],
        timeout=240,
        interrupt_after={0: 25},
        env=NO_WARMUP,
    )
    assert sorted(os.listdir(folder)) == ["0", "1"], cell_text(nb.cells[0])
    assert [e.ename for e in cell_errors(nb.cells[0])] == ["KeyboardInterrupt"]
    assert "after the interrupt" in cell_text(nb.cells[1])


def test_killed_agent_names_its_host(clean_hosts, shared_tmp):
    folder = shared_tmp / "up"
    folder.mkdir()
    killed = {}

    def kill_agent_on_nbh2():
        deadline = time.monotonic() + 200
        while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        subprocess.run(
            clean_hosts.ssh_argv("nbh2", "pkill -KILL -f 'nbaccel[.]launch[.]remote[.]agent'"),
            timeout=30,
        )
        killed["at"] = time.monotonic()

    thread = threading.Thread(target=kill_agent_on_nbh2)
    thread.start()
    try:
        nb = run_notebook([_sleeper(str(folder))], timeout=240, env=NO_WARMUP)
    finally:
        thread.join()
    errors = cell_errors(nb.cells[0])
    assert [e.ename for e in errors] == ["RankCrashed"], cell_text(nb.cells[0])
    assert "rank 1 @ nbh2 was lost: host nbh2 lost" in errors[0].evalue


@pytest.mark.parametrize("flood", [False, True], ids=["sleeping", "printing"])
def test_kernel_death_leaves_no_process_on_any_host(clean_hosts, shared_tmp, flood):
    """SIGKILL the kernel mid-launch: ssh's stdin closes, each agent kills its ranks (also
    while they print without pause and the agents hold back a full window)."""
    from jupyter_client.manager import KernelManager

    folder = shared_tmp / "up"
    folder.mkdir()
    manager = KernelManager(kernel_name="python3")
    manager.kernel_spec_manager.ensure_native_kernel = True
    manager.start_kernel(env={**os.environ, **NO_WARMUP}, cwd=str(Path.cwd()))
    try:
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(60)
        client.execute(f"import sys; sys.executable == {sys.executable!r} or exit(3)")
        client.execute(_sleeper(str(folder), flood=flood))
        deadline = time.monotonic() + 200
        while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(folder)) == 2, "the ranks never started"
        assert all(_python_on(clean_hosts, h) for h in ("nbh1", "nbh2"))
        os.kill(manager.provisioner.process.pid, 9)
        client.stop_channels()
    finally:
        manager.cleanup_resources() if not manager.is_alive() else manager.shutdown_kernel(now=True)
    # clean_hosts checks that nothing is left on the hosts


_TRAIN = textwrap.dedent(
    """
    import torch
    from torch import nn
    from nbaccel import notebook_launcher

    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return x, x @ torch.arange(8.0) + 1.0

    def fresh_model():
        torch.manual_seed(1)
        return nn.Linear(8, 1)

    def train(steps=20):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = data()
        model = DDP(fresh_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(steps):
            shard = slice(rank * 64 // world, (rank + 1) * 64 // world)
            loss = ((model(x[shard]).squeeze(1) - y[shard]) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        return [p.detach().clone() for p in model.module.parameters()]

    def train_one_process(steps=20):
        x, y = data()
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(steps):
            loss = ((model(x).squeeze(1) - y) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        return [p.detach() for p in model.parameters()]

    per_rank = notebook_launcher(train, num_processes=4, hosts=["nbh1:2", "nbh2:2"])
    alone = train_one_process()
    print("ranks agree:", all(torch.equal(a, b) for r in per_rank for a, b in zip(r, per_rank[0])))
    print("equal to one process:", all(torch.allclose(a, b, atol=1e-5)
                                       for a, b in zip(per_rank[0], alone)))
    """
)


def test_two_host_training_equals_one_process(clean_hosts):
    nb = run_notebook([_TRAIN], timeout=300, env=NO_WARMUP)
    text = cell_text(nb.cells[0])
    assert "ranks agree: True" in text and "equal to one process: True" in text, text


_MAGIC = [
    "%load_ext nbaccel",
    "%%distributed --hosts nbh1:1,nbh2:1\n"
    "import os, socket\nhost = socket.gethostname()\n"
    "print('up on', host, 'rank', os.environ['RANK'])",
    "%%distributed\nprint('still', host)",
    "%%distributed --ranks 1\nhost",
    "y = 41\n%dist_push y",
    "%%distributed\ny += int(os.environ['RANK'])",
    "%dist_pull y --all\nprint('pulled', y)",
    "import torch\nbig = torch.ones(1_000_000)\n%dist_push big",
    "%%distributed\nprint('big', float(big.sum()), "
    "[n for n in os.listdir('/dev/shm') if n.startswith('nbaccel-')])",
    "%%distributed\nif os.environ['RANK'] == '1':\n    raise KeyError('missing on nbh2')",
    "%%distributed\nimport time\ntime.sleep(120)",
    "%%distributed\nprint('after interrupt', host)",
    "%%distributed\nfor i in range(100_000):\n    print('flood', i)\nprint('last line', host)",
    "%%distributed\nspins = 0\nwhile True:\n    print('spin', spins)\n    spins += 1",
    "%%distributed\nprint('spun', spins > 1000, host)",
    "%%distributed\ntwice = big * (int(os.environ['RANK']) + 2)",
    "%dist_pull twice --rank 1\nprint('pulled from nbh2', float(twice.sum()), twice.shape[0])",
    "%dist_status",
    "%dist_shutdown",
]


def test_magic_pool_across_hosts(clean_hosts):
    nb = run_notebook(_MAGIC, timeout=240, interrupt_after={10: 10, 13: 4}, env=NO_WARMUP)
    texts = [cell_text(c) for c in nb.cells]
    assert "[rank 0 @ nbh1] up on nbh1 rank 0" in texts[1], texts[1]
    assert "[rank 1 @ nbh2] up on nbh2 rank 1" in texts[1]
    assert "[rank 1 @ nbh2] still nbh2" in texts[2]
    assert "'nbh2'" in texts[3] and "nbh1" not in texts[3]
    assert "pulled [41, 42]" in texts[6]
    # the pushed tensor crossed once per host, through its /dev/shm, removed after the call
    assert not cell_errors(nb.cells[7]), texts[7]
    assert "[rank 1 @ nbh2] big 1000000.0 []" in texts[8], texts[8]
    errors = cell_errors(nb.cells[9])
    assert [(e.ename, e.evalue) for e in errors] == [("KeyError", "'missing on nbh2'")]
    assert "\nraised on rank 1 @ nbh2" in "\n".join(errors[0].traceback)
    assert [e.ename for e in cell_errors(nb.cells[10])] == ["KeyboardInterrupt"]
    assert "[rank 1 @ nbh2] after interrupt nbh2" in texts[11], texts[10] + texts[11]
    # 2 x 100,001 lines, most of them still in the hosts' relays when the ranks end their
    # call: every one is counted in its own cell (shown or in the log), none in the next
    assert "of 200002 lines not shown" in texts[12], texts[12][-2000:]
    assert "flood" not in texts[13] and "last line" not in texts[13], texts[13][:2000]
    # the stop button during a flood: the hosts' agents send at most a window ahead of what
    # the kernel has shown, so both ranks' answers arrive in time and the pool is kept
    assert [e.ename for e in cell_errors(nb.cells[13])] == ["KeyboardInterrupt"]
    assert "the pool and its names are kept" in texts[13], texts[13][-2000:]
    assert "restarting the pool" not in texts[13]
    assert "[rank 0 @ nbh1] spun True nbh1" in texts[14] and "spun True nbh2" in texts[14]
    # a 4 MB value pulled from another host: inside the message, not a file in its /dev/shm
    assert not cell_errors(nb.cells[16]), texts[16]
    assert "pulled from nbh2 3000000.0 1000000" in texts[16], texts[16]
    assert "idle" in texts[17] and "nbh2" in texts[17], texts[17]
    assert "Pool shut down." in texts[18]


def test_many_hosts_notebook(clean_hosts, monkeypatch):
    from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

    monkeypatch.setenv("NBACCEL_NOTEBOOK_HOSTS", "nbh1:2,nbh2:2")  # the notebook's kernel reads it
    path = Path(__file__).resolve().parents[2] / "notebooks" / "many_hosts.ipynb"
    nb = execute_notebook(path, timeout=300, allow_errors=False)
    texts = ["".join(output_text(o) for o in c.outputs) for c in nb.cells if c.cell_type == "code"]
    assert "[rank 3 @ nbh2] rank 3 of 4 on nbh2" in texts[1]
    assert "('nbh1', 6.0, 1000000.0), ('nbh1', 6.0, 1000000.0), ('nbh2', 6.0" in texts[1]
    assert (
        "caught: KeyError 'a column only the last host lacks' | raised on rank 3 @ nbh2" in texts[2]
    )
    assert "[rank 2 @ nbh2] ready on nbh2" in texts[4]
    assert "[rank 0 @ nbh1] nbh1 sum of ranks: 6.0" in texts[5]
    assert "hosts of the ranks: ['nbh1', 'nbh1', 'nbh2', 'nbh2']" in texts[6]


_TIMEOUT = textwrap.dedent(
    """
    from nbaccel import notebook_launcher

    def too_slow():
        import time
        time.sleep(300)

    notebook_launcher(too_slow, num_processes=2, hosts=["nbh1:1", "nbh2:1"], timeout=30)
    """
)


def test_timeout_stops_the_ranks_on_every_host(clean_hosts):
    nb = run_notebook([_TIMEOUT], timeout=240, env=NO_WARMUP)
    errors = cell_errors(nb.cells[0])
    assert [e.ename for e in errors] == ["LaunchTimeout"], cell_text(nb.cells[0])
    assert "exceeded timeout=30 s" in errors[0].evalue
    # each remote rank's Python stack at the timeout, through its host's agent
    stderr = stream_text(nb.cells[0], "stderr")
    for label in ("rank 0 @ nbh1", "rank 1 @ nbh2"):
        assert re.search(rf"\[{label}\]   File .*, line \d+ in too_slow", stderr), stderr[-3000:]


_UNREACHABLE = textwrap.dedent(
    """
    from nbaccel import notebook_launcher

    for hosts, options in ((["nbh1:1", "10.77.0.99:1"], {}), (["nbh1:1", "nbh2:1"],
                            {"cwd": "/no/such/folder"})):
        try:
            notebook_launcher(print, num_processes=2, hosts=hosts, **options)
        except RuntimeError as exc:
            print("refused:", exc)
    """
)


def test_unreachable_host_and_missing_cwd_are_named(clean_hosts):
    nb = run_notebook([_UNREACHABLE], timeout=240, env=NO_WARMUP)
    text = cell_text(nb.cells[0])
    assert "refused: could not start nbaccel's agent on 10.77.0.99: ssh 10.77.0.99 exited" in text
    assert "cannot enter cwd='/no/such/folder'" in text, text


def test_cut_network_names_the_host_and_its_agent_ends_the_ranks(clean_hosts, shared_tmp):
    """Unplug nbh2 (its link on the bridge down) mid-launch: the kernel names the host lost
    when the heartbeat is overdue; the agent, hearing nothing, kills its ranks."""
    folder = shared_tmp / "up"
    folder.mkdir()
    link = f"nbv{clean_hosts.names[1][3:]}"

    def unplug():
        deadline = time.monotonic() + 200
        while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        subprocess.run(["ip", "link", "set", link, "down"], check=True, timeout=30)

    thread = threading.Thread(target=unplug)
    thread.start()
    try:
        nb = run_notebook([_sleeper(str(folder))], timeout=240, env=NO_WARMUP)
    finally:
        thread.join()
        time.sleep(8)  # past the agent's own heartbeat limit, while still unplugged
        subprocess.run(["ip", "link", "set", link, "up"], check=True, timeout=30)
    errors = cell_errors(nb.cells[0])
    assert [e.ename for e in errors] == ["RankCrashed"], cell_text(nb.cells[0])
    assert "rank 1 @ nbh2 was lost: host nbh2 lost: no word from its agent" in errors[0].evalue


_LINEAGE = textwrap.dedent(
    """
    import os, socket, subprocess, time
    from nbaccel import notebook_launcher

    def lineage():
        import os, socket
        server = os.getppid()  # the host's fork server (torch imported there once)
        with open(f"/proc/{server}/stat") as stat:
            agent = int(stat.read().rsplit(")", 1)[1].split()[1])
        return socket.gethostname(), server, agent

    def launch():
        return notebook_launcher(lineage, num_processes=4, hosts=["nbh1:2", "nbh2:2"])
    """
)


def test_later_launches_reuse_each_hosts_agent(clean_hosts):
    """The first launch starts one agent per host; the next ones fork from the same agent's
    fork server (same pids: no new agent, no new import of torch); the agents end with the
    kernel (clean_hosts)."""
    cells = [
        _LINEAGE,
        "first = launch(); print('first', first)",
        "second = launch(); print('same agents:', second == first)",
        "print('third', launch() == first)",
        "for host in ('nbh1', 'nbh2'):\n"
        "    ps = subprocess.run(['ssh', '-F', '/var/lib/nbaccel-hosts/ssh_config', host, "
        "'ps -eo args | grep -c [p]ython'], capture_output=True, text=True).stdout.strip()\n"
        "    print('python processes between launches on', host, ps)",
    ]
    nb = run_notebook(cells, timeout=240, env=NO_WARMUP)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), texts
    assert "same agents: True" in texts[2], texts
    assert "third True" in texts[3], texts
    assert texts[1].count("'nbh1'") == 2 and texts[1].count("'nbh2'") == 2, texts[1]
    for host in ("nbh1", "nbh2"):  # its agent and the agent's fork server; no rank
        assert f"python processes between launches on {host} 2" in texts[4], texts[4]


def test_a_dead_agent_is_restarted_on_the_next_launch_with_a_notice(clean_hosts):
    kill = (
        "agent = next(a for h, _, a in first if h == 'nbh2')\n"
        "subprocess.run(['ssh', '-F', '/var/lib/nbaccel-hosts/ssh_config', 'nbh2', "
        "f'kill -KILL {agent}'], check=True)\n"
        "time.sleep(1)"
    )
    cells = [
        _LINEAGE,
        "first = launch()",
        kill,
        "again = launch()\n"
        "print('nbh1 kept:', [r for r in again if r[0] == 'nbh1'] == first[:2])\n"
        "print('nbh2 new:', {r[2] for r in again if r[0] == 'nbh2'} != {agent})",
    ]
    nb = run_notebook(cells, timeout=240, env=NO_WARMUP)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), texts
    assert "nbh2: its agent ended (ssh nbh2 exited with code" in texts[3], texts[3]
    assert "starting a new agent" in texts[3]
    assert "nbh1 kept: True" in texts[3] and "nbh2 new: True" in texts[3], texts[3]


_AGENT_USE = textwrap.dedent(
    """
    def agent_use(first):
        # (rss KiB, open descriptors) of each host's agent and fork server; nbaccel shm files
        use = {}
        for host in ("nbh1", "nbh2"):
            agent = next(a for h, _, a in first if h == host)
            server = next(s for h, s, _ in first if h == host)
            script = (
                f"for p in {agent} {server}; do grep VmRSS /proc/$p/status | tr -dc 0-9; "
                "echo -n ' '; ls /proc/$p/fd | wc -l; done; ls /dev/shm | grep -c nbaccel || true"
            )
            out = subprocess.run(['ssh', '-F', '/var/lib/nbaccel-hosts/ssh_config', host, script],
                                 capture_output=True, text=True).stdout.split()
            use[host] = [int(x) for x in out]
        return use
    """
)


def test_hundreds_of_launches_across_hosts_leave_the_agents_as_they_were(clean_hosts):
    """A day's use in one kernel: 200 warm launches on 2 hosts, every result right; the agents
    and their fork servers keep their descriptors and (nearly) their memory, no shared file is
    left on a host, and the kernel's own descriptors are back where they started."""
    loop = (
        "import psutil\n"
        "def plus(x):\n"
        "    import os\n"
        "    return int(os.environ['RANK']) + x\n"
        "me = psutil.Process(); fds = me.num_fds()\n"
        "wrong = [i for i in range(200) if notebook_launcher(plus, (i,), num_processes=4,\n"
        "         hosts=['nbh1:2', 'nbh2:2']) != [i, i + 1, i + 2, i + 3]]\n"
        "print('wrong', wrong, 'kernel fds', me.num_fds() - fds, '.')"
    )
    cells = [
        _LINEAGE,
        _AGENT_USE,
        "first = launch(); before = agent_use(first)",
        loop,
        "import json\nafter = agent_use(first)\nprint('USE', json.dumps([before, after]))",
    ]
    nb = run_notebook(cells, timeout=600, env=NO_WARMUP)
    texts = [cell_text(c) for c in nb.cells]
    assert not any(cell_errors(c) for c in nb.cells), texts
    assert "wrong [] kernel fds" in texts[3], texts[3][-3000:]
    # a leak would be one or more per launch; the kernel's own machinery moves one or two
    assert int(texts[3].split("kernel fds ", 1)[1].split()[0]) <= 2, texts[3][-3000:]
    before, after = json.loads(texts[4].split("USE ", 1)[1])
    for host in ("nbh1", "nbh2"):
        agent_rss, agent_fds, server_rss, server_fds, shm = after[host]
        assert (agent_fds, server_fds, shm) == (before[host][1], before[host][3], 0), (
            before,
            after,
        )
        assert agent_rss - before[host][0] < 8 * 1024, (before, after)  # KiB
        assert server_rss - before[host][2] < 8 * 1024, (before, after)


def test_a_pool_printing_between_cells_does_not_hold_up_a_launch_on_the_same_hosts(clean_hosts):
    """A pool rank's thread prints while no cell runs (nobody reads the pool's output then, so
    its window on the host fills); a one-shot launch on the same hosts still starts and
    returns, and the pool's next cell still works. Each launch has its own window and queue."""
    cells = [
        "%load_ext nbaccel",
        "%%distributed --hosts nbh1:1,nbh2:1\n"
        "import threading, itertools\n"
        "stop = threading.Event()\n"
        "def chatter():\n"
        "    for i in itertools.count():\n"
        "        if stop.is_set():\n"
        "            return\n"
        "        print('chatter', i)\n"
        "chatterer = threading.Thread(target=chatter, daemon=True)\n"
        "chatterer.start()",
        "import time\ntime.sleep(3)",  # the pool's window on each host fills meanwhile
        "from nbaccel import notebook_launcher\n"
        "def rank():\n"
        "    import os\n"
        "    return int(os.environ['RANK'])\n"
        "got = notebook_launcher(rank, num_processes=4, hosts=['nbh1:2', 'nbh2:2'], timeout=60)\n"
        "print('launch returned', got)",
        # shows the chatter held back so far; joined, so that no line of it can follow the
        # cell's end (the thread may be between its check and its print when stop is set)
        "%%distributed\nstop.set()\nchatterer.join()",
        "%%distributed\nprint('pool still here')",
        "%dist_shutdown",
    ]
    nb = run_notebook(cells, timeout=240, env=NO_WARMUP)
    texts = [cell_text(c) for c in nb.cells]
    assert not cell_errors(nb.cells[3]), texts[3][-2000:]
    assert "launch returned [0, 1, 2, 3]" in texts[3], texts[3][-2000:]
    assert not cell_errors(nb.cells[4]), texts[4][-2000:]
    assert "chatter" in texts[4]  # what the pool's ranks printed between cells is not lost
    assert "[rank 1 @ nbh2] pool still here" in texts[5], texts[5][-2000:]
    assert "chatter" not in texts[5], texts[5][-2000:]


_RAISE_ACROSS_HOSTS = textwrap.dedent(
    """
    from nbaccel import notebook_launcher

    class ShardLost(Exception):
        def __init__(self, shard, *, host):
            super().__init__(f"shard {shard} lost on {host}")
            self.shard, self.host = shard, host

    def fail(kind):
        import os
        if os.environ["RANK"] == "3":
            if kind == "os":
                raise OSError("model foo/bar not found")
            raise ShardLost(7, host="the second host")
        return "ok"

    for kind in ("os", "user"):
        try:
            notebook_launcher(fail, (kind,), num_processes=4, hosts=["nbh1:2", "nbh2:2"])
        except (OSError, ShardLost) as err:
            print("caught", type(err).__name__, isinstance(err, ShardLost), err.args, err.rank,
                  getattr(err, "errno", "-"), getattr(err, "shard", "-"), "|", err, err.__notes__)
    """
)


def test_exceptions_from_another_host_arrive_whole(clean_hosts):
    """OSError of one message (once shown as "[Errno None] None: None -> None") and a notebook
    class with a keyword-only argument, raised on the second host."""
    nb = run_notebook([_RAISE_ACROSS_HOSTS], timeout=240, env=NO_WARMUP)
    text = cell_text(nb.cells[0])
    assert (
        "caught OSError False ('model foo/bar not found',) 3 None - | "
        "model foo/bar not found ['raised on rank 3 @ nbh2']"
    ) in text, text
    assert (
        "caught ShardLost True ('shard 7 lost on the second host',) 3 - 7 | "
        "shard 7 lost on the second host ['raised on rank 3 @ nbh2']"
    ) in text, text
