"""DDP communication hooks (Accelerate's DDPCommunicationHookType) on 2 real gloo ranks: the
hook is registered on the DDP model, PowerSGD options are honoured, training still agrees."""

import pytest
import torch
from torch import nn

from nbaccel.testing import run_on_ranks


def _train(comm_hook, comm_wrapper, state_option):
    from nbaccel import Accelerator, DistributedDataParallelKwargs

    handler = DistributedDataParallelKwargs(
        comm_hook=comm_hook, comm_wrapper=comm_wrapper, comm_state_option=state_option
    )
    accelerator = Accelerator(kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)  # different data per rank
    losses, grads_equal = [], []
    for _ in range(6):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        peer = grad.clone()
        torch.distributed.broadcast(peer, src=0)
        grads_equal.append(torch.allclose(grad, peer))
        optimizer.step()
        losses.append(loss.item())
    hook_name = model._get_ddp_logging_data().get("comm_hook")
    state = getattr(model, "comm_hook_state", None)
    if state is None:
        return hook_name, grads_equal, losses, None
    # The low-rank factors PowerSGD keeps grow with matrix_approximation_rank.
    factors = sum(p.numel() for p in state.p_memory_dict.values())
    return hook_name, grads_equal, losses, (state.iter, state.start_powerSGD_iter, factors)


@pytest.mark.parametrize(
    "comm_hook, comm_wrapper, expected",
    [
        ("fp16", "no", "fp16_compress_hook"),
        ("power_sgd", "no", "powerSGD_hook"),
        ("batched_power_sgd", "no", "batched_powerSGD_hook"),
        ("power_sgd", "fp16", "fp16_compress_wrapper"),
    ],
)
def test_comm_hook_is_registered_and_training_agrees(comm_hook, comm_wrapper, expected):
    from nbaccel.training.config.kwargs_handlers import DDPCommunicationHookType

    hook = DDPCommunicationHookType(comm_hook)  # Accelerate's enum works as well as strings
    options = {"matrix_approximation_rank": 2} if "power" in comm_hook else {}
    for name, grads_equal, losses, *_ in run_on_ranks(
        _train, 2, args=(hook, comm_wrapper, options)
    ):
        assert expected in name, name
        assert all(grads_equal)  # the hook's all-reduce still gives every rank the same gradient
        assert losses[-1] < losses[0]


def test_power_sgd_state_options_are_honoured():
    options = {"matrix_approximation_rank": 3, "start_powerSGD_iter": 4, "min_compression_rate": 1}
    name, grads_equal, _, (iters, start, factors) = run_on_ranks(
        _train, 2, args=("power_sgd", "no", options)
    )[0]
    assert "powerSGD_hook" in name and all(grads_equal)
    assert (iters, start) == (6, 4) and factors > 0  # compression ran from step 4 on
    rank_one = {**options, "matrix_approximation_rank": 1}
    *_, (_, _, factors_one) = run_on_ranks(_train, 2, args=("power_sgd", "no", rank_one))[0]
    assert factors == 3 * factors_one  # rank-3 factors are 3 times the rank-1 ones


def _bf16_on_gloo():
    try:
        _train("bf16", "no", {})
    except ValueError as err:
        return str(err)
    return None


def test_bf16_hook_on_gloo_is_a_clear_error():
    # torch only all-reduces bf16 on NCCL/XCCL: the error says so and names the fix.
    for message in run_on_ranks(_bf16_on_gloo, 2):
        assert "comm_hook='fp16'" in message


def test_bad_hook_names_fail_clearly():
    from nbaccel import DistributedDataParallelKwargs

    with pytest.raises(ValueError, match="comm_hook must be one of"):
        DistributedDataParallelKwargs(comm_hook="int8")
    with pytest.raises(ValueError, match="comm_wrapper compresses"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="power_sgd")
