"""Is ``master_addr`` this machine? Checked before a launch whose ranks all run here.

On one machine the ranks' process group meets in a private file store, so ``master_addr`` is
only what the ranks find in ``MASTER_ADDR`` (code that reads it, torch's ``env://``). A name that
does not resolve, or an address of another machine, would surface there much later, far from the
mistake, or never; it is refused before anything starts instead.
"""

from __future__ import annotations

import ipaddress
import socket
import threading

import psutil

__all__ = ["check_local_master_addr"]

#: seconds a name may take to resolve (a host name goes through the system's resolver, which
#: can wait on an unreachable DNS server)
RESOLVE_TIMEOUT = 3.0


def _this_machine() -> set[str]:
    """The addresses of this machine's network interfaces (zone suffixes dropped)."""
    found = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                found.add(address.address.split("%", 1)[0])
    return found


def _resolve(host: str, timeout: float, name: str) -> set[str]:
    """The addresses ``host`` resolves to; ValueError when it does not within ``timeout``."""
    outcome: dict[str, object] = {}

    def lookup() -> None:
        try:
            outcome["addresses"] = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=lookup, daemon=True, name="nbaccel-resolve")
    thread.start()
    thread.join(timeout)
    if "addresses" in outcome:
        return {str(a).split("%", 1)[0] for a in outcome["addresses"]}  # type: ignore[attr-defined]
    why = outcome.get("error") or f"no answer within {timeout:.0f} s"
    raise ValueError(
        f"{name}={host!r} does not resolve on this machine ({why}). This launch runs on this "
        f"machine only: leave {name} out (127.0.0.1), or pass an address of this machine."
    )


def _is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 (also as ::ffff:127.0.0.1) or the unspecified 0.0.0.0 / ::."""
    parsed = ipaddress.ip_address(address)
    mapped = getattr(parsed, "ipv4_mapped", None)
    if mapped is not None:
        parsed = mapped
    return parsed.is_loopback or parsed.is_unspecified


def check_local_master_addr(
    host: str,
    timeout: float = RESOLVE_TIMEOUT,
    name: str = "master_addr",
    several: str = "num_nodes and node_rank too (or hosts=...)",
) -> None:
    """ValueError naming the fix when ``host`` is not an address (or a name) of this machine.
    ``name`` and ``several`` are the front's words: the option, and how to go multi-node."""
    try:
        addresses = {str(ipaddress.ip_address(host.strip("[]")))}
    except ValueError:
        addresses = _resolve(host, timeout, name)
    if any(map(_is_loopback, addresses)) or addresses & _this_machine():
        return
    shown = ", ".join(sorted(addresses))
    raise ValueError(
        f"{name}={host!r} ({shown}) is not an address of this machine, and this launch runs on "
        f"this machine only, so its ranks would be told to meet elsewhere. Leave {name} out "
        f"(127.0.0.1); for ranks on several machines pass {several}."
    )
