"""One definition of a launch: every front offers the options of ``LaunchRequest`` that apply to it.

Each test reads a front as a user meets it (the launcher's signature, the magic's and the command
line's parsers, ``remote_options``' keywords) and fails when it lacks an option, spells it
another way, or offers one the request does not define.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest
from IPython.core.error import UsageError

from nbaccel import notebook_launcher
from nbaccel.commands._launch_parser import launch_command_parser
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.remote.options import RemoteOptions, remote_options
from nbaccel.launch.request import Front, LaunchRequest, option, positive_number
from nbaccel.notebook.kernel.magics import DistributedMagics

# Accelerate's notebook_launcher, in its order: positional callers keep working
ACCELERATE_POSITIONAL = [
    "function", "args", "num_processes", "mixed_precision", "use_port", "master_addr",
    "node_rank", "num_nodes", "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "rdzv_id",
    "max_restarts", "monitor_interval", "log_line_prefix_template",
]  # fmt: skip


def _flags(parser) -> dict[str, set[str]]:
    """dest -> the option strings that set it, in ``parser``."""
    flags: dict[str, set[str]] = {}
    for action in parser._actions:
        flags.setdefault(action.dest, set()).update(action.option_strings)
    return flags


def _check_text_front(parser, front: Front) -> None:
    flags = _flags(parser)
    for name, spec in LaunchRequest.options(front).items():
        assert spec.dest(name, front) in flags, f"{front} lacks {name}"
        assert set(spec.spellings(name, front)) <= flags[spec.dest(name, front)], name
    others = set(LaunchRequest.options()) - set(LaunchRequest.options(front))
    assert not others & set(flags), f"{front} offers options that are not its own"


def test_notebook_launcher_takes_every_launcher_option():
    params = inspect.signature(notebook_launcher).parameters
    assert list(params)[: len(ACCELERATE_POSITIONAL)] == ACCELERATE_POSITIONAL
    defaults = LaunchRequest.defaults()
    options = LaunchRequest.options(Front.LAUNCHER)
    explicit = [p for p in params if p not in ("function", "args", "renderer", "options")]
    assert set(explicit) <= set(options)
    for name in explicit:  # the same default in the signature as in the request
        assert params[name].default == defaults[name], name
    assert params["options"].kind == inspect.Parameter.VAR_KEYWORD  # the rest: all of them
    LaunchRequest.create(Front.LAUNCHER, **{n: defaults[n] for n in options})
    with pytest.raises(TypeError, match="unknown launch option.*backend.*the options are"):
        notebook_launcher(print, backend="gloo")  # the pool's option, not the launcher's


def test_the_magic_offers_every_magic_option():
    _check_text_front(DistributedMagics.distributed.parser, Front.MAGIC)
    for name in ("ssh_args", "srun_args", "channel_address"):  # once lost by the magic
        assert name in LaunchRequest.options(Front.MAGIC)


def test_nbaccel_launch_offers_every_command_line_option():
    _check_text_front(launch_command_parser(), Front.CLI)
    args = launch_command_parser().parse_args(
        ["--num_machines", "2", "--main_process_port", "29555", "--hosts", "a:1", "x.py"]
    )
    assert (args.num_machines, args.main_process_port, args.hosts) == (2, 29555, "a:1")


def test_remote_options_are_the_requests():
    keywords = set(inspect.signature(remote_options).parameters) - {"kind", "num_processes"}
    remote = set(LaunchRequest.options(Front.REMOTE)) - {"launcher", "num_processes"}
    assert keywords == remote
    fields = {f.name for f in dataclasses.fields(RemoteOptions)}
    # hosts become the layout, the ray_* options the Ray options (RemoteOptions.ray)
    assert {n for n in remote - {"hosts"} if not n.startswith("ray_")} <= fields
    assert "ray" in fields


def test_remote_options_are_derived_from_the_request():
    request = LaunchRequest(hosts="a:1,b:2", ssh_args=["-p", "2222"], channel_address="10.0.0.1")
    assert request.remote.layout.num_processes == 3
    assert request.remote.ssh_args == ("-p", "2222")
    assert request.remote.channel_address == "10.0.0.1"
    with pytest.raises(ValueError, match="ssh_args applies only to a launch over hosts"):
        LaunchRequest(ssh_args=["-p", "2222"])
    with pytest.raises(ValueError) as refused:  # both named, and what does their job here
        LaunchRequest(cwd="/data", env={"A": "1"})
    text = str(refused.value)
    assert (
        text.startswith("cwd, env apply only to a launch over hosts") and "leave them out" in text
    )
    assert "os.chdir() first" in text and "inherit the notebook's os.environ" in text


def test_mixed_precision_is_checked_once_for_every_front():
    with pytest.raises(ValueError, match="Unknown mixed_precision 'fp12'; choose one of no, fp16"):
        LaunchRequest(mixed_precision="fp12")
    with pytest.raises(ValueError, match="Unknown mixed_precision"):
        LaunchRequest(mixed_precision="fp12", hosts="a:1")  # over hosts too
    plan = LaunchPlan.create(Front.LAUNCHER, LaunchRequest(mixed_precision="BF16", cpu=True))
    assert plan.mixed_precision == "bf16"


def test_the_magic_refuses_a_bad_option_before_a_pool_starts():
    magics = DistributedMagics(shell=None)
    with pytest.raises(UsageError, match="timeout must be a positive number"):
        magics.distributed("--timeout -1", "pass")
    with pytest.raises(UsageError, match="python applies only to a launch over hosts"):
        magics.distributed("--python /usr/bin/python3", "pass")


def test_the_command_line_refuses_a_bad_option_before_a_rank_starts(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("open(__file__ + '.ran', 'w')\n")
    done = subprocess.run(
        [sys.executable, "-m", "nbaccel", "launch", "--cpu", "--timeout", "-2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "timeout must be a positive number of seconds" in done.stderr
    assert not (tmp_path / "never.py.ran").exists()


@dataclasses.dataclass(frozen=True)
class _WithOneMore(LaunchRequest):
    """What adding an option looks like: one field (here in a subclass, for the test)."""

    log_every: float = option(
        10.0, "seconds between summaries", Front.ALL, check=positive_number("log_every"),
        parse=float,
    )  # fmt: skip


def test_adding_an_option_is_one_edit():
    flags, keywords = _WithOneMore.arguments(Front.MAGIC)["log_every"]
    assert flags == ("--log_every", "--log-every") and keywords["type"] is float
    assert "log_every" in _WithOneMore.arguments(Front.CLI)
    assert _WithOneMore.create(log_every=5).log_every == 5
    with pytest.raises(ValueError, match="log_every must be a positive number"):
        _WithOneMore.create(log_every=0)


def _hello():
    print("hello")


def test_log_line_prefix_template_prefixes_each_line(capsys):
    from nbaccel.launch.driver.renderer import TextRenderer

    template = "<${role_name} ${rank}> "
    notebook_launcher(
        _hello, num_processes=2, log_line_prefix_template=template, renderer=TextRenderer()
    )
    out = capsys.readouterr().out
    assert "<default 0> hello" in out and "<default 1> hello" in out
    with pytest.raises(ValueError, match=r"may use \$\{rank\}, \$\{local_rank\}"):
        notebook_launcher(_hello, log_line_prefix_template="${host}")
