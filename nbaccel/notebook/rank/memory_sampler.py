"""Worker side: this rank's memory, reported about twice a second while a call runs.

Each :class:`~nbaccel.notebook.events.MemorySample` carries the host RSS (and its true peak from
``getrusage``), CUDA allocated / reserved / peak on the current device when this process has
initialised CUDA (the sampler never initialises it), and torch-xla's memory info when torch-xla
is in use. Reading these is a few microseconds; sending one small event costs about as much as a
``print``.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import psutil

from nbaccel.launch.rank import watch as rank_watch
from nbaccel.launch.rank.worker import after_each_call, emit
from nbaccel.notebook.events import MEMORY, MemorySample

__all__ = ["DEFAULT_INTERVAL", "sample_memory", "start_memory_sampler"]

DEFAULT_INTERVAL = 0.5
_FIRST_SAMPLE = 0.05  # s into a call when its first sample is taken
_FRESH = 1.0  # s: a call's closing sample equal (to the MiB) to one sent this recently is left out
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Sampler:
    """This process's sampler: whether it runs, what it sent last, what it read once."""

    def __init__(self) -> None:
        self.started = False
        self.sent: tuple[float, tuple] | None = None  # (time, _reading) of the last sample sent
        self.cuda_totals: dict[int, int] = {}
        self.process: psutil.Process | None = None
        self.statm: tuple[int, int] | None = None  # (pid, descriptor of /proc/self/statm)
        self.host_total = 0


_sampler = _Sampler()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * _PAGE
    except (AttributeError, ValueError, OSError):
        return psutil.virtual_memory().total


def _cuda() -> dict | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    totals = _sampler.cuda_totals
    if device not in totals:
        totals[device] = torch.cuda.get_device_properties(device).total_memory
    return {
        "device": device,
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
        "total": totals[device],
    }


def _xla() -> dict | None:
    if "torch_xla" not in sys.modules:
        return None
    try:
        import torch_xla.core.xla_model as xm

        device = xm.xla_device()
        info = xm.get_memory_info(device)
    except Exception:
        return None
    if "bytes_used" in info:
        used, limit = info["bytes_used"], info.get("bytes_limit")
        peak = info.get("peak_bytes_used")
    else:  # older torch-xla: kilobytes free / total
        limit = info.get("kb_total", 0) * 1024
        used, peak = limit - info.get("kb_free", 0) * 1024, None
    return {"device": str(device), "used": used, "limit": limit, "peak": peak}


def _host_rss() -> int:
    """This process's resident size: ``/proc/self/statm`` where there is one (a ``pread`` of a
    few bytes on a descriptor kept open: the sampler runs in every rank, and a launch of 8 ranks
    on 2 cores feels every millisecond of it), psutil elsewhere."""
    state = _sampler
    try:
        statm = state.statm
        if statm is None or statm[0] != os.getpid():  # /proc/self is the opener's, not a fork's
            statm = state.statm = (
                os.getpid(),
                os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC),
            )
        return int(os.pread(statm[1], 256, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        if state.process is None or state.process.pid != os.getpid():
            state.process = psutil.Process(os.getpid())
        return state.process.memory_info().rss


def sample_memory() -> MemorySample:
    """One reading of this process's memory."""
    if not _sampler.host_total:
        _sampler.host_total = _physical_memory()  # fixed: read once
    rss = _host_rss()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
    return MemorySample(
        time=time.time(),
        rss=rss,
        rss_peak=max(peak, rss),
        host_total=_sampler.host_total,
        cuda=_cuda(),
        xla=_xla(),
    )


def _last_sample() -> None:
    """A call's closing sample; left out when one just as fresh went out in the last second
    (cells in quick succession, a call already sampled): 8 ranks on 2 cores feel each one."""
    sample = sample_memory()
    sent = _sampler.sent
    if sent is not None and sample.time - sent[0] < _FRESH and sent[1] == _reading(sample):
        return
    _send(sample)


def _send(sample: MemorySample) -> None:
    emit(MEMORY, sample)
    _sampler.sent = (sample.time, _reading(sample))


def _sample_during_call() -> None:
    _send(sample_memory())


def _reading(sample: MemorySample) -> tuple:
    """What a memory view shows of ``sample``: MiB, and the device fields."""
    return sample.rss >> 20, sample.rss_peak >> 20, sample.cuda, sample.xla


def start_memory_sampler(interval: float = DEFAULT_INTERVAL) -> None:
    """Sample this rank's memory (once per process): while a call runs, the rank's watcher
    thread takes the first sample ``_FIRST_SAMPLE`` s into it, then one every ``interval``
    seconds; one more is taken when the call ends, so even a quick call reports every rank's
    peak."""
    if _sampler.started:
        return
    _sampler.started = True
    rank_watch.every(_sample_during_call, _FIRST_SAMPLE, interval)
    after_each_call(_last_sample)
