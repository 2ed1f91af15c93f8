"""DDP communication hooks checked on every rank: with each hook (none, fp16 compression,
PowerSGD, batched PowerSGD, PowerSGD wrapped in fp16) the gradients after backward are the same
on every rank and match the plain average of the ranks' own gradients. Run with
``nbaccel launch`` or ``debug_launcher(main)``."""

from __future__ import annotations

import torch

from nbaccel.distributed.collectives import gather
from nbaccel.distributed.state import AcceleratorState, GradientState
from nbaccel.training.accelerator.core import Accelerator
from nbaccel.training.config.kwargs_handlers import DistributedDataParallelKwargs

__all__ = ["main"]

# PowerSGD compresses from its 3rd step on (two plain all-reduces first); rank 4 is exact here.
_POWER = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2}
# (comm_hook, comm_wrapper, comm_state_option, tolerance: fp16 compression is lossy)
CASES = [
    ("no", "no", {}, 1e-6),
    ("fp16", "no", {}, 1e-2),
    ("power_sgd", "no", _POWER, 1e-4),
    # torch 2.13's batched PowerSGD asserts once it compresses (2-D matrices handed to its
    # orthogonalisation): checked during its warm-up only.
    ("batched_power_sgd", "no", {"matrix_approximation_rank": 4}, 1e-4),
    ("power_sgd", "fp16", _POWER, 1e-2),
]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"[rank {AcceleratorState().process_index}] {what}")


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])


def check_hook(hook: str, wrapper: str, options: dict, tolerance: float) -> None:
    """Synced gradients with ``hook`` equal the average of the ranks' local gradients."""
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    handler = DistributedDataParallelKwargs(
        comm_hook=hook, comm_wrapper=wrapper, comm_state_option=options
    )
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    torch.manual_seed(0)
    # Square weights of rank 4 at most, so PowerSGD's low-rank approximation is exact.
    layer = torch.nn.Linear(4, 4, bias=False)
    model = accelerator.prepare(layer)
    rank = accelerator.process_index
    x = torch.full((2, 4), float(rank + 1))
    with accelerator.no_sync(model):
        accelerator.backward(model(x).pow(2).sum())
    local = _grads(model)
    for _ in range(3):  # the last step goes through PowerSGD's compression
        model.zero_grad(set_to_none=True)
        accelerator.backward(model(x).pow(2).sum())
    synced = gather(_grads(model)[None])
    expected = gather(local[None]).mean(0)
    _expect(all(torch.allclose(synced[0], row) for row in synced), f"{hook}: ranks differ")
    error = (synced[0] - expected).abs().max().item() / expected.abs().max().item()
    _expect(error < tolerance, f"{hook}/{wrapper}: relative error {error:.2e} > {tolerance}")


def main() -> None:
    """Run every case on this rank; raise on the first wrong result."""
    for hook, wrapper, options, tolerance in CASES:
        check_hook(hook, wrapper, options, tolerance)
        AcceleratorState().print(f"comm hook {hook} (wrapper {wrapper}): ok")
    AcceleratorState().print("DDP communication hooks: all checks passed")


if __name__ == "__main__":
    main()
