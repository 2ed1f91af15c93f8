"""Addresses are probed before a launch waits on them: nothing listening, a name that does not
resolve, another service's port and an address not of this machine are each refused naming
the address and what answered (or did not)."""

from __future__ import annotations

import socket
import threading

import pytest

from nbaccel.launch.remote.reachable import (
    Unreachable,
    check_local_address,
    probe_grpc,
    probe_http2,
    probe_tcp,
    split_address,
)

GCS = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def banner_port():
    """A port where a service that is not gRPC answers (an SSH-like banner, then close)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    done.set()
    thread.join()
    server.close()


@pytest.fixture
def h2_port():
    """A port where a server answers the HTTP/2 preface with its SETTINGS frame, as gRPC's do."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(24 + 9)
            conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # an empty SETTINGS frame

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    thread.join(timeout=5)
    server.close()


def test_split_address():
    assert split_address("head:6379") == ("head", 6379)
    assert split_address("[::1]:6379") == ("::1", 6379)
    assert split_address("head", 10001) == ("head", 10001)
    with pytest.raises(ValueError, match="'head' has no port"):
        split_address("head")
    with pytest.raises(ValueError, match="no valid port"):
        split_address("head:99999")


def test_nothing_listening_is_refused_naming_the_address():
    port = _closed_port()
    with pytest.raises(Unreachable, match=rf"a GCS at 127.0.0.1:{port} is not there: nothing "):
        probe_tcp("127.0.0.1", port, "a GCS", timeout=2)


def test_a_name_that_does_not_resolve_is_refused():
    with pytest.raises(Unreachable, match=r"the name 'no-such-host.invalid' does not resolve"):
        probe_tcp("no-such-host.invalid", 6379, "a GCS", timeout=2)


def test_another_services_port_is_not_taken_for_grpc_without_grpcio(banner_port):
    """``pip install ray`` brings no grpcio: the plain HTTP/2 handshake tells a banner apart."""
    probe_tcp("127.0.0.1", banner_port, "a GCS", timeout=2)
    with pytest.raises(Unreachable, match=rf"127.0.0.1:{banner_port} is not there: the port "):
        probe_http2("127.0.0.1", banner_port, "a GCS", timeout=2.0)


def test_an_http2_server_answers_the_handshake(h2_port):
    probe_http2("127.0.0.1", h2_port, "a GCS", timeout=2.0)


def test_another_services_port_is_not_taken_for_grpc(banner_port):
    pytest.importorskip("grpc")
    probe_tcp("127.0.0.1", banner_port, "a GCS", timeout=2)  # TCP alone answers
    with pytest.raises(Unreachable, match=rf"127.0.0.1:{banner_port} is not there: the port "):
        probe_grpc("127.0.0.1", banner_port, "a GCS", GCS, timeout=2.0)


def test_a_ray_address_where_nothing_listens_is_refused_before_ray_connects():
    ray = pytest.importorskip("ray")
    from nbaccel.launch.remote.ray.connect import probe_cluster

    port = _closed_port()
    with pytest.raises(ConnectionError, match=rf"Ray cluster's GCS at 127.0.0.1:{port} is not"):
        probe_cluster(f"127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=rf"Ray Client server .* at 127.0.0.1:{port} is"):
        probe_cluster(f"ray://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="ray_address 'head' is not a cluster address"):
        probe_cluster("head")
    probe_cluster("auto")  # Ray's own to find, as are other schemes: nothing is probed
    probe_cluster("anyscale://my-cluster")
    assert not ray.is_initialized()


def test_a_channel_address_must_be_of_this_machine():
    check_local_address("127.0.0.1", "channel_address")
    with pytest.raises(ValueError, match=r"'192.0.2.77' \(192.0.2.77\) is not an address of th"):
        check_local_address("192.0.2.77", "channel_address")
