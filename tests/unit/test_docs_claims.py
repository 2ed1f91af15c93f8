"""What the docs state that can be checked mechanically is true: every ``NBACCEL_*`` variable,
file path, command-line flag and import they name exists, and the defaults they state are the
code's."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import docs_names  # noqa: E402
import env_reference  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in PAGES]


def test_every_variable_named_exists_in_the_source():
    known = set(env_reference.collect())  # the package's variables
    scripts = "".join(p.read_text() for p in (ROOT / "scripts").iterdir() if p.is_file())
    named = {(w, v) for w, t in _texts() for v in re.findall(r"\bNBACCEL_[A-Z0-9_]*[A-Z0-9]\b", t)}
    unknown = sorted((w, v) for w, v in named if v not in known and v not in scripts)
    assert not unknown, unknown


def test_every_file_named_exists():
    pattern = (
        r"`((?:tests|scripts|benchmarks|notebooks|nbaccel|docs)/[\w./-]+\.(?:py|ipynb|md|json|txt))"
    )
    named = {(w, p) for w, t in _texts() for p in re.findall(pattern, t)}
    missing = sorted((w, p) for w, p in named if "*" not in p and not (ROOT / p).exists())
    assert not missing, missing


def _flags(parser: argparse.ArgumentParser, prefix: str = "nbaccel") -> dict[str, set[str]]:
    found = {prefix: set()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_flags(sub, f"{prefix} {name}"))
        else:
            found[prefix].update(action.option_strings)
    return found


def test_every_command_line_flag_in_the_docs_is_accepted():
    """Each ``nbaccel <command> --flag`` written in a code block or inline code."""
    from nbaccel.cli import build_parser

    flags = _flags(build_parser())
    bad = []
    for where, text in _texts():
        for line in re.findall(r"^\s*(nbaccel [^\n#`]*)", text, re.M) + re.findall(
            r"`(nbaccel [^`]*)`", text
        ):
            line = re.split(r"\S+\.(?:py|ipynb)\b", line)[0]  # the script's own flags follow
            words = line.split()
            command = "nbaccel"
            for word in words[1:]:
                if f"{command} {word}" in flags:
                    command = f"{command} {word}"
                else:
                    break
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line):
                spelled = {flag, flag.replace("-", "_").replace("__", "--", 1)}
                if command != "nbaccel" and not spelled & flags[command]:
                    bad.append((where, command, flag))
    assert not bad, bad


def test_every_import_in_the_docs_resolves():
    docs_names.check_documented(ROOT)
    assert len(docs_names.imports(ROOT)) > 50  # the scan reads the code blocks


def _default(cls: type, name: str) -> object:
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls)}[name]
    return inspect.signature(cls).parameters[name].default


# (what a page says, the page, the object, the field or parameter, its value)
DEFAULTS = [
    ('`"auto"` (default)', "docs/launching.md", "LaunchRequest", "start_method", "auto"),
    (
        "`even_batches=True`, the default",
        "docs/concepts/synchronisation.md",
        "DataLoaderConfiguration",
        "even_batches",
        True,
    ),
    (
        "`Accelerator(step_scheduler_with_optimizer=False)` passes",
        "docs/concepts/batch-size.md",
        "Accelerator",
        "step_scheduler_with_optimizer",
        True,
    ),
    ('`"no"` (default)', "docs/concepts/precision.md", "Accelerator", "mixed_precision", None),
    ("FSDP2", "docs/concepts/parallelism.md", "FullyShardedDataParallelPlugin", "fsdp_version", 2),
]


@pytest.mark.parametrize(("said", "page", "owner", "name", "value"), DEFAULTS)
def test_the_defaults_the_docs_state_are_the_codes(said, page, owner, name, value):
    import nbaccel

    assert said in (ROOT / page).read_text(), (page, said)
    assert _default(getattr(nbaccel, owner), name) == value


def test_fp8_hardware_is_compute_capability_8_9_as_the_docs_say():
    from nbaccel.distributed import host_info

    source = inspect.getsource(host_info)
    assert ">= (8, 9)" in source
    for page in ("docs/concepts/precision.md", "docs/quantization.md", "docs/colab-kaggle.md"):
        text = (ROOT / page).read_text()
        assert "8.9" in text and "Hopper-class" not in text, page


def test_a_missing_tracker_is_skipped_with_a_warning_as_the_docs_say():
    from nbaccel import Accelerator

    assert "is skipped with a warning" in " ".join(
        (ROOT / "docs" / "training.md").read_text().split()
    )
    with pytest.warns(UserWarning, match=r"Tracker 'aim' is skipped.*pip install aim"):
        accelerator = Accelerator(cpu=True, log_with=["aim"])
    accelerator.init_trackers("claims")
    assert accelerator.trackers == []


def test_the_checks_see_what_they_forbid():
    assert re.findall(r"\bNBACCEL_[A-Z0-9_]*[A-Z0-9]\b", "`NBACCEL_NO_SUCH` x") == [
        "NBACCEL_NO_SUCH"
    ]
    from nbaccel.cli import build_parser

    flags = _flags(build_parser())
    assert "--num_processes" in flags["nbaccel launch"]
    assert "--no_such_flag" not in flags["nbaccel launch"]
    assert (
        re.split(r"\S+\.(?:py|ipynb)\b", "nbaccel launch -n 2 train.py --lr 1")[0].split()[-1]
        == "2"
    )


def _user_pages() -> list[Path]:
    """Home, getting started, install, the tutorials, the how-to guides and the concept pages:
    the pages a user reads to get work done (benchmarks and development pages hold figures)."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entry: object) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, dict):
            return [p for value in entry.values() for p in pages(value)]
        return [p for item in entry for p in pages(item)] if isinstance(entry, list) else []

    sections = {title: pages(body) for e in nav if isinstance(e, dict) for title, body in e.items()}
    wanted = ["index.md", *sections["Tutorials"], *sections["How-to guides"], *sections["Concepts"]]
    return [ROOT / "docs" / p for p in wanted if p.endswith(".md")]


