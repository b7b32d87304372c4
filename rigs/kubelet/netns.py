"""A real node's network of its own: a network namespace the harness creates, pinned by a bind
mount on a file in the node's work directory (``unshare --net=<file>``: nothing in
``/run/netns``, which ``ip netns add`` would create and make a mount point), where containerd,
the kubelet, the CNI bridge, the pods, the node's InternalIP and the ``kubernetes`` Service's
ClusterIP live. None of the node's 10.x addresses exists in the host's namespace, and two runs
never collide on an address, a port or a link name.

What crosses the namespace, all of it through sockets this process holds (no address, route or
link is added to the host's namespace, and nothing dials a host address other than loopback):

- inside, ``127.0.0.1:<API server port>`` → the API server on the host's loopback, so the
  kubelet's kubeconfig names the same URL as the host's;
- inside, ``10.0.0.1:443`` (the ``kubernetes`` Service's ClusterIP, on the namespace's ``lo``) →
  the same API server, for the pods (kube-proxy would route it; this machine has no iptables);
- the API server's own connections to the node (logs, exec, port-forward: the kubelet at its
  InternalIP) → its egress selector (``cluster``: HTTP CONNECT over a Unix socket,
  rigs/controlplane.py ``node_egress``) → a connection made inside.

A socket belongs to the network namespace of the thread that created it (setns(2) with
CLONE_NEWNET moves the calling thread only), so ``call`` runs a function on a short-lived thread
that entered the namespace first: the relays' listeners, their inward dials, and a test's reads
of pod IPs.

Owns: the namespace (its pin), the relays' threads and sockets, the egress socket. Must not:
add an address, route or link to the host's namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

NODE_IP = "10.89.0.1"
"""The node's InternalIP, on the namespace's ``lo`` (the kubelet refuses a loopback one); the
same in every run: it exists only inside."""
CLUSTER_IP = "10.0.0.1"
"""The ``kubernetes`` Service's ClusterIP for the test clusters' ``10.0.0.0/24`` (the API
server's certificate names it, rigs/controlplane.py ``make_pki``)."""
SERVICE_PORT = 443
_CLONE_NEWNET = 0x40000000
_MNT_DETACH = 2
_CHUNK = 65536
_MAX_HEAD = 16384

T = TypeVar("T")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def pinned(path: Path) -> bool:
    """A namespace is pinned at ``path`` (an nsfs mount there)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ", 1)
        if len(fields) == 2 and fields[1].startswith("nsfs ") and fields[0].split()[4] == str(path):
            return True
    return False


def call(path: Path, fn: Callable[[], T]) -> T:
    """``fn()`` on a fresh thread inside the network namespace at ``path``: the sockets it
    creates belong to that namespace for their whole life."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc().setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {path}: {os.strerror(err)}")
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=run, name="netns-call", daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def unpin(path: Path) -> list[str]:
    """Unmount the pin at ``path`` and remove the file (the namespace itself goes once no
    process or socket holds it: its bridge and the pods' veth ends with it). Returns the
    problems."""
    if pinned(path) and _libc().umount2(str(path).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        return [f"umount {path}: {os.strerror(err)}"]
    path.unlink(missing_ok=True)
    return []


def _name(sock: socket.socket, *, peer: bool = False) -> str:
    try:
        name = sock.getpeername() if peer else sock.getsockname()
    except OSError as e:
        return f"<{e.strerror}>"
    return ":".join(map(str, name)) if isinstance(name, tuple) else str(name or "unix")


def _listening(address: str, port: int) -> Callable[[], socket.socket]:
    def listen() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        s.listen(64)
        return s

    return listen


class _Relay:
    """Accepts on ``listener``; ``connect(client)`` (on the connection's own thread) returns the
    other end, or ``None`` to drop the client; then bytes flow both ways, untouched."""

    def __init__(
        self, listener: socket.socket, connect: Callable[[socket.socket], socket.socket | None]
    ) -> None:
        self._listener = listener
        self._connect = connect
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._serial = 0
        self.trace: list[str] = []
        """What the last connections did (``c<n> …``: accepted, connected, bytes each way, which
        leg ended first, and any error with its leg and call): a failing test shows it."""
        listener.settimeout(0.2)
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.add(client)
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._serial += 1
            tag = f"c{self._serial}"
        self._note(f"{tag} accepted from {_name(client, peer=True)}")
        try:
            upstream = self._connect(client)
        except OSError as e:
            self._note(f"{tag} connect: {e!r}")
            upstream = None
        if upstream is None:
            self._note(f"{tag} dropped before connecting")
            self._drop(client)
            return
        self._note(f"{tag} upstream {_name(upstream)} -> {_name(upstream, peer=True)}")
        with self._lock:
            self._conns.add(upstream)
        self._pipe(tag, client, upstream)

    def _pipe(self, tag: str, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        a.settimeout(None)
        b.settimeout(None)
        legs = {a: "client", b: "upstream"}
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        moved = {a: 0, b: 0}
        leg, call = "", ""
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.5):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    leg, call = legs[src], "recv"
                    data = src.recv(_CHUNK)
                    if not data:
                        self._note(f"{tag} {leg} ended first; {self._moved(moved, legs)}")
                        return
                    leg, call = legs[key.data], "send"
                    key.data.sendall(data)
                    moved[src] += len(data)
        except OSError as e:
            self._note(f"{tag} {leg} {call}: {e!r}; {self._moved(moved, legs)}")
            return
        finally:
            sel.close()
            self._drop(a, b)

    @staticmethod
    def _moved(moved: dict[socket.socket, int], legs: dict[socket.socket, str]) -> str:
        return ", ".join(f"{legs[s]} sent {n} B" for s, n in moved.items())

    def _note(self, what: str) -> None:
        with self._lock:
            self.trace.append(what)
            del self.trace[:-32]

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        with self._lock:
            self._conns.difference_update(socks)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5)
        self._drop(*conns)


