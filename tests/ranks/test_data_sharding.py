"""Data sharding: BatchSamplerShard / IterableDatasetShard semantics, and prepared loaders on
2 real ranks (gather_for_metrics returns exactly the dataset, resumption mid-epoch)."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from nbaccel.data import BatchSamplerShard, IterableDatasetShard, skip_first_batches
from nbaccel.testing import run_on_ranks


def _shards(n_items, batch_size, n, split=False, even=True, drop_last=False):
    sampler = BatchSampler(SequentialSampler(range(n_items)), batch_size, drop_last)
    shards = [BatchSamplerShard(sampler, n, i, split, even) for i in range(n)]
    out = [[list(b) for b in s] for s in shards]
    assert [len(o) for o in out] == [len(s) for s in shards], "len() disagrees with iteration"
    return out


def test_batches_are_dealt_in_turn_and_evened_from_the_start():
    assert _shards(9, 5, 2) == [[[0, 1, 2, 3, 4]], [[5, 6, 7, 8, 0]]]
    assert _shards(23, 5, 2) == [
        [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [20, 21, 22, 0, 1]],
        [[5, 6, 7, 8, 9], [15, 16, 17, 18, 19], [2, 3, 4, 5, 6]],
    ]
    # four processes, two batches: the missing batches repeat the first samples
    assert _shards(4, 2, 4) == [[[0, 1]], [[2, 3]], [[0, 1]], [[2, 3]]]


def test_uneven_batches_keep_only_real_samples():
    assert _shards(23, 5, 2, even=False) == [
        [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [20, 21, 22]],
        [[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]],
    ]
    # drop_last with even batches: the incomplete round is dropped by every process
    assert _shards(23, 5, 2, drop_last=True) == [
        [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]],
        [[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]],
    ]


def test_split_batches_cut_each_batch():
    assert _shards(10, 4, 2, split=True) == [
        [[0, 1], [4, 5], [8, 9]],
        [[2, 3], [6, 7], [0, 1]],
    ]
    assert _shards(10, 4, 2, split=True, even=False) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]
    with pytest.raises(ValueError, match="multiple of 2"):
        _shards(10, 5, 2, split=True)


def test_every_sample_is_covered_exactly_once_without_even_batches():
    for n_items in range(1, 30):
        for n in (2, 3):
            seen = sorted(
                s for shard in _shards(n_items, 4, n, even=False) for b in shard for s in b
            )
            assert seen == list(range(n_items))


class _Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_iterable_dataset_shard():
    shards = [list(IterableDatasetShard(_Stream(11), 2, False, 2, i)) for i in range(2)]
    # global batches of 4: [0..3] [4..7] [8,9,10 + 0]
    assert shards == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 0]]
    shard = IterableDatasetShard(_Stream(11), 2, False, 2, 1)
    list(shard)
    assert shard.last_batch_real_samples == 3
    dropped = [list(IterableDatasetShard(_Stream(11), 2, True, 2, i)) for i in range(2)]
    assert dropped == [[0, 1, 4, 5], [2, 3, 6, 7]]
    split = [list(IterableDatasetShard(_Stream(8), 4, False, 2, i, True)) for i in range(2)]
    assert split == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_skip_first_batches_on_a_plain_loader():
    loader = DataLoader(list(range(10)), batch_size=3)
    skipped = skip_first_batches(loader, 2)
    assert [b.tolist() for b in skipped] == [[6, 7, 8], [9]]
    assert len(skipped) == 2
    with pytest.raises(ValueError):
        skip_first_batches(loader, -1)


# -- 2 ranks ------------------------------------------------------------------------------------
class _Numbers(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).float())


def _metrics_on_two_ranks():
    from nbaccel import Accelerator, AcceleratorState, DataLoaderConfiguration, GradientState

    out = {}
    acc = Accelerator()
    # the documented example: 9 samples, batch 5, 2 processes -> 9 items
    loader = acc.prepare(DataLoader(torch.arange(9), batch_size=5))
    batch = next(iter(loader))
    out["doc_example"] = acc.gather_for_metrics(batch).tolist()
    # a whole evaluation loop, tensors and objects
    loader = acc.prepare(DataLoader(torch.arange(13), batch_size=3))
    tensors, objects, lengths = [], [], []
    for batch in loader:
        lengths.append(len(batch))
        tensors += acc.gather_for_metrics(batch).tolist()
        objects += acc.gather_for_metrics([f"s{int(i)}" for i in batch])
    out["eval_loop"] = tensors
    out["eval_objects"] = objects
    out["lengths"] = lengths
    # an iterable dataset, dispatched from rank 0 (the default) and sharded on every rank
    for dispatch in (None, False):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        loader = acc.prepare(DataLoader(_Numbers(11), batch_size=2))
        seen = []
        for batch in loader:
            seen += acc.gather_for_metrics(batch).tolist()
        out[f"iterable_{dispatch}"] = (type(loader).__name__, seen)
    # shuffling is identical on every rank: together the ranks see each sample once per epoch
    AcceleratorState._reset_state()
    GradientState._reset_state()
    acc = Accelerator()
    loader = acc.prepare(DataLoader(torch.arange(32), batch_size=4, shuffle=True))
    epochs = []
    for _ in range(2):
        epochs.append(sorted(acc.gather(torch.cat(list(loader))).tolist()))
    out["shuffled_epochs"] = epochs
    out["shuffled_orders"] = [b.tolist() for b in loader]
    return out


def test_gather_for_metrics_returns_exactly_the_dataset():
    ranks = run_on_ranks(_metrics_on_two_ranks)
    for rank in ranks:
        assert rank["doc_example"] == list(range(9))
        assert rank["eval_loop"] == list(range(13))
        assert rank["eval_objects"] == [f"s{i}" for i in range(13)]
        assert rank["lengths"] == [3, 3, 3]
        assert rank["iterable_None"] == ("DataLoaderDispatcher", [float(i) for i in range(11)])
        assert rank["iterable_False"] == ("DataLoaderShard", [float(i) for i in range(11)])
        assert rank["shuffled_epochs"] == [list(range(32))] * 2
    # and the two ranks got different halves of the shuffled data
    assert ranks[0]["shuffled_orders"] != ranks[1]["shuffled_orders"]
