"""Merging a sharded FSDP2 checkpoint, checked on every rank: the model is sharded over the
ranks, trained a step, saved as ``SHARDED_STATE_DICT``; ``merge_fsdp_weights`` (what
``nbaccel merge-weights`` runs) then writes one file (safetensors, and pickle) that a plain
model loads with exactly the trained weights. Run with ``nbaccel launch`` or
``debug_launcher(main)``."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from nbaccel.distributed.collectives import broadcast_object_list
from nbaccel.distributed.state import AcceleratorState, GradientState
from nbaccel.training.accelerator.core import Accelerator
from nbaccel.training.strategies.fsdp.checkpoint import merge_fsdp_weights, save_fsdp_model
from nbaccel.training.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

__all__ = ["main"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(_Block(), _Block())
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"[rank {AcceleratorState().process_index}] {what}")


def _trained_sharded_checkpoint(folder: str) -> tuple[Accelerator, dict[str, torch.Tensor]]:
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["_Block"], state_dict_type="SHARDED_STATE_DICT"
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    full = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
    save_fsdp_model(plugin, model, folder)
    return accelerator, full


def _check_file(path: str, expected: dict[str, torch.Tensor]) -> None:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, weights_only=True)
    plain = _Net()
    plain.load_state_dict(state)  # strict: every key, no extra
    for name, tensor in plain.state_dict().items():
        _expect(torch.equal(tensor, expected[name]), f"{os.path.basename(path)}: {name} differs")


def main() -> None:
    """Run every check on this rank; raise on the first wrong result."""
    main_rank = AcceleratorState().is_main_process
    folder = [tempfile.mkdtemp(prefix="nbaccel-merge-") if main_rank else None]
    broadcast_object_list(folder)  # one folder for the whole world (ranks share this host)
    accelerator, expected = _trained_sharded_checkpoint(folder[0])
    shards = os.path.join(folder[0], "pytorch_model_fsdp_0")
    merged = merge_fsdp_weights(shards, os.path.join(folder[0], "merged"))
    pickled = merge_fsdp_weights(
        shards, os.path.join(folder[0], "merged_bin"), safe_serialization=False
    )
    if accelerator.is_main_process:
        _check_file(merged, expected)
        _check_file(pickled, expected)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder[0])
    accelerator.print("merge weights: all checks passed")


if __name__ == "__main__":
    main()
