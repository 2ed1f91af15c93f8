"""``use_stateful_dataloader=True`` as Accelerate documents it: prepared loaders *are* torchdata
``StatefulDataLoader``s, their ``state_dict`` matches a plain StatefulDataLoader that yielded
the same batches, and loading it resumes right after the last yielded batch (also through
``save_state``/``load_state`` on 2 gloo ranks). Plus native sharding of Hugging Face streaming
datasets."""

import pytest
import torch
from torch.utils.data import DataLoader

from nbaccel.testing import run_on_ranks

stateful = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful.StatefulDataLoader


def _loaders():
    from nbaccel.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader

    def g():
        return torch.Generator().manual_seed(7)

    data = list(range(32))
    options = {"batch_size": 4, "generator": g(), "use_stateful_dataloader": True}
    return [
        SkipDataLoader(data, **options),
        DataLoaderShard(data, **options),
        DataLoaderDispatcher(data, **options),
    ]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["skip", "shard", "dispatcher"])
def test_state_dict_matches_torchdata_and_resumes(index):
    reference = StatefulDataLoader(
        list(range(32)), batch_size=4, generator=torch.Generator().manual_seed(7)
    )
    loader = _loaders()[index]
    assert isinstance(loader, StatefulDataLoader) and isinstance(loader, DataLoader)
    assert isinstance(loader.base_dataloader, StatefulDataLoader)
    expected_batches, batches = [], []
    for i, batch in enumerate(reference):
        expected_batches.append(batch)
        if i == 2:
            break
    for i, batch in enumerate(loader):
        batches.append(batch)
        if i == 2:
            break
    assert all(torch.equal(a, b) for a, b in zip(expected_batches, batches))
    state = loader.state_dict()
    assert state == reference.state_dict()  # the same record, not one batch ahead
    fresh = _loaders()[index]
    fresh.load_state_dict(state)
    rest = [t.tolist() for t in fresh]
    assert rest == [list(range(k, k + 4)) for k in range(12, 32, 4)]  # right after batch 3


def test_end_of_dataloader_and_finished_epoch():
    from nbaccel.data import DataLoaderShard

    loader = DataLoaderShard(list(range(16)), batch_size=4, use_stateful_dataloader=True)
    for _ in range(2):  # every epoch
        ends = [loader.end_of_dataloader for _ in loader]
        assert ends == [False, False, False, True]
    state = loader.state_dict()
    assert state["_iterator_finished"] is True
    fresh = DataLoaderShard(list(range(16)), batch_size=4, use_stateful_dataloader=True)
    fresh.load_state_dict(state)
    assert len(list(fresh)) == 4  # a finished epoch resumes as a whole new one


def _resume_through_checkpoint(folder):
    from nbaccel import Accelerator
    from nbaccel.utils import DataLoaderConfiguration

    def run(stop_after):
        accelerator = Accelerator(
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
        )
        loader = accelerator.prepare(DataLoader(torch.arange(40.0), batch_size=2, shuffle=True))
        assert isinstance(loader, StatefulDataLoader)
        seen = []
        for i, batch in enumerate(loader):
            seen.append(batch.tolist())
            if stop_after is not None and i == stop_after:
                accelerator.save_state(folder)
        return accelerator, loader, seen

    torch.manual_seed(0)
    _, _, full = run(stop_after=3)
    accelerator, loader, _ = run(stop_after=None)
    accelerator.load_state(folder)
    resumed = [b.tolist() for b in loader]
    return full, resumed


def test_save_state_load_state_resume_mid_epoch_on_2_ranks(tmp_path):
    for full, resumed in run_on_ranks(_resume_through_checkpoint, 2, args=(str(tmp_path / "ck"),)):
        assert len(full) == 10 and resumed == full[4:]


def _native_shards():
    datasets = pytest.importorskip("datasets")
    from nbaccel import Accelerator
    from nbaccel.data import IterableDatasetShard

    stream = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=2)
    loader = Accelerator().prepare(DataLoader(stream, batch_size=2))
    return isinstance(loader.dataset, IterableDatasetShard), [b["x"].tolist() for b in loader]


def test_streaming_dataset_with_a_shard_per_rank_is_split_natively():
    pytest.importorskip("datasets")
    (wrapped0, seen0), (wrapped1, seen1) = run_on_ranks(_native_shards, 2)
    assert not wrapped0 and not wrapped1
    assert sorted(sum(seen0 + seen1, [])) == list(range(8))
    assert set(sum(seen0, [])).isdisjoint(sum(seen1, []))
