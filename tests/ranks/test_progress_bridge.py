"""Worker side of the widgets, with real ranks: tqdm bridge and memory sampler events."""

from __future__ import annotations

import time
from collections import defaultdict

from proc_threads import voluntary_switches
from recorder import Recorder as SharedRecorder

from nbaccel import notebook_launcher
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.notebook.events import MemorySample, ProgressUpdate


class Recorder(SharedRecorder):
    def progress(self) -> dict[tuple[int, int], list[ProgressUpdate]]:
        bars = defaultdict(list)
        for _, rank, kind, payload in self.events:
            if kind == "progress":
                bars[rank, payload.bar].append(payload)
        return bars


def _fast_loop(n: int) -> dict:
    import math

    import tqdm
    import tqdm.auto
    import tqdm.notebook

    from nbaccel import PartialState

    rank = PartialState().process_index
    acc = 0.0
    for i in tqdm.auto.tqdm(range(n), desc="train", mininterval=0):  # display() every step
        acc += math.sqrt(i) * math.sin(i) * math.cos(i) + math.log1p(i)
    for _ in tqdm.trange(5, desc="eval", disable=rank == 1):
        pass
    with tqdm.notebook.tqdm(total=3, desc="tmp", leave=False) as bar:
        bar.update(3)
    print("classes", tqdm.tqdm.__name__, tqdm.auto.tqdm.__name__, tqdm.notebook.tqdm.__name__)
    return {"rank": rank}


def test_bars_are_coalesced_bridged_and_exact() -> None:
    rec = Recorder()
    n = 100_000
    notebook_launcher(_fast_loop, (n,), num_processes=2, renderer=rec, memory=False)
    bars = rec.progress()
    for rank in (0, 1):
        train = next(u for key, u in bars.items() if key[0] == rank and u[0].desc == "train")
        final = train[-1]
        assert final.final and final.n == n and final.total == n
        assert final.elapsed > 0 and abs(final.rate - n / final.elapsed) / final.rate < 1e-6
        assert sum(u.final for u in train) == 1
        # <= 10 updates per second per bar (+ the first one and the final one)
        assert len(train) <= final.elapsed * 10 + 3, (len(train), final.elapsed)
        tmp = next(u for key, u in bars.items() if key[0] == rank and u[0].desc == "tmp")
        assert tmp[-1].final and not tmp[-1].leave and tmp[-1].n == 3
    evals = [u for key, u in bars.items() if u[0].desc == "eval"]
    assert [len(u) and u[-1].n for u in evals] == [5]  # rank 1's bar is disabled: no events
    assert next(k for k, u in bars.items() if u[0].desc == "eval")[0] == 0
    assert all("\r" not in text for _, _, text in rec.lines)
    assert not any("it/s" in text for _, _, text in rec.lines)  # no tqdm text on the streams
    classes = [text for _, _, text in rec.lines if text.startswith("classes")]
    assert classes == ["classes RankTqdm RankTqdm RankTqdm"] * 2


def _stalls() -> None:
    from tqdm import tqdm

    bar = tqdm(total=10, mininterval=0)
    bar.update(1)
    bar.update(1)  # held back by the rate limit ...
    time.sleep(0.6)  # ... and sent by the flusher meanwhile
    bar.close()


def test_held_back_update_is_flushed_before_close() -> None:
    rec = Recorder()
    notebook_launcher(_stalls, num_processes=1, renderer=rec, memory=False)
    updates = rec.progress()[0, 1]
    assert [(u.n, u.final) for u in updates] == [(0, False), (2, False), (2, True)]


def _hold_memory(seconds: float) -> int:
    import torch

    block = torch.ones(8 * 2**20, dtype=torch.uint8)  # 8 MiB held while we sleep
    time.sleep(seconds)
    return int(block[0])


def test_memory_samples_and_memory_false() -> None:
    rec = Recorder()
    notebook_launcher(_hold_memory, (1.3,), num_processes=2, renderer=rec)
    samples = defaultdict(list)
    for _, rank, kind, payload in rec.events:
        if kind == "memory":
            samples[rank].append(payload)
    assert sorted(samples) == [0, 1]
    for rank, got in samples.items():
        assert 2 <= len(got) <= 5, (rank, len(got))  # ~2 Hz over 1.3 s
        assert all(isinstance(s, MemorySample) for s in got)
        last = got[-1]
        assert 8 * 2**20 < last.rss <= last.rss_peak < last.host_total
        assert last.cuda is None and last.xla is None  # CUDA never initialised on these ranks
        assert last.render_text() == ""
    rec = Recorder()
    notebook_launcher(_hold_memory, (0.6,), num_processes=1, renderer=rec, memory=False)
    assert not [e for e in rec.events if e[2] == "memory"]


def _sampler_thread() -> tuple[int, int]:
    import os
    import threading

    from nbaccel.launch.rank.watch import WATCHER

    (sampler,) = [t for t in threading.enumerate() if t.name == WATCHER]
    return os.getpid(), sampler.native_id


def test_an_idle_pools_memory_sampler_sleeps(pool) -> None:
    threads = pool.call(_sampler_thread)
    assert sorted(threads) == [0, 1]
    time.sleep(3.5)  # after a call the samplers look every 50 ms for 2 s, then sleep (margin)
    before = {rank: voluntary_switches(*ids) for rank, ids in threads.items()}
    time.sleep(1.0)  # an idle pool: its samplers wait for a call, they do not poll
    for rank, ids in threads.items():
        woke = voluntary_switches(*ids) - before[rank]
        assert woke <= 2, (rank, woke)  # polling: ~20 a second
    rec = Recorder()  # a call after the sleep wakes them: samples during it, and at its end
    pool.call(_hold_memory, 1.2, renderer=rec)
    for rank in (0, 1):
        samples = [e for e in rec.events if e[1] == rank and e[2] == "memory"]
        assert len(samples) >= 3, (rank, len(samples))  # ~0.05 s, ~0.55 s, ~1.05 s, the end


def _keep_mib(n: int) -> None:
    import builtins

    builtins._nbaccel_test_block = bytearray(n << 20)  # touched: resident


def test_a_quick_calls_closing_sample_is_left_out_only_when_nothing_moved() -> None:
    from nbaccel.notebook.kernel import pool as pool_module

    pool = pool_module.start_pool(num_processes=1, renderer=Renderer())
    try:

        def samples(*call) -> list:
            rec = Recorder()
            pool.call(*call, renderer=rec)
            return [e[3] for e in rec.events if e[2] == "memory"]

        pool.call(int)
        time.sleep(1.1)
        (base,) = samples(int)  # a sample older than a second is renewed at a call's end
        quick = [samples(int) for _ in range(5)]
        assert sum(map(len, quick)) == 0  # nothing moved since the sample of the call before
        # memory moved: its sample goes out at once (on a loaded machine the allocation may
        # outlast the watcher's first in-call sample, 50 ms in: then that one may come first)
        grown = samples(_keep_mib, 64)
        assert grown and grown[-1].rss >= base.rss + 60 * 2**20
        time.sleep(1.1)
        # a sample older than a second is renewed at a call's end (on a loaded machine the
        # call may outlast the watcher's first in-call sample: that one may come first)
        renewed = samples(int)
        assert renewed and renewed[-1].time >= grown[-1].time + 1.0
    finally:
        pool_module.shutdown_pool()
        pool.shutdown()
