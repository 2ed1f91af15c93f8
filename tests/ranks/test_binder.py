"""binder/ must build what pyproject.toml declares: CPU torch, every runtime dependency, nbaccel."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
BINDER = REPO / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _binder_lines() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [line.split(" #")[0].strip() for line in lines if line.strip() and line[0] != "#"]


def _binder_requirements() -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in _binder_lines() if not line.startswith("-")]
    return {canonicalize_name(r.name): r for r in reqs}


def _runtime_requirements() -> list[Requirement]:
    return [Requirement(dep) for dep in _pyproject()["project"]["dependencies"]]


def _compatible(declared: SpecifierSet, binder: SpecifierSet) -> bool:
    """binder's specifier is at least as strict as pyproject's (or pins a version it allows)."""
    if set(declared) <= set(binder):
        return True
    pins = [s.version for s in binder if s.operator == "=="]
    return bool(pins) and all(declared.contains(v, prereleases=True) for v in pins)


def test_every_runtime_dependency_is_in_binder() -> None:
    binder = _binder_requirements()
    runtime = _runtime_requirements()
    assert runtime, "pyproject.toml declares no runtime dependencies?"
    missing = [str(r) for r in runtime if canonicalize_name(r.name) not in binder]
    assert not missing, f"binder/requirements.txt lacks runtime dependencies: {missing}"
    loose = [
        f"{r} (binder: {binder[canonicalize_name(r.name)]})"
        for r in runtime
        if not _compatible(r.specifier, binder[canonicalize_name(r.name)].specifier)
    ]
    assert not loose, f"binder allows versions pyproject.toml excludes: {loose}"


def test_binder_installs_cpu_torch_and_never_accelerate() -> None:
    options = [line for line in _binder_lines() if line.startswith("-")]
    assert f"--extra-index-url {CPU_INDEX}" in options
    binder = _binder_requirements()
    assert "torch" in binder
    assert "accelerate" not in binder  # a benchmark peer, never a dependency
    assert not any(canonicalize_name(name).startswith("nvidia-") for name in binder)


def test_binder_has_the_widget_frontend() -> None:
    binder = _binder_requirements()
    assert {"ipywidgets", "jupyterlab-widgets", "widgetsnbextension"} <= set(binder)
    assert "jupyterlab" in binder or "notebook" in binder


def test_post_build_installs_nbaccel_and_enables_widgets() -> None:
    post_build = BINDER / "postBuild"
    text = post_build.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert os.access(post_build, os.X_OK), "binder/postBuild must be executable"
    assert "set -euo pipefail" in text
    assert re.search(r"pip install .*(-e \.|\s\.)(\s|$)", text), "postBuild must install nbaccel"
    assert CPU_INDEX in text
    assert "widgetsnbextension" in text and "jupyterlab-manager" in text
    syntax = subprocess.run(["bash", "-n", str(post_build)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_runtime_python_satisfies_requires_python() -> None:
    runtime = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(\d+\.\d+)", runtime)
    assert match, f"binder/runtime.txt should read python-X.Y, not {runtime!r}"
    requires = SpecifierSet(_pyproject()["project"]["requires-python"])
    assert requires.contains(Version(match.group(1)))


def test_compatibility_rule() -> None:
    """The rule above, on its own: it must reject what it is meant to reject."""
    assert _compatible(SpecifierSet(">=2.4"), SpecifierSet(">=2.4"))
    assert _compatible(SpecifierSet(">=2.4"), SpecifierSet(">=2.4,<3"))
    assert _compatible(SpecifierSet(">=2.4"), SpecifierSet("==2.5.1"))
    assert not _compatible(SpecifierSet(">=2.4"), SpecifierSet(""))
    assert not _compatible(SpecifierSet(">=2.4"), SpecifierSet("==2.3.0"))
    assert not _compatible(SpecifierSet(">=2.4"), SpecifierSet(">=2.0"))
