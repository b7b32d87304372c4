"""A real node's network of its own (rigs/kubelet/netns.py), without the node: two namespaces with
the same addresses at once, each reaching only its own API server (a TCP server on the host's
loopback) from ``127.0.0.1:<port>`` and the ClusterIP inside, the API server's HTTP CONNECT
reaching a listener at the node's IP inside, none of their addresses on the host, and nothing
left after ``close``. Needs root (namespaces, mounts); missing, it skips locally and fails in CI.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from rigs.kubelet.netns import CLUSTER_IP, NODE_IP, SERVICE_PORT, NodeNetwork, pinned
from rigs.prereq import require

pytestmark = [pytest.mark.kernel]


def echo_server(name: bytes, listener: socket.socket) -> None:
    """Answers each connection with ``name:`` and what it first read, each on a daemon thread of
    its own (one connection that fails or stalls holds up no other)."""

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.sendall(name + b":" + conn.recv(100))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()


def ask(sock: socket.socket, data: bytes) -> bytes:
    with sock:
        sock.sendall(data)
        return sock.recv(200)


def dialer(address: tuple[str, int]) -> Callable[[], socket.socket]:
    return lambda: socket.create_connection(address, timeout=5)


def host_addresses() -> str:
    return subprocess.run(
        ["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True
    ).stdout


def test_two_node_networks_at_once_each_reach_their_own_api_server_and_leave_nothing(
    tmp_path: Path,
) -> None:
    require(os.geteuid() == 0, "network namespaces need root")
    networks: list[NodeNetwork] = []
    apiservers: list[socket.socket] = []
    try:
        for i in range(2):
            server = socket.create_server(("127.0.0.1", 0))
            apiservers.append(server)
            echo_server(b"api%d" % i, server)
            net = NodeNetwork(
                tmp_path / f"netns{i}",
                apiserver_port=server.getsockname()[1],
                egress_socket=tmp_path / f"egress{i}.sock",
            )
            networks.append(net)
            net.start()
        for i, net in enumerate(networks):
            port = apiservers[i].getsockname()[1]
            for address in (("127.0.0.1", port), (CLUSTER_IP, SERVICE_PORT)):
                got = ask(net.call(dialer(address)), b"hi")
                assert got == b"api%d:hi" % i, (address, net.trace())
            # The API server's way in: HTTP CONNECT to the node's IP, served inside.
            kubelet = net.call(lambda: socket.create_server((NODE_IP, 10250)))
            echo_server(b"kubelet%d" % i, kubelet)
            egress = socket.socket(socket.AF_UNIX)
            egress.connect(str(tmp_path / f"egress{i}.sock"))
            egress.sendall(f"CONNECT {NODE_IP}:10250 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert egress.recv(200) == b"HTTP/1.1 200 Connection established\r\n\r\n"
            assert ask(egress, b"logs") == b"kubelet%d:logs" % i
            kubelet.close()
        host = host_addresses()
        assert f" {NODE_IP}/" not in host, host
        assert f" {CLUSTER_IP}/" not in host, host
    finally:
        problems = [p for net in networks for p in net.close()]
        for server in apiservers:
            server.close()
    assert problems == []
    for i in range(2):
        assert not pinned(tmp_path / f"netns{i}")
        assert not (tmp_path / f"netns{i}").exists()
        assert not (tmp_path / f"egress{i}.sock").exists()
