"""What a new user trips on first, tried as they would: the command line, the help of the
magic, the headless notebook runner, the example notebooks' temporary folders."""

from __future__ import annotations

import io
import re
import sys

import nbformat
import pytest

from nbaccel.cli import main as nbaccel_main


def test_help_lists_only_real_commands(capsys):
    with pytest.raises(SystemExit):
        nbaccel_main(["--help"])
    text = capsys.readouterr().out
    assert "unavailable" not in text and not re.search(r"^\s+parser\b", text, re.M)
    assert re.search(r"^\s+launch\b", text, re.M)
    with pytest.raises(SystemExit) as caught:
        nbaccel_main(["parser"])
    assert caught.value.code == 2  # argparse: invalid choice, like any unknown command
    assert "invalid choice: 'parser'" in capsys.readouterr().err


def test_config_without_a_terminal_says_what_to_do(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code = nbaccel_main(["config", "--config_file", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "EOFError" not in err
    assert "standard input ended" in err and "nbaccel config default" in err
    assert not (tmp_path / "c.yaml").exists()


def test_magic_help_alone_and_headless_numbers_match_tracebacks(tmp_path, capsys):
    from nbaccel.notebook.kernel.run_headless import main as run_headless

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# a title"),
        nbformat.v4.new_code_cell("%load_ext nbaccel"),
        nbformat.v4.new_code_cell("%%distributed --help"),
        nbformat.v4.new_code_cell("%%distributed -n 2\nx = 1"),
        nbformat.v4.new_code_cell("1 / 0", metadata={"tags": ["raises-exception"]}),
        # end_training() in a pool cell keeps the pool's group for the next cells
        nbformat.v4.new_code_cell(
            "%%distributed\nfrom nbaccel import Accelerator\nAccelerator().end_training()"
        ),
        nbformat.v4.new_code_cell(
            "%%distributed\nimport torch.distributed as dist\n"
            "print('group after end_training:', dist.is_initialized())"
        ),
        nbformat.v4.new_code_cell("%dist_shutdown"),
    ]
    path = tmp_path / "first.ipynb"
    nbformat.write(nb, str(path))
    executed = tmp_path / "executed.ipynb"
    assert run_headless([str(path), "--timeout", "120", "--output", str(executed)]) == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    pool_cell = nbformat.read(str(executed), as_version=4).cells[3]
    ready = [o for o in pool_cell.outputs if "pool ready in" in o.get("text", "")]
    assert [o.name for o in ready] == ["stdout"]  # news, not shown as an error
    assert out.count("group after end_training: True") == 2
    assert "usage: %%distributed" in out and "UsageError" not in out
    assert "cell body is empty" not in out
    shown = re.findall(r"^In \[(\d+)\]: 1 / 0", out, re.M)
    named = re.findall(r"Cell In\[(\d+)\]", out)
    assert shown and named and shown[0] == named[0], (shown, named)


def test_one_extra_and_one_missing_key_give_one_report_listing_both(tmp_path, caplog):
    import logging

    import torch
    from safetensors.torch import save_file

    from nbaccel import init_empty_weights, load_checkpoint_and_dispatch
    from nbaccel.utils import CheckpointMismatchError

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)
            self.b = torch.nn.Linear(2, 2, bias=False)

    state = {k: v for k, v in Two().state_dict().items() if k != "b.weight"}
    state["extra.weight"] = torch.ones(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with init_empty_weights():
        model = Two()
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointMismatchError) as caught:
        load_checkpoint_and_dispatch(model, str(tmp_path), device_map={"": "cpu"})
    assert "missing keys (in the model, not in the checkpoint): b.weight; " in str(caught.value)
    assert "unexpected keys (in the checkpoint, not in the model): extra.weight" in str(
        caught.value
    )
    assert "extra.weight" not in caplog.text  # no separate, partial report before the error


def _quick():
    return 1


def test_a_quick_launch_reports_every_ranks_memory():
    from nbaccel import notebook_launcher
    from nbaccel.launch.driver.renderer import TextRenderer
    from nbaccel.notebook.events import MEMORY

    class Samples(TextRenderer):
        def __init__(self):
            super().__init__(quiet=True)
            self.ranks: set[int] = set()

        def event(self, rank, kind, payload):
            if kind == MEMORY:
                self.ranks.add(rank)

    renderer = Samples()
    assert notebook_launcher(_quick, num_processes=2, cpu=True, renderer=renderer) == [1, 1]
    assert renderer.ranks == {0, 1}  # the memory-peak summary lists every rank


def test_paths_the_docs_name_exist():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    missing = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # not code blocks
        for span in re.findall(r"`([^`]+)`", prose, re.S):
            path = re.sub(r"\s*\n\s*", "", span).split("::")[0].split(":")[0]
            roots = ("nbaccel/", "notebooks/", "scripts/", "docs/", "tests/", "benchmarks/")
            named = path.startswith(roots) and re.fullmatch(r"[\w./-]+", path) is not None
            if named and not (root / path.rstrip("/")).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_a_first_launch_says_why_it_waits(capsys):
    from nbaccel import notebook_launcher
    from nbaccel.launch.launchers.forkserver.launcher import shutdown_forkserver

    shutdown_forkserver()  # as in a fresh kernel: the next launch starts the server
    assert notebook_launcher(_quick, num_processes=2, cpu=True) == [1, 1]
    first = capsys.readouterr().out
    assert "starting the fork server (it imports torch once per kernel" in first
    assert notebook_launcher(_quick, num_processes=2, cpu=True) == [1, 1]
    assert "fork server" not in capsys.readouterr().out  # a warm launch only forks
