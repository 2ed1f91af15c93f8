"""Reading a thread's wake-ups from ``/proc``, outside the process that owns it."""

from __future__ import annotations


def voluntary_switches(pid: int, tid: int) -> int:
    """How many times thread ``tid`` of ``pid`` went to sleep and was woken."""
    with open(f"/proc/{pid}/task/{tid}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")
