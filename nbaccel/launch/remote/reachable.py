"""Whether an address answers, asked before a launch waits on it.

A launch that names a cluster or a host checks it here first, within seconds: a TCP connection
to the address (refused: nothing listens there; no answer: a firewall, a wrong network, a
machine that is down; a name that does not resolve), and for a gRPC service (a Ray cluster's
GCS, a Ray Client server) one call of a method only that service has where grpcio is installed,
else the HTTP/2 handshake every gRPC server answers (something answers, but not gRPC, or not
that service: another service's port). Each failure is an
:class:`Unreachable` (a ``ConnectionError``) naming the address and what did or did not answer,
instead of the minutes of retries of the client that would otherwise connect. A SLURM launch
asks the controller whether its allocation still runs (:func:`check_slurm_allocation`), and a
``channel_address`` must be one this machine can listen on (:func:`check_local_address`).
"""

from __future__ import annotations

import socket
import subprocess

__all__ = [
    "PROBE_TIMEOUT",
    "Unreachable",
    "check_local_address",
    "check_slurm_allocation",
    "probe_grpc",
    "probe_http2",
    "probe_tcp",
    "split_address",
]

#: seconds each probe waits for an answer
PROBE_TIMEOUT = 5.0
#: the states of a SLURM job whose nodes can run a step now
_SLURM_LIVE = ("RUNNING", "CONFIGURING")


class Unreachable(ConnectionError):
    """An address that does not answer as it should; the message says what happened."""


def split_address(address: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``, a port-less host with ``default_port``) as ``(host,
    port)``; ValueError naming the address when it has no usable port."""
    host, sep, port = address.rpartition(":")
    if not sep or "]" in port:  # no port at all (or a bare IPv6 address)
        host, port = address, ""
    host = host.strip("[]")
    if not port:
        if default_port is None:
            raise ValueError(f"the address {address!r} has no port: write it as host:port.")
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the address {address!r} has no valid port (1-65535): write host:port.")
    return host, int(port)


def check_local_address(address: str, what: str) -> None:
    """Refuse an address this machine cannot listen on (a name that does not resolve, another
    machine's address): ValueError naming it and ``what`` it is for, before anything waits for
    connections to it."""
    try:
        infos = socket.getaddrinfo(address.strip("[]"), 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(
            f"{what} {address!r} does not resolve ({exc.strerror}): pass an address of this "
            "machine that the hosts can connect to."
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as listener:
        try:
            listener.bind(sockaddr[:2] if family == socket.AF_INET else sockaddr)
        except OSError as exc:
            raise ValueError(
                f"{what} {address!r} ({sockaddr[0]}) is not an address of this machine: "
                f"nothing can listen there ({exc.strerror or exc}); pass one of this machine's "
                "addresses that the hosts can connect to."
            ) from None


def probe_tcp(host: str, port: int, what: str, timeout: float = PROBE_TIMEOUT) -> None:
    """Open (and close) a TCP connection to ``host:port``, ``what`` listening there (``"a Ray
    cluster's GCS"``); raises :class:`Unreachable` saying why not."""
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Unreachable(
            f"{what} at {where} cannot be reached: the name {host!r} does not resolve "
            f"({exc.strerror}); check the host name."
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(sockaddr)
        except ConnectionRefusedError:
            raise Unreachable(
                f"{what} at {where} is not there: nothing listens on that port ({sockaddr[0]} "
                "refused the connection); check the host and the port."
            ) from None
        except TimeoutError:
            raise Unreachable(
                f"{what} at {where} cannot be reached: no answer within {timeout:.0f} s (the "
                "machine is down, or a firewall or the network drops the connection)."
            ) from None
        except OSError as exc:
            raise Unreachable(
                f"{what} at {where} cannot be reached: {exc.strerror or exc} ({sockaddr[0]})."
            ) from None


def probe_grpc(
    host: str,
    port: int,
    what: str,
    method: str,
    request: bytes = b"",
    timeout: float = PROBE_TIMEOUT,
) -> None:
    """:func:`probe_tcp`, then whether a gRPC service answers at ``host:port``; raises
    :class:`Unreachable` saying what answered instead.

    With grpcio installed (``ray[default]`` and ``ray[client]`` bring it; ``pip install ray``
    does not), one call of the gRPC ``method`` (``/package.Service/Method``, with the serialized
    ``request``): any answer but "unimplemented" is the service (an error of its own, such as a
    refused authentication, included). Without it, the HTTP/2 handshake every gRPC server
    answers (:func:`probe_http2`): a port of another kind of service is still refused, another
    gRPC service's port is left to the client that connects next."""
    probe_tcp(host, port, what, timeout)
    try:
        import grpc
    except ImportError:
        probe_http2(host, port, what, timeout)
        return

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                why = (
                    f"no answer within {timeout:.0f} s"
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED
                    else "it does not speak gRPC"
                )
                raise _not_there(what, target, why) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise Unreachable(
                    f"{what} at {target} is not there: a gRPC or HTTP/2 service answers on that "
                    f"port, but not as {what} ({method} is unknown to it); check the port."
                ) from None


def _not_there(what: str, target: str, why: str) -> Unreachable:
    return Unreachable(
        f"{what} at {target} is not there: the port accepts a TCP connection, but {why} "
        "(another service listens there?); check the port."
    )


#: what an HTTP/2 client sends first (RFC 9113 3.4): the preface, then its SETTINGS (empty)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4  # the frame type a server's first frame must have


def probe_http2(host: str, port: int, what: str, timeout: float = PROBE_TIMEOUT) -> None:
    """Speak the first words of HTTP/2 (cleartext, as gRPC without TLS does) to ``host:port``:
    a server's first frame must be its SETTINGS. A banner, a close or silence is another kind
    of service: :class:`Unreachable` naming the address and what came back."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_H2_PREFACE)
            header = b""
            while len(header) < 9:
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
    except TimeoutError:
        raise _not_there(what, target, f"no answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise _not_there(what, target, f"it closed the connection ({exc})") from None
    if len(header) < 9 or header[3] != _H2_SETTINGS or any(header[5:9]):
        raise _not_there(what, target, "it does not speak gRPC (no HTTP/2 answer)")


def check_slurm_allocation(job: str, timeout: float = 2 * PROBE_TIMEOUT) -> None:
    """Ask the SLURM controller (``squeue -j JOB``) whether allocation ``job`` is running, so a
    launch into an allocation that ended, or past a controller that does not answer, is refused
    within ``timeout`` s instead of waiting on ``srun``. Without ``squeue`` on this machine
    nothing is checked (``srun`` will say). Raises :class:`Unreachable` naming the job and what
    SLURM answered."""
    try:
        done = subprocess.run(
            ["squeue", "--noheader", "--jobs", job, "--format", "%T"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except FileNotFoundError:
        return
    except subprocess.TimeoutExpired:
        raise Unreachable(
            f"the SLURM controller did not answer within {timeout:.0f} s (squeue --jobs {job}): "
            "srun could not start the agents either; check that slurmctld is up and reachable "
            "from this machine (scontrol ping)."
        ) from None
    state = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
    if done.returncode != 0 or state not in _SLURM_LIVE:
        said = state or done.stderr.strip() or "not listed"
        raise Unreachable(
            f"the SLURM allocation {job} (SLURM_JOB_ID) is not running: squeue says {said!r}. "
            "Start a new allocation (salloc or sbatch) and this kernel inside it."
        )
