"""The many-hosts engine without ssh: hosts parsing, the CURVE hub, agents as real processes.

Agents run on this machine (``tests/remote_agents.py``), each a real ``python -m
nbaccel.launch.remote.agent`` subprocess connecting to the kernel's CURVE hub on 127.0.0.1; the
ssh and SLURM lanes (``tests/hosts``) run the same engine across network-namespace hosts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import zmq

from nbaccel.launch.driver.renderer import TextRenderer
from nbaccel.launch.remote.hosts import parse_hosts, slurm_layout
from nbaccel.launch.remote.hub import Hub
from nbaccel.launch.remote.messages import Kind, encode, new_keys
from nbaccel.launch.remote.options import remote_options
from nbaccel.launch.remote.warm import live_agents, shutdown_agents
from nbaccel.launch.run import run_function
from nbaccel.launch.wire.errors import RankCrashed

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
sys.path.insert(0, HERE)
from remote_agents import local_plan  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _no_agents_after():
    """Agents stay warm between this module's launches, and end with it."""
    yield
    shutdown_agents()


# ----------------------------------------------------------------------------- hosts, options


def test_hosts_layout_numbers_ranks_host_by_host():
    layout = parse_hosts("a:2,user@b:3", None)
    assert [h.name for h in layout.hosts] == ["a", "b"]
    assert layout.hosts[1].target == "user@b"
    assert layout.num_processes == 5
    assert [layout.place(r) for r in range(5)] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert parse_hosts(["a", "b"], 4).describe() == "a:2, b:2"


@pytest.mark.parametrize(
    ("hosts", "n", "words"),
    [
        ([], 2, "non-empty list"),
        (["a:0"], None, "positive integer"),
        (["a:x"], None, "positive integer"),
        (["a b:2"], None, "not '[user@]host[:N]'"),
        (["a;rm -rf:2"], None, "not '[user@]host[:N]'"),
        (["a:2", "a:2"], None, "more than once"),
        (["a:2", "b:2"], 3, "add up to 4"),
        (["a", "b"], 3, "cannot be shared evenly"),
        (["a", "b"], None, "give each host its number"),
    ],
)
def test_bad_hosts_are_refused_with_the_fix(hosts, n, words):
    with pytest.raises(ValueError, match=None) as info:
        parse_hosts(hosts, n)
    assert words in str(info.value)


def test_slurm_outside_an_allocation_says_so():
    with pytest.raises(ValueError, match="SLURM_JOB_ID is not set"):
        slurm_layout(4, environ={})


def test_remote_options_check_before_anything_starts(monkeypatch):
    with pytest.raises(ValueError, match="needs hosts"):
        remote_options("ssh", 2)
    with pytest.raises(ValueError, match="launcher must be one of"):
        remote_options("rsh", 2, ["a:2"])
    monkeypatch.delenv("NBACCEL_NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ValueError, match="NBACCEL_NOT_SET_ANYWHERE"):
        remote_options("ssh", 2, ["a:2"], env=["NBACCEL_NOT_SET_ANYWHERE"])
    with pytest.raises(ValueError, match="list of arguments"):
        remote_options("ssh", 2, ["a:2"], ssh_args="-p 22")
    monkeypatch.setenv("NBACCEL_FORWARD_ME", "yes")
    options = remote_options("ssh", None, "a:1,b:1", env=["NBACCEL_FORWARD_ME"], cwd="/srv")
    assert options.env == {"NBACCEL_FORWARD_ME": "yes"}
    assert options.layout.num_processes == 2 and options.cwd == "/srv"


def test_notebook_launcher_refuses_bad_hosts_before_starting():
    from nbaccel import notebook_launcher

    with pytest.raises(ValueError, match="add up to 2"):
        notebook_launcher(print, num_processes=3, hosts=["a:1", "b:1"])


# ----------------------------------------------------------------------------- the hub


def test_hub_admits_only_the_keys_it_made():
    """A client with the server's public key but a key pair of its own is refused by ZAP
    before any message reaches the hub; a key the hub made for an agent gets through, until
    that agent is counted lost (then nothing of it is heard, on any connection)."""
    heard = []
    hub = Hub("127.0.0.1", lambda agent, kind, header: heard.append((agent, kind, header)))
    context = zmq.Context()
    try:

        def client(public: str, secret: str) -> zmq.Socket:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.curve_serverkey = hub.server_public.encode()
            sock.curve_publickey, sock.curve_secretkey = public.encode(), secret.encode()
            sock.connect(f"tcp://127.0.0.1:{hub.port}")
            return sock

        stranger = client(*new_keys())
        stranger.send_multipart(encode(Kind.LOG, {"text": "let me in"}))
        hub.admit()
        agent, public, secret = hub.admit()
        member = client(public, secret)
        member.send_multipart(encode(Kind.LOG, {"text": "agent 1 here"}))
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the stranger's message, were it admitted, would be here by now
        assert heard == [(1, Kind.LOG, {"text": "agent 1 here"})] and agent == 1
        hub.lose(1, "gone")
        again = client(public, secret)  # the lost agent, reconnecting
        again.send_multipart(encode(Kind.LOG, {"text": "back again"}))
        member.send_multipart(encode(Kind.LOG, {"text": "still here"}))
        time.sleep(0.5)
        assert heard[1:] == [(1, Kind.LOST, {"why": "gone"})]
        for sock in (stranger, member, again):
            sock.close()
    finally:
        context.term()
        hub.close()


def test_hub_binds_only_the_address_it_was_given():
    hub = Hub("127.0.0.1", lambda *a: None)
    try:
        listening = [
            c.laddr
            for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == hub.port
        ]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening)
    finally:
        hub.close()


