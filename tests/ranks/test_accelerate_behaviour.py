"""Behaviour that matches Hugging Face Accelerate's documented behaviour, on 2 real gloo ranks
where it is about distribution (each test names what Accelerate does)."""

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nbaccel.testing import run_on_ranks


class Regression(Dataset):
    """y = 2x + 3 + noise, fixed by a seed."""

    def __init__(self, length: int, seed: int = 42):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, generator=g)
        self.y = 2 * self.x + 3 + 0.1 * torch.randn(length, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Line(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(()))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x * self.a + self.b


def _seedable_loader(dataset, generator, batch_size):
    from nbaccel.data import SeedableRandomSampler

    sampler = SeedableRandomSampler(
        generator=generator, data_source=dataset, num_samples=len(dataset)
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def _fit(loader, model, backward=None, epochs=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for batch in loader:
            model.zero_grad()
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            (backward or (lambda t: t.backward()))(loss)
            opt.step()
    return model


def _seedable_training():
    from nbaccel import Accelerator, set_seed
    from nbaccel.utils import DataLoaderConfiguration

    per_rank = 8
    generator = torch.Generator()
    set_seed(42)
    generator.manual_seed(42)
    dataset = Regression(per_rank * 4 * 2)
    reference = _fit(_seedable_loader(dataset, generator, per_rank * 2), Line())

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    loader = _seedable_loader(dataset, generator, per_rank)
    loader, model = accelerator.prepare(loader, Line())
    set_seed(42)
    generator.manual_seed(42)
    model = _fit(loader, model, accelerator.backward)
    model = accelerator.unwrap_model(model)
    return [reference.a.item(), reference.b.item(), model.a.item(), model.b.item()]


def test_seedable_sampler_training_on_2_ranks_reproduces_one_process():
    # Accelerate's own training check: same model as one process with the global batch.
    for ref_a, ref_b, a, b in run_on_ranks(_seedable_training, 2):
        assert abs(ref_a - a) < 1e-5 and abs(ref_b - b) < 1e-5, (ref_a, a, ref_b, b)


def test_batch_sampler_shard_drop_last_drops_the_incomplete_round():
    from torch.utils.data import BatchSampler

    from nbaccel.data import BatchSamplerShard

    # 7 batches of 3 over 2 processes, drop_last: Accelerate gives 3 and 3 even without
    # even_batches (the 7th batch has no partner).
    base = BatchSampler(range(22), 3, drop_last=True)
    shards = [BatchSamplerShard(base, 2, i, even_batches=False) for i in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    assert list(shards[0]) == [[0, 1, 2], [6, 7, 8], [12, 13, 14]]
    assert list(shards[1]) == [[3, 4, 5], [9, 10, 11], [15, 16, 17]]


def test_variable_size_batches_with_even_batches():
    from nbaccel.data import BatchSamplerShard

    batches = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]]
    uneven = [BatchSamplerShard(batches, 2, i, even_batches=False) for i in range(2)]
    assert [len(s) for s in uneven] == [3, 2]
    assert list(uneven[0]) == [[0, 1, 2], [5, 6, 7, 8], [12, 13]]
    assert list(uneven[1]) == [[3, 4], [9, 10, 11]]
    # even_batches: the short round is completed with the first batch again.
    even = [BatchSamplerShard(batches, 2, i, even_batches=True) for i in range(2)]
    assert [len(s) for s in even] == [3, 3]
    assert list(even[1]) == [[3, 4], [9, 10, 11], [0, 1, 2]]


def _unbatched():
    from torch.utils.data import IterableDataset, TensorDataset

    from nbaccel import Accelerator

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(6))

    accelerator = Accelerator()
    mapped = accelerator.prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=None))
    streamed = accelerator.prepare(DataLoader(Stream(), batch_size=None))
    return [[b[0].item() for b in mapped], [int(b) for b in streamed], len(mapped)]


def test_unbatched_dataloader_can_be_prepared_on_2_ranks():
    # Accelerate prepares DataLoader(batch_size=None) (one item per step); each rank reads its
    # items in turn.
    (mapped0, stream0, len0), (mapped1, stream1, len1) = run_on_ranks(_unbatched, 2)
    assert sorted(mapped0 + mapped1) == [0, 1, 2, 3, 4, 5] and len0 == len1 == 3
    assert mapped0 == [0, 2, 4] and mapped1 == [1, 3, 5]
    assert sorted(stream0 + stream1) == [0, 1, 2, 3, 4, 5]


def _one_cycle(step_with_optimizer, split_batches):
    from nbaccel import Accelerator

    accelerator = Accelerator(
        step_scheduler_with_optimizer=step_with_optimizer, split_batches=split_batches
    )
    model = nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.01, steps_per_epoch=2, epochs=1
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    scheduler.step()
    first = scheduler.scheduler.last_epoch
    scheduler.step()  # past total_steps: held back, not an error
    return first, scheduler.scheduler.last_epoch


def test_one_cycle_scheduler_steps_once_per_process():
    # Accelerate: one step of a prepared scheduler on 2 processes advances OneCycleLR by 2
    # (the global batch is 2 batches); split_batches or step_with_optimizer=False advance by 1.
    assert run_on_ranks(_one_cycle, 2, args=(True, False)) == [(2, 2), (2, 2)]
    assert run_on_ranks(_one_cycle, 2, args=(True, True))[0][0] == 1
    assert run_on_ranks(_one_cycle, 2, args=(False, False))[0][0] == 1


def test_save_model_reads_disk_offloaded_weights(tmp_path):
    # Accelerate's save_model reads offloaded weights back (no "Cannot copy out of meta").
    from safetensors.torch import load_file

    from nbaccel import Accelerator
    from nbaccel.bigmodel import dispatch_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    dispatch_model(
        model, device_map={"0": "cpu", "1": "disk", "2": "disk"}, offload_dir=tmp_path / "off"
    )
    assert model[2].weight.device.type == "meta"  # really offloaded
    Accelerator().save_model(model, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(saved[key], tensor), key
    assert model[2].weight.device.type == "meta"  # and left offloaded
