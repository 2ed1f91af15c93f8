#!/usr/bin/env python3
"""The config file's reference page, generated from the code that reads it.

    python scripts/config_reference.py     # print the Markdown page

The docs build calls :func:`render` (``scripts/docs_hooks.py``). The file's name and folder come
from ``nbaccel.commands.config.config_args`` (``default_yaml_config_file`` and the rule of
``_cache_dir``); its keys are the fields of the dataclasses that read it (``BaseConfig``,
``ClusterConfig``, ``SageMakerConfig``), with their types, defaults and the comment written
beside each field in the source. A key added there appears without editing the page.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["render"]


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its line in ``cls``'s source (empty when none)."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = lines[node.lineno - 1]
            found[node.target.id] = line.split("  # ", 1)[1].strip() if "  # " in line else ""
    return found


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
        return f"`{getattr(value, 'value', value)!r}`"
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{field.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def _table(cls: type, skip: set[str]) -> list[str]:
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_comments(klass))
    rows = ["| key | type | default | note |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        rows.append(
            f"| `{field.name}` | `{_cell(kind)}` | {_cell(_default(field))} "
            f"| {_cell(comments.get(field.name, ''))} |"
        )
    return [*rows, ""]


def _example(cluster: type) -> str:
    """The file ``nbaccel config default`` writes on a machine without a GPU."""
    import yaml

    config = cluster(
        compute_environment="LOCAL_MACHINE",
        distributed_type="NO",
        mixed_precision="no",
        use_cpu=True,
        debug=False,
        num_processes=1,
    )
    return yaml.safe_dump(config.to_dict(), sort_keys=True)


def render() -> str:
    """The Markdown page: where the config file lives and every key it may hold."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from nbaccel.commands.config import config_args

    yaml_name = os.path.basename(config_args.default_yaml_config_file)
    json_name = os.path.basename(config_args.default_json_config_file)
    folder = os.path.basename(config_args.cache_dir)
    base = {f.name for f in dataclasses.fields(config_args.BaseConfig)}
    return "\n".join(
        [
            "# Config file",
            "",
            "`nbaccel launch` takes its defaults from a config file: the file named by "
            "`--config_file`, else the default one. `nbaccel config` writes it by asking a few "
            "questions, `nbaccel config default` writes one for this machine without asking, "
            "`nbaccel config update` upgrades an older one. Flags given on the command line win "
            "over the file. The keys are Accelerate's, so a file written by `accelerate config` "
            "reads unchanged; a key nbaccel does not know is an error naming it. "
            "`notebook_launcher` and `%%distributed` do not read it: their options are "
            "keywords and flags ([launch options](launch-options.md)).",
            "",
            "This page is generated from the code that reads the file "
            "(`nbaccel/commands/config/config_args.py`) when the site is built.",
            "",
            "## Where it is",
            "",
            f"`$HF_HOME/{folder}/{yaml_name}`; `HF_HOME` defaults to "
            f"`$XDG_CACHE_HOME/huggingface`, and `XDG_CACHE_HOME` to `~/.cache`, so on most "
            f"machines: `~/.cache/huggingface/{folder}/{yaml_name}`. When only "
            f"`{json_name}` exists there, that one is read. A path ending in `.json` is read "
            "and written as JSON, any other as YAML.",
            "",
            "## Keys every file has",
            "",
            "`compute_environment` says which kind the file is: `LOCAL_MACHINE` (this machine or "
            "a cluster: the keys below) or `AMAZON_SAGEMAKER` (read so the file can be "
            "inspected; nbaccel does not start SageMaker jobs).",
            "",
            *_table(config_args.BaseConfig, set()),
            "## `LOCAL_MACHINE`: this machine or a cluster",
            "",
            "The `*_config` keys hold the mapping Accelerate writes for that engine "
            "(`fsdp_config: {fsdp_version: 2, ...}`); their entries are the same as the "
            "matching `nbaccel launch` flags without the prefix (see the "
            "[command line](cli.md#nbaccel-launch)).",
            "",
            *_table(config_args.ClusterConfig, base),
            "## `AMAZON_SAGEMAKER`",
            "",
            *_table(config_args.SageMakerConfig, base),
            "## An example",
            "",
            "What `nbaccel config default` writes on a machine without a GPU (it writes JSON, "
            "which YAML reads too; shown here as YAML):",
            "",
            "```yaml",
            _example(config_args.ClusterConfig).rstrip(),
            "```",
            "",
        ]
    )


if __name__ == "__main__":
    print(render(), end="")
