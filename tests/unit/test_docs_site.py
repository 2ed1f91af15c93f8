"""The documentation site: the strict build passes, and it would fail on what it guards against.

The build runs in this process (mkdocs' own ``build``), without executing the example notebooks
(the notebooks run in their own tests; ``scripts/docs`` executes them for the published site).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mkdocs", reason="the docs site needs mkdocs (pip install -e .[docs])")

from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

import nbaccel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_tables  # noqa: E402


def _build(config_file: Path, site: Path) -> None:
    config = load_config(str(config_file), site_dir=str(site), strict=True)
    config.plugins.on_startup(command="build", dirty=False)
    try:
        build(config)
    finally:
        config.plugins.on_shutdown()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``scripts/docs --no-execute`` builds it: strict, so any warning aborts."""
    out = tmp_path_factory.mktemp("site")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        patch.delenv("NBACCEL_DOCS_NOTEBOOKS", raising=False)
        _build(ROOT / "mkdocs.yml", out)
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def test_every_public_name_has_its_reference_entry(site: Path) -> None:
    pages = "".join(p.read_text() for p in (site / "reference").rglob("index.html"))
    documented = set(re.findall(r'id="nbaccel\.(\w+)"', pages))
    assert set(nbaccel.__all__) <= documented, set(nbaccel.__all__) - documented


def test_every_example_notebook_is_a_page(site: Path) -> None:
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        page = _page(site, f"examples/{notebook.stem}")
        first_code = next(
            c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"
        )
        first_line = "".join(first_code["source"]).strip().splitlines()[0]
        words = re.findall(r"\w+", first_line)
        assert all(w in page for w in words), (notebook.name, first_line)


def test_results_and_options_pages_come_from_their_sources(site: Path) -> None:
    results = _page(site, "benchmark-results")
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f"benchmarks/results/{path.name}" in results
    options = _page(site, "reference/launch-options")
    for name in nbaccel.LaunchRequest.options():
        assert f"<td>{name}</td>" in options, name


def test_command_line_config_and_environment_pages_come_from_the_code(site: Path) -> None:
    """The generated references hold every command and flag of the parser, every key of the
    config file, every ``NBACCEL_*`` variable of the source and every extra of pyproject."""
    import argparse

    import env_reference
    import extras_reference

    from nbaccel.cli import build_parser
    from nbaccel.commands.config.config_args import ClusterConfig

    cli = _page(site, "reference/cli")

    def check(prefix: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    assert f"{prefix} {name}" in cli, name
                    check(f"{prefix} {name}", sub)
            elif not isinstance(action, argparse._HelpAction):
                for flag in action.option_strings:
                    assert f"<code>{flag}</code>" in cli, (prefix, flag)

    check("nbaccel", build_parser())
    assert "<code>--zero_stage</code>" in cli
    config = _page(site, "reference/config-file")
    assert "default_config.yaml" in config
    for key in ClusterConfig.__dataclass_fields__:
        assert f"<code>{key}</code>" in config, key
    environment = _page(site, "reference/environment")
    for name in env_reference.collect():
        assert name in environment, name
    install = _page(site, "install")
    assert "{{ extras }}" not in install
    for extra in extras_reference.extras():
        assert f".[{extra}]" in install.replace("&quot;", '"'), extra


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The site's own validation settings, on a two-page site with one bad link each."""
    validation = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("hooks:")[0])["validation"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#a-heading)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    config = {"site_name": "t", "docs_dir": str(docs), "validation": validation}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    _build(tmp_path / "mkdocs.yml", tmp_path / "site")  # the anchor exists: it builds
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-anchor)\n")
    with pytest.raises(Abort, match="strict mode"):
        _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    (docs / "index.md").write_text("# Home\n\n[there](missing.md)\n")
    with pytest.raises(Abort, match="strict mode"):
        _build(tmp_path / "mkdocs.yml", tmp_path / "site")


def test_bench_tables_say_where_each_figure_comes_from(tmp_path: Path) -> None:
    stamp = {"date": "2026-01-02T03:04:05+00:00", "commit": "abc123", "machine": "8 x CPU"}
    (tmp_path / "launcher.json").write_text(
        json.dumps({"nbaccel_median_s": 0.0123456, "times": [1, 2, 3], "provenance": stamp})
    )
    (tmp_path / "new_bench.json").write_text(json.dumps({"rows": [{"a": 1, "b": True}]}))
    page = bench_tables.render(tmp_path)
    assert "Measured 2026-01-02T03:04:05+00:00 at commit `abc123` on: 8 x CPU." in page
    assert "| nbaccel_median_s | 0.01235 |" in page
    assert "| times | 3 values, 1 to 3, median 2 |" in page
    # a file without a stamp says so, and a file the script does not know is still shown
    assert "## new bench" in page and "carries no provenance stamp" in page
    assert "| 1 | yes |" in page


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "./scripts/quickstart\n" in readme and "./scripts/test\n" in readme


def test_the_docs_speak_of_the_project_only() -> None:
    """No page tells how the project was written (the changelog tells how it grew)."""
    diary = re.compile(
        r"\b(?:\w+th|this|that|the|previous|next|each|earlier) sessions?\b(?! of its own)"
        r"|\brounds? of work\b|has not run on one yet|\bANCHORS\.md\b",
        re.I,
    )
    texts = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")]
    found = [f"{p.name}: {m.group(0)}" for p in texts for m in diary.finditer(p.read_text())]
    assert not found, found


# Names Accelerate's guides (and nbaccel's) import from submodules, beside nbaccel.__all__.
ACCELERATE_NAMES = [
    "BnbQuantizationConfig",
    "load_and_quantize_model",
    "AORecipeKwargs",
    "DummyOptim",
    "prepare_pippy",
    "TorchTensorParallelPlugin",
    "GatheredParameters",
    "merge_fsdp_weights",
    "ParallelismConfig",
    "DeepSpeedPlugin",
]


def test_every_name_the_docs_or_accelerate_use_has_an_entry(site: Path) -> None:
    import docs_names

    pages = "".join(p.read_text() for p in (site / "reference").rglob("index.html"))
    entries = set(re.findall(r'<h2 id="[\w.]*?\.?(\w+)"', pages))
    for name in (
        ACCELERATE_NAMES + sorted(docs_names.alias_names()) + sorted(docs_names.module_names())
    ):
        assert name in entries or f">{name}</" in pages, name
    imported = {name for _, _, name in docs_names.imports()}
    assert {"notebook_launcher", "Accelerator"} <= imported  # the scan sees the guides


def test_an_import_the_reference_cannot_document_fails_the_build(tmp_path: Path) -> None:
    import docs_names

    (tmp_path / "docs").mkdir()
    (tmp_path / "notebooks").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "```python\nfrom nbaccel.utils import (\n    DummyOptim,\n    merge_fsdp_weights,\n)\n```\n"
    )
    docs_names.check_documented(tmp_path)  # both exist
    page.write_text("```python\nfrom nbaccel.utils import NoSuchThing\n```\n")
    with pytest.raises(RuntimeError, match=r"docs/page.md: nbaccel.utils.NoSuchThing"):
        docs_names.check_documented(tmp_path)
