"""Worker side: a daemon thread that reports this rank's memory about twice a second.

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
import threading
import time

import psutil

from nbaccel.launch.worker import after_each_call, before_each_call, emit
from nbaccel.notebook.events import MEMORY, MemorySample

__all__ = ["DEFAULT_INTERVAL", "sample_memory", "start_memory_sampler"]

DEFAULT_INTERVAL = 0.5
_FIRST_SAMPLE = 0.05  # s into a call when its first sample is taken
_SLEEP_AFTER = 2.0  # s without a call after which the sampler sleeps until the next one
_FRESH = 1.0  # s: a call's closing sample equal (to the MiB) to one sent this recently is left out
_thread: threading.Thread | None = None
_cuda_totals: dict[int, int] = {}
_process: psutil.Process | None = None
_statm: tuple[int, int] | None = None  # (pid, descriptor of /proc/self/statm)
_host_total = 0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
    if device not in _cuda_totals:
        _cuda_totals[device] = torch.cuda.get_device_properties(device).total_memory
    return {
        "device": device,
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
        "total": _cuda_totals[device],
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
    global _process, _statm
    try:
        if _statm is None or _statm[0] != os.getpid():  # /proc/self is the opener's, not a fork's
            _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        if _process is None or _process.pid != os.getpid():
            _process = psutil.Process(os.getpid())
        return _process.memory_info().rss


def sample_memory() -> MemorySample:
    """One reading of this process's memory."""
    global _host_total
    if not _host_total:
        _host_total = _physical_memory()  # fixed: read once
    rss = _host_rss()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
    return MemorySample(
        time=time.time(),
        rss=rss,
        rss_peak=max(peak, rss),
        host_total=_host_total,
        cuda=_cuda(),
        xla=_xla(),
    )


class _Activity:
    """When the running call started (None between calls), written by the main thread without
    waking the sampler; and whether the sampler sleeps until the next call (then, and only then,
    a call's start wakes it)."""

    started: float | None = None
    calls = 0  # calls begun so far: quick ones end before the sampler looks
    sleeping = False
    wake = threading.Event()
    sent: tuple[float, tuple] | None = None  # (time, _reading) of the last sample sent


def _run(interval: float) -> None:
    """Sample a call from ``_FIRST_SAMPLE`` s after its start every ``interval`` s. Between
    calls, look every ``_FIRST_SAMPLE`` s while cells come in quick succession (a call's start
    then costs no thread switch on the rank), and sleep once none came for ``_SLEEP_AFTER`` s
    (an idle pool's ranks wake for nothing)."""
    last_call, seen = time.monotonic(), 0
    while True:
        started, now = _Activity.started, time.monotonic()
        if _Activity.calls != seen:
            last_call, seen = now, _Activity.calls
        if started is None:
            if now - last_call < _SLEEP_AFTER:
                time.sleep(_FIRST_SAMPLE)
                continue
            _Activity.sleeping = True
            if _Activity.started is None:  # checked after saying so: no start goes unseen
                _Activity.wake.wait()
            _Activity.wake.clear()
            _Activity.sleeping = False
            continue
        if now - started < _FIRST_SAMPLE:
            time.sleep(_FIRST_SAMPLE - (now - started))
            continue
        try:
            _send(sample_memory())
        except Exception:  # the driver went away or a backend failed: stop quietly
            return
        time.sleep(interval)


def _call_started() -> None:
    _Activity.started = time.monotonic()
    _Activity.calls += 1
    if _Activity.sleeping:
        _Activity.wake.set()


def _last_sample() -> None:
    """A call's closing sample; left out when one just as fresh went out in the last second
    (cells in quick succession, a call already sampled): 8 ranks on 2 cores feel each one."""
    _Activity.started = None
    sample = sample_memory()
    sent = _Activity.sent
    if sent is not None and sample.time - sent[0] < _FRESH and sent[1] == _reading(sample):
        return
    _send(sample)


def _send(sample: MemorySample) -> None:
    emit(MEMORY, sample)
    _Activity.sent = (sample.time, _reading(sample))


def _reading(sample: MemorySample) -> tuple:
    """What a memory view shows of ``sample``: MiB, and the device fields."""
    return sample.rss >> 20, sample.rss_peak >> 20, sample.cuda, sample.xla


def start_memory_sampler(interval: float = DEFAULT_INTERVAL) -> None:
    """Start this process's sampler thread (once). It samples while a call runs: the first
    sample ``_FIRST_SAMPLE`` s into a call, then every ``interval`` seconds, and one more when
    the call ends, so even a quick call reports every rank's peak."""
    global _thread
    before_each_call(_call_started)
    after_each_call(_last_sample)
    if _thread is not None and _thread.is_alive():
        return
    _thread = threading.Thread(target=_run, args=(interval,), daemon=True, name="nbaccel-memory")
    _thread.start()