# What belongs on the benchmark pages, or nowhere a user reads: a commit hash, a load average,
# a measurement's date, a test lane (how the project tests itself).
DIARY = {
    "a commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
    "a load average": r"\bload average",
    "a date": r"\b20\d\d-[01]\d-[0-3]\d\b",
    "a test lane": r"\blanes?\b",
}


def test_user_pages_carry_no_benchmark_diary_and_no_lane_words():
    found = [
        f"{page.relative_to(ROOT)}: {what} ({m.group(0)!r})"
        for page in _user_pages()
        for what, pattern in DIARY.items()
        for m in re.finditer(pattern, page.read_text(), re.I)
    ]
    assert not found, found


def test_the_notebooks_carry_no_lane_words():
    found = [
        f"{path.name}: {m.group(0)!r}"
        for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
        for m in re.finditer(DIARY["a test lane"], path.read_text(), re.I)
    ]
    assert not found, found


def test_every_user_page_shows_code():
    bare = [str(p.relative_to(ROOT)) for p in _user_pages() if "```" not in p.read_text()]
    assert not bare, bare


def test_the_user_page_checks_see_what_they_forbid():
    pages = {str(p.relative_to(ROOT / "docs")) for p in _user_pages()}
    assert {"index.md", "getting-started.md", "install.md", "launching.md"} <= pages
    assert {"concepts/launch.md", "tutorials/convert-a-loop.md"} <= pages
    assert "benchmarks.md" not in pages and "development.md" not in pages
    diary = "2026-11-28, commit `b2b240c` (load average 1.0-2.3) in the hosts lane"
    assert [w for w, p in DIARY.items() if re.search(p, diary, re.I)] == list(DIARY)
    plain = "run 20261128-101500-3f2a on cuda:0 with the deadline 2 planes away; see `accelerate`"
    assert not [w for w, p in DIARY.items() if re.search(p, plain, re.I)]
