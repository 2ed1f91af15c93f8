"""The smoke check of one extra, run by ``scripts/test-extras`` in a venv that holds only
``nbaccel[<extra>]``: what a user who installed that extra does first, so a package the project's
own environment brings but the extra does not cannot hide.

    python scripts/extras_check.py ray|deepspeed|bnb|torchao

Each check prints what it did and its seconds, and exits non-zero on the first thing that does
not hold. Run it from outside the checkout (``scripts/test-extras`` does), so ``import nbaccel``
finds the installed package, not the working tree.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _say(what: str, started: float) -> None:
    print(f"extras-check: {what} ({time.monotonic() - started:.1f} s)", flush=True)


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"extras-check: FAILED: {what}")


# ------------------------------------------------------------------------------------------ ray
def _ranks_report(tag: str) -> tuple[int, int, str]:
    from nbaccel import PartialState

    state = PartialState()
    return state.process_index, state.num_processes, tag


def _rank_one_raises() -> None:
    from nbaccel import PartialState

    if PartialState().process_index == 1:
        raise OSError("model foo/bar not found")


def check_ray() -> None:
    """A 1-node cluster (``ray start --head``, as a user starts one), then a 2-rank
    ``launcher="ray"`` launch at its address: results, and an exception arriving whole."""
    sys.path.insert(0, str(ROOT / "tests"))
    from ray_cluster import RayCluster

    from nbaccel import notebook_launcher

    try:
        import grpc  # noqa: F401

        print("extras-check: note: grpcio is installed here (Ray brought it)")
    except ImportError:
        print("extras-check: grpcio is not installed: the address check runs without it")
    # as the Ray lane does (tests/ray/conftest.py): a ~/.ray/auth_token left by any local
    # ray.init() turns token authentication on for `ray start` nodes, but not for their clients
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = time.monotonic()
    cluster = RayCluster(cpus=(2,)).start()
    try:
        _say(f"1-node Ray cluster at {cluster.address}", started)
        started = time.monotonic()
        results = notebook_launcher(
            _ranks_report, ("ok",), num_processes=2, launcher="ray", ray_address=cluster.address
        )
        _expect(results == [(0, 2, "ok"), (1, 2, "ok")], f"ray results {results!r}")
        _say(f"2-rank launcher='ray' launch returned {results}", started)
        started = time.monotonic()
        try:
            notebook_launcher(
                _rank_one_raises, num_processes=2, launcher="ray", ray_address=cluster.address
            )
        except OSError as exc:
            _expect(str(exc) == "model foo/bar not found", f"the message arrived as {exc}")
            _expect(exc.rank == 1 and exc.host is not None, f"rank/host {exc.rank}/{exc.host}")
            _say(f"rank 1's OSError arrived whole, noted {exc.__notes__}", started)
        else:
            _expect(False, "rank 1's OSError was not raised")
    finally:
        import ray

        ray.shutdown()
        cluster.stop()


# ------------------------------------------------------------------------------------ deepspeed
def _zero1_step() -> tuple[int, int, float]:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    x, y = next(iter(loader))
    before = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    moved = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    return model.zero_optimization_stage(), int(moved), float(loss.detach())


def check_deepspeed() -> None:
    """One ZeRO-1 optimizer step on 2 CPU ranks (DeepSpeed's CPU accelerator, gloo)."""
    from nbaccel import notebook_launcher

    started = time.monotonic()
    results = notebook_launcher(_zero1_step, num_processes=2, cpu=True)
    _expect([r[:2] for r in results] == [(1, 1), (1, 1)], f"ZeRO-1 step: {results!r}")
    _say(f"2-rank ZeRO-1 step: (stage, weights moved, loss) per rank {results}", started)


# ------------------------------------------------------------------------------- bnb / torchao
def _checkpoint(folder: str):
    import torch
    from safetensors.torch import save_file
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, f"{folder}/model.safetensors"
    )
    return model


def _empty():
    from torch import nn

    from nbaccel import init_empty_weights

    with init_empty_weights():
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def _quantized_load(config) -> tuple[object, float]:
    import torch

    from nbaccel.utils import load_and_quantize_model

    with tempfile.TemporaryDirectory() as folder:
        reference = _checkpoint(folder)
        model = load_and_quantize_model(_empty(), config, folder, device_map="cpu")
    x = torch.randn(4, 64)
    with torch.no_grad():
        want, got = reference(x), model(x).float()  # float32: the layers' compute dtype
    return model, float((want - got).abs().max() / want.abs().max())


def check_bnb() -> None:
    """A 4-bit (nf4) quantized load of a safetensors checkpoint on the CPU (bitsandbytes'
    CPU backend), whose output stays near the float model's."""
    import torch

    from nbaccel.utils import BnbQuantizationConfig

    started = time.monotonic()
    config = BnbQuantizationConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
        skip_modules=[],
    )  # fmt: skip
    model, error = _quantized_load(config)
    kinds = {type(model[i].weight).__name__ for i in (0, 2)}
    _expect(kinds == {"Params4bit"} and model.is_loaded_in_4bit, f"4-bit layers: {kinds}")
    _expect(error < 0.5, f"4-bit output off by {error:.3f} of the float model's")  # garbage: >> 1
    _say(f"4-bit nf4 load: layers {sorted(kinds)}, output within {error:.3f}", started)


def check_torchao() -> None:
    """int8 weight-only quantization (torchao) of a safetensors checkpoint on the CPU."""
    from nbaccel.utils import TorchAoConfig

    started = time.monotonic()
    model, error = _quantized_load(TorchAoConfig("int8_weight_only"))
    kind = type(model[0].weight).__name__
    _expect(kind not in ("Parameter", "Tensor"), f"int8 layer left a plain {kind}")
    _expect(error < 0.05, f"int8 output off by {error:.3f} of the float model's")
    _say(f"torchao int8 weight-only load: weight {kind}, output within {error:.4f}", started)


CHECKS = {
    "ray": check_ray,
    "deepspeed": check_deepspeed,
    "bnb": check_bnb,
    "torchao": check_torchao,
}


def main() -> int:
    extra = sys.argv[1] if len(sys.argv) == 2 else ""
    if extra not in CHECKS:
        print(f"usage: extras_check.py {{{','.join(CHECKS)}}}", file=sys.stderr)
        return 2
    import nbaccel

    where = Path(nbaccel.__file__).resolve()
    _expect(ROOT not in where.parents, f"nbaccel imported from the checkout ({where})")
    print(f"extras-check: nbaccel {metadata.version('nbaccel')} from {where.parent}", flush=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    CHECKS[extra]()
    print(f"extras-check: {extra} passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
