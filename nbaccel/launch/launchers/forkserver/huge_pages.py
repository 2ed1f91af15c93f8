"""Make the fork server cheap to fork: its writable memory in transparent huge pages.

After ``import torch`` the server holds a large private anonymous memory (the C heap and
Python's arenas) in 4 KiB pages. ``fork`` copies one page-table entry per page, and every forked
rank's exit drops them again, once per rank and launch: on few cores, a large part of a launch of
many ranks. Collapsed into 2 MiB pages (Linux's ``MADV_COLLAPSE``, kernel 6.1+), the same memory
is 512 times fewer entries, and forks and exits cost less (launch times:
``benchmarks/bench_launcher.py``). A rank that writes to a huge page gets its own 4 KiB copy, as
before (the kernel splits the mapping), so nothing changes for the ranks but the cost.

Best effort: elsewhere than Linux, on older kernels, or without memory for huge pages nothing
happens. ``NBACCEL_HUGE_PAGES=0`` (or ``false``, ``off``) turns it off.
"""

from __future__ import annotations

import ctypes
import sys

from nbaccel.values.booleans import env_flag

__all__ = ["ENV", "collapse_writable_memory"]

ENV = "NBACCEL_HUGE_PAGES"
_MADV_COLLAPSE = 25
_HUGE = 2 << 20


def _regions() -> list[tuple[int, int]]:
    """The huge-page-aligned parts of this process's writable anonymous mappings and heap."""
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            name = fields[5] if len(fields) > 5 else ""
            if "w" not in fields[1] or (name and name != "[heap]"):
                continue
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            first, last = (start + _HUGE - 1) & ~(_HUGE - 1), end & ~(_HUGE - 1)
            if last > first:
                regions.append((first, last))
    return regions


def collapse_writable_memory() -> int:
    """Collapse this process's private writable memory into huge pages; the bytes collapsed
    (0 where unsupported or turned off)."""
    try:
        wanted = env_flag(ENV, default=True)
    except ValueError as exc:  # in the fork server: say so, never stop it
        print(f"[nbaccel] {str(exc).rstrip('.')}: huge pages left off", file=sys.stderr)
        return 0
    if not wanted or not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        regions = _regions()
    except (OSError, AttributeError):
        return 0
    collapsed = 0
    for first, last in regions:
        if madvise(first, last - first, _MADV_COLLAPSE) == 0:
            collapsed += last - first
        elif ctypes.get_errno() == 22:  # EINVAL: this kernel has no MADV_COLLAPSE
            return collapsed
    return collapsed
