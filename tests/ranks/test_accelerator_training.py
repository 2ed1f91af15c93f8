"""Accelerator training on 2 real gloo ranks equals one process with the global batch."""

import torch

from nbaccel.testing import run_on_ranks

SAMPLES, FEATURES = 64, 8


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, 1, generator=g)).tanh()
    return x, y


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )


def _reference(batch, accumulation, epochs, autocast_dtype=None):
    """Plain torch, one process, global batch."""
    x, y = _data()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(epochs):
        for step, start in enumerate(range(0, SAMPLES, batch)):
            xb, yb = x[start : start + batch], y[start : start + batch]
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                out = model(xb)
            loss = torch.nn.functional.mse_loss(out.float(), yb) / accumulation
            loss.backward()
            if (step + 1) % accumulation == 0:
                opt.step()
                opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train_variants():
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, AcceleratorState, GradientState

    results = {}
    for name, accumulation, precision in (
        ("plain", 1, "no"),
        ("accumulate", 2, "no"),
        ("bf16", 1, "bf16"),
    ):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        acc = Accelerator(gradient_accumulation_steps=accumulation, mixed_precision=precision)
        x, y = _data()
        model = _model()
        dtypes = []
        model[0].register_forward_hook(lambda m, i, o, seen=dtypes: seen.append(o.dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
        model, opt, loader = acc.prepare(model, opt, loader)
        grads_synced = []
        for _ in range(2):
            for xb, yb in loader:
                with acc.accumulate(model):
                    out = model(xb)
                    loss = torch.nn.functional.mse_loss(out, yb)
                    acc.backward(loss)
                    grad = model.module[0].weight.grad.clone()
                    grads_synced.append((acc.sync_gradients, acc.gather(grad[None])))
                    opt.step()
                    opt.zero_grad()
        results[name] = {
            "params": [p.detach().clone() for p in acc.unwrap_model(model).parameters()],
            "inner_dtype": dtypes[0],
            "out_dtype": out.dtype,
            "model_type": type(model).__name__,
            # accumulation steps must not all-reduce: the two ranks' gradients then differ
            "sync_pattern": [(sync, bool(torch.allclose(g[0], g[1]))) for sync, g in grads_synced],
        }
    return results


def _scheduler_and_controls():
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    acc = Accelerator()
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    steps = 0
    for xb, yb in loader:
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        opt.step()
        sched.step()
        opt.zero_grad()
        steps += 1
    # no_sync + trigger_sync_in_backward: two forwards, the second backward synchronises
    xb = x[acc.process_index * 8 : acc.process_index * 8 + 8]
    with acc.no_sync(model):
        loss_a = model(xb).sum()
        loss_b = (model(xb) * 2).sum()
    acc.backward(loss_a)
    unsynced = acc.gather(model.module[0].weight.grad.clone()[None])
    with acc.trigger_sync_in_backward(model):
        acc.backward(loss_b)
    synced = acc.gather(model.module[0].weight.grad.clone()[None])
    opt.zero_grad()
    if acc.process_index == 1:
        acc.set_trigger()
    triggered = acc.check_trigger()
    again = acc.check_trigger()
    # uneven inputs: 5 batches over 2 ranks without even_batches; Join keeps DDP from hanging
    uneven = acc.prepare(DataLoader(TensorDataset(x[:10], y[:10]), batch_size=2))
    joined_batches = 0
    with acc.join_uneven_inputs([model], even_batches=False):
        for xb, yb in uneven:
            acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
            joined_batches += 1
    return {
        "steps": steps,
        "last_epoch": sched.scheduler.last_epoch,
        "lr": sched.get_last_lr()[0],
        "unsynced_equal": bool(torch.allclose(unsynced[0], unsynced[1])),
        "synced_equal": bool(torch.allclose(synced[0], synced[1])),
        "triggered": (triggered, again),
        "joined_batches": joined_batches,
        "even_after_join": len(uneven),
    }


def test_two_ranks_match_one_process_with_global_batch():
    ranks = run_on_ranks(_train_variants, timeout=150)
    plain_ref = _reference(batch=16, accumulation=1, epochs=2)
    accum_ref = _reference(batch=16, accumulation=2, epochs=2)
    bf16_ref = _reference(batch=16, accumulation=1, epochs=2, autocast_dtype=torch.bfloat16)
    for rank in ranks:
        assert rank["plain"]["model_type"] == "DistributedDataParallel"
        for got, want in zip(rank["plain"]["params"], plain_ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(rank["accumulate"]["params"], accum_ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # bf16: autocast really ran (inner layer in bfloat16, output back in float32) ...
        assert rank["bf16"]["inner_dtype"] == torch.bfloat16
        assert rank["bf16"]["out_dtype"] == torch.float32
        # ... and training matches the single-process bf16 run within bf16 tolerance
        for got, want in zip(rank["bf16"]["params"], bf16_ref):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        # with accumulation 2: steps alternate sync False/True; unsynced grads differ per rank
        pattern = rank["accumulate"]["sync_pattern"]
        assert [s for s, _ in pattern] == [False, True] * 4
        assert all(equal == sync for sync, equal in pattern)
    # the ranks hold identical weights
    for a, b in zip(ranks[0]["accumulate"]["params"], ranks[1]["accumulate"]["params"]):
        assert torch.equal(a, b)


def test_scheduler_no_sync_and_trigger():
    ranks = run_on_ranks(_scheduler_and_controls)
    for rank in ranks:
        # 64 samples / (8 x 2 ranks) = 4 optimizer steps; the scheduler advances 2 per step
        assert rank["steps"] == 4
        assert rank["last_epoch"] == 8
        assert abs(rank["lr"] - 1.0 / 9) < 1e-9
        assert not rank["unsynced_equal"]
        assert rank["synced_equal"]
        assert rank["triggered"] == (True, False)
        assert rank["even_after_join"] == 3  # even_batches is back on after the block
    assert [r["joined_batches"] for r in ranks] == [3, 2]
