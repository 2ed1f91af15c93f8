"""Collectives on nested structures: two real gloo ranks, then the single-process behaviour."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

from nbaccel import (
    ShapeMismatchError,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from nbaccel.distributed.collectives import concatenate, find_batch_size, recursively_apply
from nbaccel.testing import run_on_ranks

Pair = namedtuple("Pair", ["logits", "labels"])


def _nested(rank: int) -> dict[str, Any]:
    """The same structure on every rank; values depend on the rank."""
    return {
        "list": [torch.tensor([rank, rank]), torch.tensor([[10.0 * rank]])],
        "tuple": (torch.tensor(rank + 1.0),),
        "pair": Pair(torch.full((2, 3), float(rank)), torch.tensor([rank])),
    }


def _collectives() -> dict[str, Any]:
    """Every collective on nested structures, on one pair of ranks."""
    import torch

    from nbaccel import (
        PartialState,
        broadcast,
        broadcast_object_list,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
        send_to_device,
    )

    state = PartialState()
    rank = state.process_index
    out: dict[str, Any] = {}
    out["gather"] = gather(_nested(rank))
    out["gather_scalar"] = gather(torch.tensor(rank * 2))
    out["gather_object_list"] = gather_object([f"r{rank}", rank])
    out["gather_object_dict"] = gather_object({"rank": rank})
    out["reduce_sum"] = reduce(_nested(rank), reduction="sum")
    out["reduce_mean"] = reduce(_nested(rank), reduction="mean")
    out["reduce_default"] = reduce(torch.tensor([2.0 + rank]))
    out["reduce_none"] = reduce(_nested(rank), reduction="none", scale=2.0)
    out["reduce_sum_scaled"] = reduce(torch.tensor([1.0]), reduction="sum", scale=0.5)
    from_1 = _nested(rank)
    out["broadcast_from_1"] = broadcast(from_1, from_process=1)
    out["broadcast_in_place"] = from_1["list"][0] is out["broadcast_from_1"]["list"][0]
    out["broadcast"] = broadcast(_nested(rank))
    objects = [{"lr": 0.1}, "config"] if rank == 0 else [None, None]
    out["broadcast_object_list"] = broadcast_object_list(objects)
    out["broadcast_object_list_from_1"] = broadcast_object_list([rank], from_process=1)

    # pad_across_processes: rank 0 holds 1 element, rank 1 holds 2 (the seed's example).
    out["pad_seed"] = pad_across_processes(torch.ones(rank + 1))
    uneven = {
        "ids": [torch.arange(1, rank + 3)],  # lengths 2 and 3
        "mask": (torch.ones(2, rank + 1),),  # padded on dim 1 below
        "scalar": torch.tensor(5),
    }
    out["pad_dim0"] = pad_across_processes(uneven, pad_index=-1)
    out["pad_first"] = pad_across_processes(uneven, pad_index=-1, pad_first=True)
    out["pad_dim1"] = pad_across_processes(uneven, dim=1, pad_index=7)
    out["pad_dim_neg"] = pad_across_processes(torch.ones(2, rank + 1), dim=-1)
    out["pad_then_gather"] = gather(pad_across_processes(torch.arange(rank + 1), pad_index=-1))
    out["pad_namedtuple"] = pad_across_processes(_nested(rank)["pair"])

    out["to_device"] = send_to_device(_nested(rank), state.device)
    out["to_meta"] = send_to_device(_nested(rank), "meta", skip_keys="tuple")
    return out


def test_collectives_on_nested_structures() -> None:
    r0, r1 = run_on_ranks(_collectives)
    for r in (r0, r1):
        g = r["gather"]
        assert isinstance(g, dict) and isinstance(g["list"], list) and isinstance(g["tuple"], tuple)
        assert isinstance(g["pair"], Pair)
        assert torch.equal(g["list"][0], torch.tensor([0, 0, 1, 1]))
        assert torch.equal(g["list"][1], torch.tensor([[0.0], [10.0]]))
        assert torch.equal(g["tuple"][0], torch.tensor([1.0, 2.0]))  # 0-d tensors become 1-d
        assert g["pair"].logits.shape == (4, 3) and g["pair"].logits[2:].eq(1).all()
        assert torch.equal(g["pair"].labels, torch.tensor([0, 1]))
        assert torch.equal(r["gather_scalar"], torch.tensor([0, 2]))
        assert r["gather_object_list"] == ["r0", 0, "r1", 1]
        assert r["gather_object_dict"] == [{"rank": 0}, {"rank": 1}]

        s, m = r["reduce_sum"], r["reduce_mean"]
        assert torch.equal(s["list"][0], torch.tensor([1, 1]))
        assert torch.equal(s["list"][1], torch.tensor([[10.0]]))
        assert torch.equal(s["tuple"][0], torch.tensor(3.0))
        assert torch.equal(s["pair"].logits, torch.ones(2, 3))
        assert torch.equal(m["list"][0], torch.tensor([0.5, 0.5]))
        assert torch.equal(m["pair"].logits, torch.full((2, 3), 0.5))
        assert isinstance(m["pair"], Pair) and isinstance(s["tuple"], tuple)
        assert torch.equal(r["reduce_default"], torch.tensor([2.5]))  # accelerate.utils: mean
        assert torch.equal(r["reduce_sum_scaled"], torch.tensor([1.0]))

        assert torch.equal(r["broadcast"]["list"][0], torch.tensor([0, 0]))
        assert torch.equal(r["broadcast"]["pair"].logits, torch.zeros(2, 3))
        assert torch.equal(r["broadcast_from_1"]["list"][0], torch.tensor([1, 1]))
        assert torch.equal(r["broadcast_from_1"]["tuple"][0], torch.tensor(2.0))
        assert r["broadcast_in_place"] is True
        assert r["broadcast_object_list"] == [{"lr": 0.1}, "config"]
        assert r["broadcast_object_list_from_1"] == [1]

        assert r["pad_seed"].shape == (2,)
        assert torch.equal(r["pad_then_gather"], torch.tensor([0, -1, 0, 1]))
        assert r["pad_dim_neg"].shape == (2, 2)
        assert r["pad_dim1"]["ids"][0].shape == (r0 is r and 2 or 3,)  # 1-d: no dim 1, unchanged
        assert torch.equal(r["pad_dim0"]["scalar"], torch.tensor(5))  # 0-d: unchanged
        assert isinstance(r["pad_namedtuple"], Pair)

        t, meta = r["to_device"], r["to_meta"]
        assert t["pair"].logits.device == torch.device("cpu") and isinstance(t["pair"], Pair)
        assert meta["list"][0].is_meta and meta["pair"].labels.is_meta
        assert not meta["tuple"][0].is_meta  # skip_keys

    # Values that differ per rank.
    assert torch.equal(r0["reduce_none"]["list"][1], torch.tensor([[0.0]]))
    assert torch.equal(r1["reduce_none"]["list"][1], torch.tensor([[20.0]]))  # scale=2, no comm
    assert torch.equal(r0["pad_seed"], torch.tensor([1.0, 0.0]))
    assert torch.equal(r0["pad_dim0"]["ids"][0], torch.tensor([1, 2, -1]))
    assert torch.equal(r1["pad_dim0"]["ids"][0], torch.tensor([1, 2, 3]))
    assert torch.equal(r0["pad_first"]["ids"][0], torch.tensor([-1, 1, 2]))
    assert r0["pad_dim0"]["mask"][0].shape == (2, 1)  # dim 0 already equal: untouched
    assert torch.equal(r0["pad_dim1"]["mask"][0], torch.tensor([[1.0, 7.0], [1.0, 7.0]]))
    assert torch.equal(r1["pad_dim1"]["mask"][0], torch.ones(2, 2))
    assert torch.equal(r0["pad_dim_neg"], torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


def _mismatches() -> dict[str, str]:
    """Every collective with rank-dependent shapes must raise on every rank, never hang."""
    import torch

    from nbaccel import (
        PartialState,
        ShapeMismatchError,
        broadcast,
        gather,
        pad_across_processes,
        reduce,
    )

    rank = PartialState().process_index
    cases = {
        "gather": lambda: gather(torch.zeros(2 + rank, 3)),
        "gather_nested": lambda: gather({"x": [torch.zeros(2), torch.zeros(1 + rank)]}),
        "gather_dtype": lambda: gather(torch.zeros(2, dtype=torch.float if rank else torch.long)),
        "gather_structure": lambda: gather([torch.zeros(1)] * (1 + rank)),
        "reduce": lambda: reduce(torch.zeros(3, 1 + rank), reduction="sum"),
        "broadcast": lambda: broadcast({"w": torch.zeros(4 if rank else 5)}),
        "pad_ndim": lambda: pad_across_processes(torch.zeros(*([2] * (1 + rank)))),
        "pad_structure": lambda: pad_across_processes({"a" if rank else "b": torch.zeros(1)}),
        "gather_non_tensor": lambda: gather({"x": torch.zeros(1), "name": "text"}),
        "broadcast_bad_source": lambda: broadcast(torch.zeros(1), from_process=2),
    }
    out: dict[str, str] = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except (ShapeMismatchError, TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # The process group still works after all those errors.
    out["after"] = str(gather(torch.tensor([rank])).tolist())
    return out


def test_uneven_shapes_raise_a_clear_error_on_every_rank() -> None:
    r0, r1 = run_on_ranks(_mismatches, timeout=60)
    assert r0 == r1  # every rank raised the same error
    r = r0
    assert r["gather"].startswith("ShapeMismatchError: gather needs the same tensor shapes")
    assert "rank 0: [2, 3] torch.float32; rank 1: [3, 3] torch.float32" in r["gather"]
    assert "pad_across_processes" in r["gather"]  # the hint
    assert "rank 0: ['x'][0] [2] torch.float32, ['x'][1] [1] torch.float32" in r["gather_nested"]
    assert "rank 1: ['x'][0] [2] torch.float32, ['x'][1] [2] torch.float32" in r["gather_nested"]
    assert r["gather_dtype"] == (
        "ShapeMismatchError: gather needs the same dtypes on every rank; "
        "rank 0: [2] torch.int64; rank 1: [2] torch.float32."
    )
    assert r["gather_structure"] == (
        "ShapeMismatchError: gather needs the same structure (nested lists, tuples, dicts of "
        "tensors) on every rank; rank 0: [0] [1] torch.float32; "
        "rank 1: [0] [1] torch.float32, [1] [1] torch.float32."
    )
    assert "reduce needs" in r["reduce"] and "rank 1: [3, 2]" in r["reduce"]
    assert "rank 0: ['w'] [5] torch.float32; rank 1: ['w'] [4]" in r["broadcast"]
    assert r["pad_ndim"].startswith(
        "ShapeMismatchError: pad_across_processes needs the same number of dimensions"
    )
    assert "rank 0: [2] torch.float32; rank 1: [2, 2]" in r["pad_ndim"]
    assert "same structure" in r["pad_structure"]
    assert "rank 0: ['b'] [1] torch.float32; rank 1: ['a'] [1]" in r["pad_structure"]
    assert r["gather_non_tensor"] == (
        "TypeError: gather only supports tensors inside nested lists, tuples and dicts; found "
        "['name'] (str). Use gather_object / broadcast_object_list for other objects."
    )
    assert r["broadcast_bad_source"] == (
        "ValueError: from_process=2 is not a process index (0..1)."
    )
    assert r["after"] == "[0, 1]"


# -- one process: every collective returns its input ---------------------------------------------
@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")


def test_collectives_on_one_process(single: None) -> None:
    data = {"a": [torch.tensor([1.0, 2.0])], "p": Pair(torch.ones(1), torch.zeros(1))}
    assert gather(data) is data
    assert broadcast(data) is data
    assert pad_across_processes(data) is data
    assert gather_object([1, 2]) == [1, 2] and gather_object("x") == ["x"]
    assert broadcast_object_list(["x"]) == ["x"]
    reduced = reduce(data, reduction="sum", scale=3.0)
    assert torch.equal(reduced["a"][0], torch.tensor([3.0, 6.0]))
    assert reduced["a"][0] is not data["a"][0] and isinstance(reduced["p"], Pair)
    assert torch.equal(reduce(data, reduction="max")["a"][0], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="'max', 'min' or 'none', not 'avg'"):
        reduce(data, reduction="avg")


def test_send_to_device_moves_every_leaf_and_respects_skip_keys() -> None:
    class Movable:
        def to(self, device: Any, non_blocking: bool = False) -> str:
            return f"moved to {device}"

    data = {
        "x": torch.ones(2),
        "p": Pair(torch.ones(1), [torch.zeros(1), "label"]),
        "m": Movable(),
        "keep": torch.ones(1),
        "n": 3,
    }
    moved = send_to_device(data, "meta", skip_keys=["keep"])
    assert moved["x"].is_meta and moved["p"].logits.is_meta and moved["p"].labels[0].is_meta
    assert isinstance(moved["p"], Pair) and moved["p"].labels[1] == "label"
    assert moved["m"] == "moved to meta" and moved["n"] == 3
    assert moved["keep"] is data["keep"]


def test_recursively_apply_rejects_nested_non_tensors_when_asked() -> None:
    data = {"a": [torch.ones(1), {"b": "text"}]}
    doubled = recursively_apply(lambda t: t * 2, data)
    assert doubled["a"][1] == {"b": "text"} and torch.equal(doubled["a"][0], torch.tensor([2.0]))
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\) passed to `"):
        recursively_apply(lambda t: t * 2, data, error_on_other_type=True)


def test_concatenate_and_find_batch_size() -> None:
    batches = [Pair(torch.ones(2, 3), {"y": torch.zeros(2)}) for _ in range(3)]
    joined = concatenate(batches)
    assert isinstance(joined, Pair) and joined.logits.shape == (6, 3)
    assert joined.labels["y"].shape == (6,)
    assert find_batch_size({"a": [torch.tensor(1.0), torch.ones(5, 2)]}) == 5
    assert find_batch_size({"a": "no tensors"}) is None


def test_shape_mismatch_error_is_a_runtime_error() -> None:
    assert issubclass(ShapeMismatchError, RuntimeError)


def test_accelerate_utils_import_paths() -> None:
    """Users type ``from nbaccel.utils import ...`` where they typed ``accelerate.utils``."""
    import nbaccel
    import nbaccel.utils as utils

    for name in ("set_seed", "gather", "gather_object", "reduce", "broadcast"):
        assert getattr(utils, name) is getattr(nbaccel, name)
    for name in ("pad_across_processes", "send_to_device", "broadcast_object_list"):
        assert getattr(utils, name) is getattr(nbaccel, name)
    assert set(nbaccel.__all__) <= set(dir(nbaccel))
    assert set(utils.__all__) <= set(dir(utils))


def _accelerate_semantics() -> dict[str, Any]:
    """gather of a tensor that requires grad; reduce by max and min (as Accelerate documents)."""
    import torch

    from nbaccel import PartialState, gather, reduce

    rank = PartialState().process_index
    weight = torch.tensor([1.0 + rank, 2.0], requires_grad=True)
    value = torch.tensor([float(rank), 5.0 - rank])
    return {
        "gathered": gather(weight * 2),
        "max": reduce(value, "max"),
        "min": reduce(value, "min"),
        "mean": reduce(value, "mean"),
    }


def test_gather_of_a_grad_tensor_and_reduce_max_min_on_2_ranks():
    for got in run_on_ranks(_accelerate_semantics):
        assert torch.equal(got["gathered"], torch.tensor([2.0, 4.0, 4.0, 4.0]))
        assert not got["gathered"].requires_grad
        assert torch.equal(got["max"], torch.tensor([1.0, 5.0]))
        assert torch.equal(got["min"], torch.tensor([0.0, 4.0]))
        assert torch.equal(got["mean"], torch.tensor([0.5, 4.5]))


def test_reduce_rejects_unknown_reduction_naming_the_choices():
    with pytest.raises(ValueError, match="'mean', 'sum', 'max', 'min' or 'none'"):
        reduce(torch.ones(2), "median")


def test_concatenate_returns_a_single_non_tensor_batch_as_is():
    assert concatenate(["text"]) == "text"
    with pytest.raises(TypeError, match="Can only concatenate tensors"):
        concatenate(["a", "b"])
