"""mkdocs hooks (``hooks:`` in mkdocs.yml): the pages the site generates instead of storing.

- ``benchmark-results.md``: the benchmark tables, from ``benchmarks/results/*.json``
  (``scripts/bench_tables.py``).
- ``reference/*.md``: the API reference, one page per group of the public names in
  ``nbaccel.__all__``, each rendered from its docstring by mkdocstrings. A name is grouped by the
  package that defines it, so a new public name appears without editing this file.
- ``reference/accelerate-names.md``: the names nbaccel serves under Accelerate's import paths
  (``nbaccel/compat/aliases.py``) that ``nbaccel.__all__`` does not hold, one entry each
  (``docs_names.py``). The build fails when a page or a notebook imports a name from nbaccel
  that has no reference entry.
- ``reference/launch-options.md``: every launch option, from ``LaunchRequest`` (the one place
  options are defined), with its default, help and spelling on each front.
- ``reference/cli.md``, ``reference/config-file.md``, ``reference/environment.md``: the command
  line (from its argparse parser), the config file (from the code that reads it) and the
  ``NBACCEL_*`` variables (from the source): ``scripts/cli_reference.py``,
  ``config_reference.py``, ``env_reference.py``.
- ``install.md``'s table of extras, from ``pyproject.toml`` (``extras_reference.py``, put where
  the page says ``{{ extras }}``).
- ``examples/*.ipynb``: the notebooks of ``notebooks/``, rendered by mkdocs-jupyter. When
  ``NBACCEL_DOCS_NOTEBOOKS`` names a folder (``scripts/docs`` executes the notebooks there), a
  notebook found in it is used instead of the stored one, so its page shows the outputs.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_tables  # noqa: E402
import cli_reference  # noqa: E402
import config_reference  # noqa: E402
import docs_names  # noqa: E402
import env_reference  # noqa: E402
import extras_reference  # noqa: E402

# (page, title, what the page covers, packages whose names it takes)
GROUPS = [
    (
        "launching",
        "Launching",
        "Running a function on many ranks from a notebook or a script, and the errors a launch "
        "raises.",
        ("nbaccel.notebook", "nbaccel.launch"),
    ),
    (
        "training",
        "Training",
        "The Accelerator and its configuration objects, plugins and helpers.",
        ("nbaccel.training", "nbaccel.data"),
    ),
    (
        "distributed",
        "Processes and collectives",
        "Who am I in the world (state objects), collectives on tensors and objects, seeds and "
        "environment detection.",
        ("nbaccel.distributed",),
    ),
    (
        "big-models",
        "Big models",
        "Empty initialisation, device maps, dispatch, CPU and disk offload, memory estimates.",
        ("nbaccel.bigmodel", "nbaccel.storage"),
    ),
]
# Names whose defining package is not where a reader looks for them.
PLACED = {"show_device_map": "big-models"}
# The order of the examples; a notebook not listed comes after these.
EXAMPLES = [
    "quickstart",
    "magics",
    "training",
    "fsdp",
    "big_model",
    "widgets",
    "multi_node",
    "many_hosts",
    "colab_kaggle_tpu",
]


# The names a reader looks for first, at the top of their page; the rest follow alphabetically.
LEAD = [
    "notebook_launcher",
    "debug_launcher",
    "LaunchRequest",
    "Accelerator",
    "PartialState",
    "AcceleratorState",
    "init_empty_weights",
    "infer_auto_device_map",
    "load_checkpoint_and_dispatch",
]


def _reading_order(name: str) -> tuple[int, str]:
    return (LEAD.index(name) if name in LEAD else len(LEAD), name.lower())


def _grouped() -> tuple[dict[str, list[str]], list[str]]:
    """Public names by group page; names no group takes."""
    nbaccel = importlib.import_module("nbaccel")
    by_page: dict[str, list[str]] = {page: [] for page, *_ in GROUPS}
    other = []
    for name in sorted(nbaccel.__all__, key=_reading_order):
        module = getattr(getattr(nbaccel, name), "__module__", "") or ""
        page = PLACED.get(name) or next(
            (p for p, _, _, packages in GROUPS if module.startswith(packages)), None
        )
        (by_page[page] if page else other).append(name)
    return by_page, other


def _reference_pages() -> dict[str, str]:
    by_page, other = _grouped()
    pages = {}
    index = [
        "# API reference",
        "",
        "Every public name of `nbaccel` (the names `from nbaccel import ...` gives), rendered "
        "from its docstring. Accelerate's import paths (`nbaccel.utils`, `nbaccel.big_modeling`, "
        "...) re-export the same objects.",
        "",
        "Beside the Python API: every [launch option](launch-options.md), the "
        "[command line](cli.md), the [config file](config-file.md) and the "
        "[environment variables](environment.md), each generated from the code.",
        "",
    ]
    for page, title, about, _ in GROUPS:
        names = by_page[page]
        index.append(f"- [{title}]({page}.md): {about} " + ", ".join(f"`{n}`" for n in names))
        body = [f"# {title}", "", about, ""]
        body += [f"::: nbaccel.{name}\n" for name in names]
        pages[f"reference/{page}.md"] = "\n".join(body)
    if other:
        index += ["", "## Other names", ""] + [f"::: nbaccel.{name}\n" for name in other]
    pages["reference/index.md"] = "\n".join(index) + "\n"
    return pages


_STAGING: list[Path] = []


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _launch_options_page() -> str:
    import dataclasses

    from nbaccel import LaunchRequest

    options = LaunchRequest.options()
    fronts = type(next(iter(options.values())).fronts)  # the Flag naming the fronts
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchRequest)}
    lines = [
        "# Launch options",
        "",
        "Every option a launch takes is defined once, as a field of `LaunchRequest`, with its "
        "default, help and checks; `notebook_launcher`'s keywords, the `%%distributed` flags and "
        "`nbaccel launch`'s flags are derived from it. This table is generated from that "
        "definition. A blank cell: the option does not apply to that front.",
        "",
        "| option | default | `notebook_launcher` | `%%distributed` | `nbaccel launch` | what |",
        "|---|---|---|---|---|---|",
    ]
    for name, option in options.items():
        default = defaults.get(name)
        default = "" if default is dataclasses.MISSING else f"`{default!r}`"
        spelled = []
        for front in (fronts.MAGIC, fronts.CLI):
            flags = option.spellings(name, front) if front in option.fronts else ()
            spelled.append(" ".join(f"`{f}`" for f in flags if "-" not in f[2:]) or "")
        keyword = f"`{name}=`" if fronts.LAUNCHER in option.fronts else ""
        lines.append(
            f"| {name} | {_cell(default)} | {keyword} | {spelled[0]} | {spelled[1]} "
            f"| {_cell(option.help)} |"
        )
    lines += [
        "",
        "The text fronts also accept each flag with hyphens (`--num-processes`). Options are "
        "checked before any rank starts; a bad value raises an error naming the option and "
        "the fix.",
    ]
    return "\n".join(lines) + "\n"


@event_priority(100)  # before mkdocs-jupyter's on_files, which claims the .ipynb files
def on_files(files: Files, config) -> Files:
    generated = {
        "benchmark-results.md": bench_tables.render(),
        "reference/launch-options.md": _launch_options_page(),
        "reference/cli.md": cli_reference.render(),
        "reference/config-file.md": config_reference.render(),
        "reference/environment.md": env_reference.render(),
        **_reference_pages(),
        "reference/accelerate-names.md": docs_names.render(),
    }
    docs_names.check_documented(ROOT)
    for uri, text in generated.items():
        files.append(File.generated(config, uri, content=text))
    executed = os.environ.get("NBACCEL_DOCS_NOTEBOOKS")
    # mkdocs-jupyter reads a notebook from its source folder: gather them under one, private to
    # this build (removed when it ends).
    staging = Path(tempfile.mkdtemp(prefix="nbaccel-docs-"))
    _STAGING.append(staging)
    (staging / "examples").mkdir()
    stored = sorted((ROOT / "notebooks").glob("*.ipynb"))
    order = {name: i for i, name in enumerate(EXAMPLES)}
    for source in sorted(stored, key=lambda p: (order.get(p.stem, len(order)), p.stem)):
        if executed and (Path(executed) / source.name).exists():
            source = Path(executed) / source.name
        shutil.copyfile(source, staging / "examples" / source.name)
        uri = f"examples/{source.name}"
        files.append(File(uri, str(staging), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """``install.md``'s table of extras, from ``pyproject.toml`` (``extras_reference.py``)."""
    if extras_reference.MARKER in markdown:
        return markdown.replace(extras_reference.MARKER, extras_reference.render())
    return markdown


def on_post_build(config) -> None:
    while _STAGING:
        shutil.rmtree(_STAGING.pop(), ignore_errors=True)
