"""transformers' ``Trainer`` from a real kernel (nbclient, widget state kept), as a user runs it:
the notebook imports transformers first (so transformers picks its HTML progress callback in the
kernel), then trains on ranks through ``notebook_launcher`` (fork server, and ``fork``) and on
the ``%%distributed`` pool. The Trainer's bar arrives as nbaccel's rank-labelled progress widget,
its logs as the metrics plot, and no HTML table or tqdm text reaches the cell."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from nbaccel.notebook.kernel.run_headless import execute_notebook, output_text

pytestmark = pytest.mark.timeout(900)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

TRAIN = """
import transformers.trainer
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
print("kernel progress callback:", transformers.trainer.DEFAULT_PROGRESS_CALLBACK.__name__)

def train(output_dir, max_steps=6):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (32, 16))]
    args = TrainingArguments(output_dir, max_steps=max_steps, per_device_train_batch_size=4,
                             logging_steps=2, learning_rate=1e-2, use_cpu=True,
                             report_to="none", save_strategy="no")
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data)
    trainer.train()
    return trainer
"""

CELLS = [
    TRAIN,
    # 1: the fork server (it preloads what the kernel imported: transformers included)
    "from nbaccel import notebook_launcher\n"
    "notebook_launcher(lambda: train('out-a') and None, num_processes=2, cpu=True)",
    # 2: ranks forked from the kernel itself inherit its transformers.trainer
    "kinds = notebook_launcher(lambda: [type(c).__name__ for c in "
    "train('out-b').callback_handler.callbacks], num_processes=2, cpu=True, "
    "start_method='fork')\nprint('callbacks', kinds[0])",
    # 3, 4, 5: the pool, the Trainer's state read in the next cell
    "%load_ext nbaccel",
    "%%distributed -n 2 --cpu --push train\ntrainer = train('out-c')",
    "%%distributed\nprint('global step', trainer.state.global_step)",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("trainer")) / "trainer.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbformat.write(nb, str(path))
    nb = execute_notebook(path, timeout=300)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return nb.cells, state


def _models(state: dict, cell) -> list[dict]:
    todo = [
        o.data[WIDGET_VIEW]["model_id"] for o in cell.outputs if WIDGET_VIEW in o.get("data", {})
    ]
    seen: list[dict] = []
    while todo:
        model = state[todo.pop()]
        seen.append(model)
        for child in model["state"].get("children", []):
            todo.append(child.removeprefix("IPY_MODEL_"))
    return seen


def _bars(state: dict, cell) -> dict[str, dict]:
    rows = {}
    for model in _models(state, cell):
        if "nbaccel-bar" in model["state"].get("_dom_classes", []):
            row = [state[c.removeprefix("IPY_MODEL_")] for c in model["state"]["children"]]
            rows[row[0]["state"]["value"]] = row[1]["state"]
    return rows


def _text(cell) -> str:
    return "".join(output_text(o) for o in cell.outputs)


def _errors(cell) -> list:
    return [o for o in cell.outputs if o.get("output_type") == "error"]


def _check_trainer_cell(state: dict, cell) -> None:
    assert not _errors(cell), _text(cell)
    bars = _bars(state, cell)
    assert list(bars) == ["<b>rank 0</b>"], bars  # the Trainer's bar is the main process's
    assert bars["<b>rank 0</b>"]["value"] == bars["<b>rank 0</b>"]["max"] == 6
    images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1, "the metrics plot, static at the end"
    shown = images[0].data["text/plain"]
    assert shown.startswith("Trainer: 3 logged steps; last: loss="), shown
    assert "learning_rate=" in shown and "grad_norm=" in shown
    streams = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    assert "it/s]" not in streams and "\r" not in streams  # no tqdm text on the streams
    every = str(cell.outputs)
    assert "Training Loss" not in every  # no transformers HTML table


def test_the_kernel_itself_picks_transformers_html_callback(executed):
    cells, _ = executed
    assert "kernel progress callback: NotebookProgressCallback" in _text(cells[0])


def test_launch_from_the_fork_server_shows_bar_and_metrics(executed):
    cells, state = executed
    _check_trainer_cell(state, cells[1])


def test_ranks_forked_from_the_kernel_use_the_bridged_bar(executed):
    cells, state = executed
    _check_trainer_cell(state, cells[2])
    assert (
        "callbacks ['DefaultFlowCallback', 'NotebookMetricsCallback', 'ProgressCallback']"
        in _text(cells[2])
    )


def test_the_pool_shows_bar_and_metrics_and_keeps_the_trainer(executed):
    cells, state = executed
    _check_trainer_cell(state, cells[4])
    text = _text(cells[5])
    assert "[rank 0] global step 6" in text and "[rank 1] global step 6" in text
