"""split_between_processes: the seed's examples on two real ranks, the arithmetic as unit tests."""

from __future__ import annotations

import pytest
import torch

from nbaccel.distributed.work_split import split_for_process


@pytest.mark.parametrize("length", range(0, 12))
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_shares_are_contiguous_and_complete(length: int, count: int) -> None:
    data = list(range(length))
    shares = [split_for_process(data, i, count) for i in range(count)]
    assert [x for share in shares for x in share] == data
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("length", range(1, 12))
@pytest.mark.parametrize("count", [2, 3, 4])
def test_padding_gives_equal_counts_from_the_last_element(length: int, count: int) -> None:
    data = list(range(length))
    target = -(-length // count)
    for i in range(count):
        plain = split_for_process(data, i, count)
        padded = split_for_process(data, i, count, apply_padding=True)
        assert len(padded) == target
        assert padded[: len(plain)] == plain
        assert all(x == data[-1] for x in padded[len(plain) :])  # Accelerate pads so


def test_padded_tensor_keeps_trailing_dimensions() -> None:
    data = torch.arange(15).reshape(5, 3)
    padded = split_for_process(data, 1, 2, apply_padding=True)
    assert padded.shape == (3, 3)
    assert torch.equal(padded, torch.tensor([[9, 10, 11], [12, 13, 14], [12, 13, 14]]))


def test_one_process_gets_everything() -> None:
    data = {"a": [1, 2, 3]}
    assert split_for_process(data, 0, 1, apply_padding=True) is data


def test_empty_input_gives_empty_shares() -> None:
    assert split_for_process([], 1, 2, apply_padding=True) == []


def test_dict_values_must_have_the_same_length() -> None:
    with pytest.raises(ValueError, match="same length.*'a': 3.*'b': 2"):
        split_for_process({"a": [1, 2, 3], "b": [1, 2]}, 0, 2)


def test_unsupported_type_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="list, tuple, dict, tensor or datasets.Dataset, not set"):
        split_for_process({1, 2, 3}, 0, 2)


def test_a_datasets_dataset_is_split_with_select() -> None:
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets is not installed")
    data = datasets.Dataset.from_dict({"x": list(range(5))})
    shares = [split_for_process(data, i, 2, apply_padding=True)["x"] for i in range(2)]
    assert [list(s) for s in shares] == [[0, 1, 2], [3, 4, 4]]
    assert list(split_for_process(data, 2, 3)["x"]) == [4]
