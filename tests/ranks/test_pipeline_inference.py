"""prepare_pippy on torch.distributed.pipelining over real gloo ranks: a tiny transformers Llama
split over 2 and 4 ranks (one stage each) returns the unsplit model's logits, in the model's own
output type (``output[0]`` / ``.logits`` as in Accelerate), with "auto" cutting only between
decoder layers, explicit split points, gather_output=True, and a batch that does not divide into
the micro-batches. The example is traced whole, as one micro-batch (as Accelerate does). Bad split
points are refused before tracing."""

from __future__ import annotations

import pytest
import torch
from _llama import VOCAB, tiny_llama

from nbaccel.testing import run_on_ranks


def _inputs(n: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, 16), generator=torch.Generator().manual_seed(3))


def _pipelined(layers: int):
    from nbaccel.bigmodel.pipeline import prepare_pippy
    from nbaccel.distributed.state import PartialState

    state = PartialState()
    out = {}
    ids = _inputs()
    example = (ids[:2],)  # one micro-batch: calls of 4 rows run as 2 micro-batches of 2
    if state.num_processes == 2:  # "auto", the output on the last stage only
        model = tiny_llama(layers=layers).eval()
        model = prepare_pippy(model, split_points="auto", example_args=example)
        out["auto_points"] = model.hf_split_points
        with torch.no_grad():
            output = model(ids)
        out["type"] = type(output).__name__
        out["auto"] = None if output is None else output[0].clone()
        split = {"split_points": ["model.layers.2"]}  # explicit, gathered
    else:
        split = {}  # "auto", gathered
    model = tiny_llama(layers=layers).eval()
    model = prepare_pippy(model, example_args=example, num_chunks=2, gather_output=True, **split)
    out["points"] = model.hf_split_points
    with torch.no_grad():
        out["gathered"] = model(ids).logits.clone()
        out["odd"] = model(_inputs(3)).logits.clone()  # 3 rows padded to 2 chunks of 2, trimmed
    return out


def _reference(layers: int, n: int = 4) -> torch.Tensor:
    model = tiny_llama(layers=layers).eval()
    with torch.no_grad():
        return model(_inputs(n)).logits


@pytest.mark.parametrize(("ranks", "layers"), [(2, 4), (4, 4)])
def test_pipeline_returns_the_unsplit_logits(ranks, layers):
    results = run_on_ranks(_pipelined, ranks, args=(layers,), timeout=400)
    ref, ref3 = _reference(layers), _reference(layers, 3)
    *others, last = results
    for r in results:  # gather_output=True: every rank has the output
        assert torch.allclose(r["gathered"], ref, atol=1e-5)
        assert r["odd"].shape == ref3.shape and torch.allclose(r["odd"], ref3, atol=1e-5)
    if ranks == 2:
        assert last["points"] == ["model.layers.2"]
        assert last["auto_points"] == ["model.layers.2"]  # balanced: 2 of 4 layers per stage
        assert torch.allclose(last["auto"], ref, atol=1e-5)
        assert all(r["auto"] is None for r in others)  # only the last stage has the output
        assert last["type"] == "CausalLMOutputWithPast"
    else:  # "auto" cut the 4 layers at layer starts, one per stage
        assert last["points"] == ["model.layers.1", "model.layers.2", "model.layers.3"]