# ----------------------------------------------------------------------------- agents


def _where(big):
    import os
    import socket

    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1) * dist.get_rank()
    dist.all_reduce(total)
    print(f"on {os.environ['NBACCEL_HOST']} as {os.environ['LOCAL_RANK']}", flush=True)
    return (
        int(os.environ["RANK"]),
        os.environ["NODE_RANK"],
        os.environ["LOCAL_RANK"],
        float(big.sum()),
        total.item(),
        socket.gethostname() != "",
    )


def test_agents_run_ranks_host_by_host(capsys):
    shutdown_agents()
    big = torch.arange(100_000, dtype=torch.float64)  # large: through the hosts' shared memory
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. the fork server
    report = run_function(local_plan(["h1:2", "h2:1"]), _where, (big,), renderer=TextRenderer())
    values = report.values()
    expected = float(big.sum())
    assert values == [
        (0, "0", "0", expected, 3.0, True),
        (1, "0", "1", expected, 3.0, True),
        (2, "1", "0", expected, 3.0, True),
    ]
    out = capsys.readouterr()
    assert "[rank 2 @ h2] on h2 as 0" in out.out
    assert "on 2 hosts (h1:2, h2:1)" in out.out and "CURVE" in out.out
    # the ranks are gone; each host's agent and its fork server stay warm for the next launch
    agents = _agent_pids(os.getpid())  # the agents (their fork servers share the command line)
    assert len(agents) == 2
    warm = {a.pid for a in agents} | {c.pid for a in agents for c in a.children()}
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    alive = {p.pid for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
    assert alive == warm and len(warm) == 4
    shutdown_agents()  # what the kernel's exit does
    assert not _agent_pids()
    gone, still = psutil.wait_procs([psutil.Process(p) for p in warm if psutil.pid_exists(p)], 10)
    assert not still


def _rendezvous_and_threads():
    import importlib
    import os
    import time

    import torch
    import torch.distributed as dist

    waits = []
    for _ in range(3):  # init again after a destroy, as a later cell of a pool may
        if os.environ["RANK"] == "0":
            time.sleep(0.2)  # rank 1 comes first, and finds no store yet
        started = time.monotonic()
        dist.init_process_group("gloo")
        waits.append(time.monotonic() - started)
        total = torch.ones(1)
        dist.all_reduce(total)
        dist.destroy_process_group()
    handler = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers["env"]
    patient = getattr(handler, "nbaccel_patient", False)
    return total.item(), torch.get_num_threads(), patient, min(waits)


def test_a_rank_before_rank_0_joins_at_once_and_hosts_of_one_machine_share_its_cores():
    plan = local_plan(["h1:1", "h2:1"])
    values = run_function(plan, _rendezvous_and_threads, renderer=TextRenderer()).values()
    # both "hosts" are this machine (one boot id): its cores are shared by their 2 ranks
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert [v[:3] for v in values] == [(2.0, threads, True)] * 2
    # rank 1 waited for rank 0's store (0.2 s), not for torch's next try, which comes 0.5 to
    # 1.5 s after the first
    assert values[1][3] < 0.45, values


def _lineage():
    import os

    import psutil

    server = os.getppid()  # the rank's parent: its host's fork server, a child of the agent
    return server, psutil.Process(server).ppid()


def test_later_launches_reuse_the_agents_and_a_dead_one_is_restarted_with_a_notice(capsys):
    first = run_function(local_plan(["h1:1", "h2:1"]), _lineage, renderer=TextRenderer())
    first = first.values()
    second = run_function(local_plan(["h1:1", "h2:1"]), _lineage, renderer=TextRenderer())
    # the same agent and fork server on each host: no new process, no new import of torch
    assert second.values() == first
    assert {h.pid for h in live_agents()} >= {first[0][1], first[1][1]}
    os.kill(first[1][1], signal.SIGKILL)  # h2's agent dies between launches (its fork server
    # follows it); the next launch may begin before the kernel knows: it finds out, once
    capsys.readouterr()
    third = run_function(local_plan(["h1:1", "h2:1"]), _lineage, renderer=TextRenderer())
    third = third.values()
    assert third[0] == first[0] and third[1][1] != first[1][1]
    err = capsys.readouterr().err
    assert "h2: its agent ended (agent h2 exited with code -9); starting a new agent" in err


class _LaterKind:
    """A message kind of a later nbaccel (``encode`` needs only its value)."""

    value = b"a-later-kind"


def test_an_agent_passes_over_a_message_kind_it_does_not_know():
    from nbaccel.launch.remote.warm import warm_agents

    first = run_function(local_plan(["h1:1", "h2:1"]), _lineage, renderer=TextRenderer())
    fleet = warm_agents("127.0.0.1")
    for handle in fleet.live():
        fleet.hub.send(handle.id, _LaterKind(), {"lid": "none"})
    again = run_function(local_plan(["h1:1", "h2:1"]), _lineage, renderer=TextRenderer())
    assert again.values() == first.values()  # the same agents and servers: none ended


def _raise_on_last():
    import os

    if os.environ["RANK"] == "1":
        raise KeyError("missing on the second host")
    return "ok"


def test_first_failure_keeps_its_type_and_names_rank_and_host():
    report = run_function(local_plan(["h1:1", "h2:1"]), _raise_on_last, renderer=TextRenderer())
    with pytest.raises(KeyError, match="second host") as info:
        report.values()
    assert str(info.value) == "'missing on the second host'"
    assert (info.value.rank, info.value.host) == (1, "h2")
    assert info.value.__notes__ == ["raised on rank 1 @ h2"]


def test_a_pool_and_a_launch_in_one_kernel_name_their_own_ranks(capsys):
    from nbaccel.notebook.kernel.pool import shutdown_pool, start_pool

    report = run_function(local_plan(["h1:1", "h2:1"]), _raise_on_last, renderer=TextRenderer())
    try:  # a pool on this machine runs a cell before the launch's failure is raised
        start_pool(num_processes=2).run_cell("print('here')", renderer=TextRenderer())
    finally:
        shutdown_pool()
    assert "[rank 1] here" in capsys.readouterr().out  # the pool's ranks: no host
    with pytest.raises(KeyError, match="second host") as info:
        report.values()  # the launch's ranks keep their hosts
    assert info.value.__notes__ == ["raised on rank 1 @ h2"]


def _sleep_long(folder):
    import os
    import time

    path = os.path.join(folder, os.environ["RANK"])
    with open(path + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(path + ".tmp", path)  # whole, or not there yet
    time.sleep(120)


def _agent_pids(parent: int | None = None) -> list[psutil.Process]:
    """This test session's live agents, orphans included (they inherit the session's own
    ``TMPDIR``, tests/conftest.py; other sessions may run on the machine); with ``parent``,
    only those it started."""
    mine = []
    for p in psutil.process_iter(["cmdline", "ppid", "status"]):
        if "nbaccel.launch.remote.agent" not in " ".join(p.info["cmdline"] or []):
            continue
        if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
            continue
        if parent is not None and p.info["ppid"] != parent:
            continue
        try:
            if p.environ().get("TMPDIR") == os.environ["TMPDIR"]:
                mine.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return mine


def _two_hosts_sleeping_while(action, tmp_path):
    """Rank 0 on h1 and rank 1 on h2 sleep while ``action`` runs in a thread; the report."""
    thread = threading.Thread(target=action)
    thread.start()
    try:
        return run_function(
            local_plan(["h1:1", "h2:1"]), _sleep_long, (str(tmp_path),), renderer=TextRenderer()
        )
    finally:
        thread.join()


def test_a_killed_agent_is_named_and_its_host_lost(tmp_path):
    def kill_second_agent():
        deadline = time.monotonic() + 90
        while not (tmp_path / "1").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        rank = psutil.Process(int((tmp_path / "1").read_text()))
        rank.parent().parent().kill()  # rank 1 -> its host's fork server -> that host's agent

    report = _two_hosts_sleeping_while(kill_second_agent, tmp_path)
    with pytest.raises(RankCrashed, match=r"rank 1 @ h2 was lost: host h2 lost: its agent"):
        report.values()
    assert len(_agent_pids(os.getpid())) == 1  # h2's is gone; h1's stays warm


_KERNEL = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {here!r})
    from remote_agents import local_plan
    from nbaccel.launch.driver.renderer import TextRenderer
    from nbaccel.launch.run import run_function

    def sleep_long():
        import os, time
        print("rank up", os.getpid(), flush=True)
        time.sleep(300)

    run_function(local_plan(["h1:1", "h2:1"]), sleep_long, renderer=TextRenderer())
    """
)


def test_kernel_death_ends_the_agents_and_their_ranks():
    """A kernel killed with SIGKILL: each agent's stdin closes (as ssh's would), the agent
    kills its ranks and exits. Nothing of the launch survives."""
    kernel = subprocess.Popen(
        [sys.executable, "-c", _KERNEL.format(here=HERE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ranks = []
    try:
        for line in kernel.stdout:
            if "rank up" in line:
                ranks.append(int(line.split()[-1]))
                if len(ranks) == 2:
                    break
        assert len(ranks) == 2, "the ranks never started"
        agents = _agent_pids(kernel.pid)
        assert len(agents) == 2
        # handles taken while the ranks run: one may end before a handle taken after the kill
        watched = [psutil.Process(pid) for pid in ranks] + agents
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
        gone, alive = psutil.wait_procs(watched, timeout=30)
        assert not alive, f"still running after the kernel died: {alive}"
    finally:
        if kernel.poll() is None:
            kernel.kill()


def test_a_silent_agent_is_named_lost_by_the_heartbeat(tmp_path):
    """An agent that stops answering (SIGSTOP: a frozen host, a cut network) is named lost
    once its heartbeat is overdue, and its ranks with it."""
    stopped = []

    def freeze_second_agent():
        deadline = time.monotonic() + 90
        while not (tmp_path / "1").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        agent = psutil.Process(int((tmp_path / "1").read_text())).parent().parent()
        agent.suspend()
        stopped.append(agent)

    report = _two_hosts_sleeping_while(freeze_second_agent, tmp_path)
    with pytest.raises(RankCrashed, match=r"rank 1 @ h2 was lost: host h2 lost: no word from"):
        report.values()
    assert stopped and not stopped[0].is_running()  # the launch ended it (and its ranks)


def test_ssh_launcher_passes_ssh_args_and_finds_the_route():
    """``ssh_args`` reach every ssh call (``ssh -G`` included: the route is found from what ssh
    itself resolves); the channel binds the local address on the route to the first host."""
    from nbaccel.launch.remote.ssh import SshLauncher

    options = remote_options("ssh", 1, ["localhost:1"], ssh_args=["-p", "2222"])
    launcher = SshLauncher(remote=options)
    assert launcher._ssh("host", "cmd") == [
        "ssh", "-p", "2222", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "host",
        "cmd",
    ]  # fmt: skip
    assert launcher.channel_address == "127.0.0.1"
    assert launcher.hosts_by_rank == {0: "localhost"}
    assert "over ssh" in launcher.describe() and "127.0.0.1" in launcher.describe()


def _fake_squeue(folder, script: str, monkeypatch) -> None:
    """A ``squeue`` on PATH that runs ``script`` (sh)."""
    import os

    squeue = folder / "squeue"
    squeue.write_text("#!/bin/sh\n" + script + "\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def test_a_slurm_allocation_that_ended_or_a_silent_controller_is_refused(tmp_path, monkeypatch):
    """Before anything starts, ``squeue`` is asked about the allocation: one that ended, or a
    controller that does not answer, is refused naming the job and what SLURM said."""
    from nbaccel.launch.remote.reachable import Unreachable, check_slurm_allocation

    invalid = 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1'
    _fake_squeue(tmp_path, invalid, monkeypatch)
    said = r"allocation 42 \(SLURM_JOB_ID\) is not running: squeue says 'slurm_load_jobs error"
    with pytest.raises(Unreachable, match=said):
        slurm_layout(2, environ={"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1"})
    _fake_squeue(tmp_path, "sleep 30", monkeypatch)
    with pytest.raises(Unreachable, match=r"SLURM controller did not answer within 1 s"):
        check_slurm_allocation("42", timeout=1.0)
    _fake_squeue(tmp_path, "echo RUNNING", monkeypatch)
    check_slurm_allocation("42")


def test_a_channel_address_not_of_this_machine_is_refused_naming_it():
    """A ``channel_address`` this machine cannot listen on is refused before any agent starts
    (not after the agents' start timeout), naming the address."""
    from nbaccel.launch.remote.ssh import SshLauncher

    for address, why in (("192.0.2.77", "is not an address of this machine"),
                         ("no-such-host.invalid", "does not resolve")):  # fmt: skip
        options = remote_options("ssh", 1, ["localhost:1"], channel_address=address)
        with pytest.raises(ValueError, match=rf"channel_address '{address}'.* {why}"):
            SshLauncher(remote=options)


def _cwd():
    import os

    return os.getcwd()


def test_a_missing_default_folder_is_a_notice_not_an_error(capsys):
    """The kernel's own folder may not exist on a host: the ranks run in the login folder
    and the notebook is told (an explicit cwd= that is missing is an error, lane-tested)."""
    plan = local_plan(["h1:1"])
    remote = dataclasses.replace(plan.remote, cwd="/no/such/nbaccel/folder")
    plan = dataclasses.replace(plan, remote=remote)
    report = run_function(plan, _cwd, renderer=TextRenderer())
    assert report.values() == [os.getcwd()]  # the agent's start folder (here: this one)
    assert "h1: no /no/such/nbaccel/folder on this host" in capsys.readouterr().err


def _hold(folder):
    import os
    import time

    open(os.path.join(folder, os.environ["RANK"]), "w").close()
    while not os.path.exists(os.path.join(folder, "done")):
        time.sleep(0.05)
    return "held", os.getppid()


def test_two_launches_at_once_share_the_agents(tmp_path):
    """A launch that runs while another holds its ranks on the same hosts (a pool and a
    ``notebook_launcher`` call): each is its own session on the one agent per host."""
    held = {}
    thread = threading.Thread(
        target=lambda: held.setdefault(
            "values",
            run_function(
                local_plan(["h1:1", "h2:1"]), _hold, (str(tmp_path),), renderer=TextRenderer()
            ).values(),
        )
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        quick = run_function(local_plan(["h1:1", "h2:1"]), _lineage, renderer=TextRenderer())
        quick = quick.values()
    finally:
        (tmp_path / "done").touch()
        thread.join(60)
    assert held["values"] == [("held", quick[0][0]), ("held", quick[1][0])]  # same fork servers
    assert len(_agent_pids(os.getpid())) == 2
