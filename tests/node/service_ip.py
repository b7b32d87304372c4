"""The ``kubernetes`` Service's ClusterIP, reachable from pods on a node without kube-proxy.

A pod finds the API server through ``KUBERNETES_SERVICE_HOST``/``_PORT``, which the kubelet sets
to the ``kubernetes`` Service's ClusterIP and port (``10.0.0.1:443`` for the test clusters'
``--service-cluster-ip-range=10.0.0.0/24``). kube-proxy would route that address with netfilter
rules; this machine has no iptables or nft binary, so the address is put on the host's loopback
(a pod's packets to it leave through the CNI bridge's gateway, the host, and are delivered
locally) and a TCP relay there passes the TLS stream, untouched, to the API server's real port.
The API server's certificate names the ClusterIP (rigs/controlplane.py ``make_pki``).

``ServiceIP.close`` stops the relay and removes the address only if it added it.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import subprocess
import threading

CLUSTER_IP = "10.0.0.1"
PORT = 443
_CHUNK = 65536


class ServiceIP:
    def __init__(self, target_port: int, *, address: str = CLUSTER_IP, port: int = PORT) -> None:
        self._target = ("127.0.0.1", target_port)
        self.address = address
        self.port = port
        self._added = False
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()

    def start(self) -> None:
        shown = subprocess.run(
            ["ip", "-4", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=True
        ).stdout
        if f" {self.address}/" not in shown:
            subprocess.run(
                ["ip", "addr", "add", f"{self.address}/32", "dev", "lo"],
                check=True,
                capture_output=True,
            )
            self._added = True
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.address, self.port))
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        self._spawn(self._accept)

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            self._spawn(self._relay, client, upstream)

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.5):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(_CHUNK)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._conns.difference_update((a, b))

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5)
        if self._added:
            subprocess.run(
                ["ip", "addr", "del", f"{self.address}/32", "dev", "lo"],
                check=False,
                capture_output=True,
            )
            self._added = False
