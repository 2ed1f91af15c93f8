"""Every benchmark result's stamp names a commit that is in this checkout's history (``git
cat-file -e``), so its figures can be traced to the code that produced them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def _commits(data: object) -> list[str]:
    if isinstance(data, dict):
        stamp = data.get("provenance")
        own = [str(stamp["commit"])] if isinstance(stamp, dict) and "commit" in stamp else []
        return own + [c for k, v in data.items() if k != "provenance" for c in _commits(v)]
    return []


def test_every_stamped_commit_is_in_the_history():
    try:
        shallow = _git("rev-parse", "--is-shallow-repository")
    except OSError:
        pytest.skip("git is not installed")
    if shallow.returncode != 0:
        pytest.skip("not a git checkout")
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the older commits: git fetch --unshallow")
    missing = {}
    for path in sorted(RESULTS.glob("*.json")):
        for commit in _commits(json.loads(path.read_text())):
            bare = commit.removesuffix("+changes")
            if _git("cat-file", "-e", f"{bare}^{{commit}}").returncode != 0:
                missing[path.name] = commit
    assert missing == {}
