"""The ``nbaccel`` command line, run as users run it: the console script and ``python -m``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.cli import main

REPO = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment minus launch/platform variables, plus ``extra``."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "SLURM_", "OMPI_", "PMI_", "COLAB_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("KAGGLE_KERNEL_RUN_TYPE", None)
    return {**env, **extra}


def _run(args: list[str], **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=120, env=_clean_env(**extra_env), cwd=REPO
    )


def test_console_script_prints_a_readable_report() -> None:
    script = shutil.which("nbaccel", path=str(Path(sys.executable).parent))
    assert script, "the `nbaccel` console script is not installed: run scripts/setup-env"
    done = _run([script, "env"], SLURM_JOB_ID="77", NBACCEL_AUTHKEY="do-not-print")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for heading in ("Versions:", "Devices:", "Environment:", "Variables:"):
        assert f"\n{heading}\n" in out
    assert f"torch        {torch.__version__}" in out
    assert f"nbaccel      {nbaccel.__version__}" in out
    for package in ("ipykernel", "ipywidgets", "ipython", "cloudpickle", "safetensors"):
        assert f"\n  {package} " in out
    assert f"CPUs               {os.cpu_count()} " in out
    assert "  SLURM           yes" in out and "  Colab           no" in out
    assert re.search(r"\n  SLURM_JOB_ID +77\n", out)
    assert "do-not-print" not in out  # secrets never land in bug reports
    assert "launch          single: rank 0 of 1" in out


def test_python_m_nbaccel_env_json() -> None:
    env = {"COLAB_RELEASE_TAG": "r1", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}
    done = _run([sys.executable, "-m", "nbaccel", "env", "--json"], **env)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    versions, devices, environment = info["versions"], info["devices"], info["environment"]
    assert versions["torch"] == torch.__version__
    assert versions["nbaccel"].startswith(nbaccel.__version__)
    assert versions["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert set(versions) >= {"ipykernel", "ipywidgets", "ipython", "cloudpickle", "safetensors"}
    assert "torch-xla" in versions
    assert devices["cpu_count"] == os.cpu_count() and devices["ram_total_gib"] > 0
    assert devices["cuda_available"] == torch.cuda.is_available()
    assert devices["cuda_device_count"] == len(devices["cuda_devices"])
    assert "gloo" in devices["distributed_backends"]
    assert environment["detected"]["colab"] is True
    assert environment["detected"]["kaggle"] is False
    assert environment["launch"]["rank"] == 1 and environment["launch"]["world_size"] == 2
    assert environment["variables"]["MASTER_ADDR"] == "h"


def test_bad_launch_variable_is_reported_not_a_crash(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "first")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "launch          ERROR: environment variable RANK='first' is not an integer" in out


def test_no_command_prints_help_and_fails() -> None:
    done = _run([sys.executable, "-m", "nbaccel"])
    assert done.returncode == 1
    assert "usage: nbaccel" in done.stdout and "env" in done.stdout


def test_unknown_command_is_an_argparse_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


def test_version_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"nbaccel {nbaccel.__version__}"


def test_every_command_module_registers(capsys: pytest.CaptureFixture) -> None:
    """Each module in nbaccel/commands adds a working subcommand (none is a broken stub)."""
    import argparse
    import importlib
    import pkgutil

    import nbaccel.commands
    from nbaccel.cli import build_parser

    modules = [m.name for m in pkgutil.iter_modules(nbaccel.commands.__path__)]
    assert "env" in modules
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = sorted(sub.choices)
    with_register = [
        m
        for m in modules
        if not m.startswith("_")
        and hasattr(importlib.import_module(f"nbaccel.commands.{m}"), "register")
    ]
    assert "parser" not in commands  # a helper of the commands (no register), not one
    assert len(commands) == len(with_register), commands
    for name in commands:
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0
        assert "unavailable" not in capsys.readouterr().out