class NodeNetwork:
    """The namespace pinned at ``path`` and the relays across it (module docstring). ``start``
    makes them; ``close`` removes them, also after a failed start, and returns the problems."""

    def __init__(self, path: Path, *, apiserver_port: int, egress_socket: Path | None) -> None:
        self.path = path
        self._apiserver = ("127.0.0.1", apiserver_port)
        self._egress_socket = egress_socket
        self._relays: list[_Relay] = []

    def start(self) -> None:
        if pinned(self.path):
            raise RuntimeError(f"a network namespace is pinned at {self.path} already")
        self.path.touch()
        nsenter = ["nsenter", f"--net={self.path}", "--", "ip"]
        for argv in (
            ["unshare", f"--net={self.path}", "true"],
            [*nsenter, "link", "set", "lo", "up"],
            [*nsenter, "addr", "add", f"{NODE_IP}/32", "dev", "lo"],
            [*nsenter, "addr", "add", f"{CLUSTER_IP}/32", "dev", "lo"],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        for address, port in (("127.0.0.1", self._apiserver[1]), (CLUSTER_IP, SERVICE_PORT)):
            listener = self.call(_listening(address, port))
            self._relays.append(_Relay(listener, self._to_apiserver))
        if self._egress_socket is not None:
            self._egress_socket.unlink(missing_ok=True)
            egress = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            egress.bind(str(self._egress_socket))
            os.chmod(self._egress_socket, 0o600)
            egress.listen(64)
            self._relays.append(_Relay(egress, self._inward))

    def trace(self) -> list[str]:
        """What the relays' last connections did (``_Relay.trace``, the last few of each)."""
        return [f"{n}: {line}" for n, relay in enumerate(self._relays) for line in relay.trace]

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` inside the namespace (module ``call``)."""
        return call(self.path, fn)

    def _to_apiserver(self, _client: socket.socket) -> socket.socket:
        return socket.create_connection(self._apiserver, timeout=5)

    def _inward(self, client: socket.socket) -> socket.socket | None:
        """The API server's HTTP CONNECT (k8s.io/apiserver egressselector ``tunnelHTTPConnect``:
        one request, then it reads one response and wants nothing buffered after it)."""
        client.settimeout(10)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(4096)
            if not chunk or len(head) > _MAX_HEAD:
                return None
            head += chunk
        head, _, rest = head.partition(b"\r\n\r\n")
        method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        host, _, port = target.rpartition(":")
        if method != "CONNECT" or not port.isdigit():
            client.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
            return None
        try:
            upstream = self.call(
                lambda: socket.create_connection((host.strip("[]"), int(port)), timeout=10)
            )
        except OSError as e:
            msg = f"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nX-Error: {e}\r\n\r\n"
            client.sendall(msg.encode())
            return None
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            upstream.sendall(rest)
        return upstream

    def stop_relays(self) -> None:
        """Close every relay and its sockets (what this process's end does to them)."""
        for relay in self._relays:
            relay.close()
        self._relays.clear()
        if self._egress_socket is not None:
            self._egress_socket.unlink(missing_ok=True)

    def close(self) -> list[str]:
        self.stop_relays()
        return unpin(self.path)
