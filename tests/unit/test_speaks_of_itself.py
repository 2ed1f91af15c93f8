"""The project speaks of itself only: no page, module, benchmark or result tells how it was made
(branches, rebases, issue numbers), and every benchmark result says where its figures come from
(its date, commit and machine; that the commit is in the history is checked in
``tests/ranks/test_results_provenance.py``, which may run git)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# how the project was made, not what it is
MAKING = re.compile(r"rebase|branch issue|issue-[0-9]|\(issue [0-9]+\)", re.IGNORECASE)
STAMP = re.compile(r"^[0-9a-f]{7,40}(\+changes)?$")


def _texts() -> list[Path]:
    """What the site and the package show: docs, code, benchmarks and results, the example
    notebooks, the README and the changelog (a page of the site)."""
    folders = [ROOT / "docs", ROOT / "nbaccel", ROOT / "benchmarks", ROOT / "notebooks"]
    return [
        p
        for folder in folders
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".png", ".pyc")
    ] + [ROOT / "README.md", ROOT / "CHANGELOG.md"]


def _making(text: str) -> list[str]:
    return [m.group(0) for m in MAKING.finditer(text)]


def test_no_words_about_how_the_project_was_made():
    found = {
        str(p.relative_to(ROOT)): words
        for p in _texts()
        if (words := _making(p.read_text(errors="replace")))
    }
    assert found == {}


def _stamps(data: object) -> list[dict]:
    if isinstance(data, dict):
        own = [data["provenance"]] if isinstance(data.get("provenance"), dict) else []
        return own + [s for k, v in data.items() if k != "provenance" for s in _stamps(v)]
    return []


def test_every_result_carries_its_date_commit_and_machine():
    problems = {}
    for path in sorted(RESULTS.glob("*.json")):
        stamps = _stamps(json.loads(path.read_text()))
        if not stamps:
            problems[path.name] = "no provenance stamp"
        for stamp in stamps:
            missing = [k for k in ("date", "commit", "machine") if not stamp.get(k)]
            if missing:
                problems[path.name] = f"stamp lacks {missing}"
            elif not STAMP.match(str(stamp["commit"])):
                problems[path.name] = f"commit {stamp['commit']!r} is not a bare hash"
    assert problems == {}


def test_the_checks_see_what_they_forbid():
    assert _making("before its rebase; on branch issue 41, from issue-38 (issue 8)") == [
        "rebase",
        "branch issue",
        "issue-3",
        "(issue 8)",
    ]
    assert STAMP.match("1591ab0f9dc9+changes") and not STAMP.match("3dfd383 (branch x)")
    assert _stamps({"a": {"provenance": {"commit": "x"}}}) == [{"commit": "x"}]
