"""``nbaccel launch --hosts`` takes its rank count from the hosts when --num_processes is left
out (it used to default to 1 and then refuse the hosts' total)."""

from __future__ import annotations

import pytest

from nbaccel.commands import launch
from nbaccel.commands._launch_parser import launch_command_parser


def _request(argv: list[str], tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    args = launch_command_parser().parse_args([*argv, "train.py"])
    args, _, _ = launch._validate_launch_command(args)
    _, per_machine = launch._check_target(args)
    return launch._request(args, per_machine, None)


def test_the_hosts_say_how_many_ranks(tmp_path, monkeypatch):
    request = _request(["--hosts", "a:1,b:1"], tmp_path, monkeypatch)
    assert request.num_processes is None and request.hosts == "a:1,b:1"


def test_a_count_that_agrees_with_the_hosts_is_kept(tmp_path, monkeypatch):
    assert (
        _request(
            ["--hosts", "a:2,b:2", "--num_processes", "4"], tmp_path, monkeypatch
        ).num_processes
        == 4
    )


def test_a_count_that_disagrees_is_refused_naming_both(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="num_processes=3 but the hosts add up to 2"):
        _request(["--hosts", "a:1,b:1", "--num_processes", "3"], tmp_path, monkeypatch)
