"""split_between_processes: the seed's examples on two real ranks, the arithmetic as unit tests.

This file holds the checks that start ranks; the others are in tests/unit/test_split.py."""

from __future__ import annotations

from typing import Any

import torch

from nbaccel.testing import run_on_ranks


def _splits() -> dict[str, Any]:
    from nbaccel import PartialState

    state = PartialState()
    cases: dict[str, tuple[Any, bool]] = {
        "list": (["A", "B", "C"], False),
        "list_padded": (["A", "B", "C"], True),
        "tuple": (("A", "B", "C"), False),
        "tuple_padded": (("A", "B", "C"), True),
        "dict": ({"a": [1, 2, 3], "b": ("x", "y", "z")}, False),
        "dict_padded": ({"a": [1, 2, 3], "b": torch.arange(3)}, True),
        "tensor": (torch.arange(6).reshape(3, 2), False),
        "tensor_padded": (torch.arange(6).reshape(3, 2), True),
        "even": (["a dog", "a cat"], False),
        "fewer_than_processes": (["only"], True),
    }
    out: dict[str, Any] = {}
    for name, (inputs, padding) in cases.items():
        with state.split_between_processes(inputs, apply_padding=padding) as share:
            out[name] = share
    return out


def test_split_between_processes_on_two_ranks() -> None:
    r0, r1 = run_on_ranks(_splits)
    # The seed's examples, exactly.
    assert (r0["list"], r1["list"]) == (["A", "B"], ["C"])
    assert (r0["list_padded"], r1["list_padded"]) == (["A", "B"], ["C", "C"])
    assert (r0["even"], r1["even"]) == (["a dog"], ["a cat"])
    # Tuples stay tuples.
    assert (r0["tuple"], r1["tuple"]) == (("A", "B"), ("C",))
    assert (r0["tuple_padded"], r1["tuple_padded"]) == (("A", "B"), ("C", "C"))
    # Dicts are split value by value.
    assert r0["dict"] == {"a": [1, 2], "b": ("x", "y")}
    assert r1["dict"] == {"a": [3], "b": ("z",)}
    assert r1["dict_padded"]["a"] == [3, 3]
    assert torch.equal(r1["dict_padded"]["b"], torch.tensor([2, 2]))
    # Tensors are split on the first dimension.
    assert torch.equal(r0["tensor"], torch.tensor([[0, 1], [2, 3]]))
    assert torch.equal(r1["tensor"], torch.tensor([[4, 5]]))
    assert torch.equal(r1["tensor_padded"], torch.tensor([[4, 5], [4, 5]]))
    # Fewer inputs than processes: padding repeats the last element.
    assert (r0["fewer_than_processes"], r1["fewer_than_processes"]) == (["only"], ["only"])
