"""The HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``: ``MetricsServer``.

It also answers the kubelet's liveness and readiness probes (1 s timeout by default), so no
client may hold it up: a request head must arrive within a few seconds (a client trickling a byte
at a time included), connections are bounded (a newcomer displaces the oldest one still sending
its head), a kept pool of worker threads serves them (no thread per connection), a probe whose
head has arrived is answered on the accepting thread ahead of any ``/metrics`` work, and a client
hanging up is not an error. The stdlib's ``ThreadingHTTPServer`` did none of this: it gave every
connection a thread for as long as it stayed open, queued 5 at most, and printed a traceback to
stderr (outside the JSON log) for every client that hung up. A serving library was weighed and
not taken: none bounds the time to send a request head or answers probes ahead of queued work
(docs/performance.md#metrics-server-a-serving-library-weighed).

What it serves comes from ``gpuguard.adapters.metrics.collectors`` (the exposition, readiness).
It must not parse listen addresses (``config.parse_listen_address`` does).
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import queue
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Final

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpuguard.adapters.metrics.collectors import Exposition, SnapshotCollector
from gpuguard.adapters.readiness import readable

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = structlog.get_logger(__name__)

_READ_TIMEOUT_SECONDS: Final = 5.0
"""Seconds a client has to send its whole request head (and then, again, to take the response).
Probes and Prometheus send the head in one packet; one still unfinished after this is stalled or
hostile and is dropped unanswered, whether it sent nothing or a byte at a time."""

_MAX_CONNECTIONS: Final = 32
"""Connections served at once. Past it a new connection displaces the oldest one still sending
its head, so clients that stall cannot starve the probes; when every connection is past its
head, the new one is closed at once. A displaced connection ends within milliseconds."""

_MAX_WORKERS: Final = 2 * _MAX_CONNECTIONS
"""Threads that serve connections, started as needed and kept: every open connection (live or
displaced, at most twice ``_MAX_CONNECTIONS``) has one. Starting a thread per connection made the
accepting thread wait for each new thread's first turn at the GIL, and probes queued behind."""

_LISTEN_BACKLOG: Final = socket.SOMAXCONN
"""Connections the kernel queues for accept (capped by ``net.core.somaxconn``). The stdlib's 5
let 2 of 61 probes time out behind 200 slow clients: a full queue drops the probe's SYN, and the
retry comes 1 s later. Accepting takes about a millisecond, so a long queue costs a probe less."""


_PROBE_WAIT_SECONDS: Final = 0.05
"""When every connection is taken, how long a newcomer may take to send its head before it is
closed unanswered: a probe sends its head with the connection, so it is answered; a client that
sends nothing costs the accepting thread at most this, and only while the server is full."""

_PROBE_HEAD_BYTES: Final = 4096
"""A probe's whole request head must be in this many bytes to be answered on arrival (the
kubelet's is about 150)."""

Reply = tuple[int, bytes, str]
"""An HTTP status, body and content type."""


def _response(code: int, body: bytes, ctype: str) -> bytes:
    """The whole HTTP/1.0 response, the same on both paths. One request per connection, said
    explicitly: an HTTP/1.1 client (h2load) otherwise sent its next request on the connection
    being closed and counted it as an error."""
    head = (
        f"HTTP/1.0 {code} {HTTPStatus(code).phrase}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _probe_path(head: bytes) -> str | None:
    """The path of a complete ``GET`` request head, else ``None`` (not there yet, or not a
    plain GET: the full handler answers those)."""
    if b"\r\n\r\n" not in head:
        return None
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"GET" or not parts[2].startswith(b"HTTP/1."):
        return None
    return parts[1].split(b"?", 1)[0].decode("ascii", "replace")


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes until a deadline. Each read waits only for what is left of it: a plain
    socket timeout restarts with every byte, so a client trickling one byte a second would hold
    its thread for ever."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request head not complete in time")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)


class _Stage(enum.Enum):
    READING = "reading"  # the request head: may be displaced by a newcomer
    SERVING = "serving"  # the head is in: answered, never displaced
    DISPLACED = "displaced"  # shut down for a newcomer; its thread is ending


class _BoundedHTTPServer(socketserver.TCPServer):
    """Connections served by a kept pool of worker threads (at most ``_MAX_WORKERS``), each
    connection against a deadline: at most ``_MAX_CONNECTIONS`` served at once, and as many again
    only while displaced ones end. Probes are answered on the accepting thread."""

    allow_reuse_address = True  # as HTTPServer: a restarted agent rebinds at once
    request_queue_size = _LISTEN_BACKLOG

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[_Handler],
        *,
        probe: Callable[[str], Reply | None] = lambda path: None,
    ) -> None:
        """``probe(path)``: the reply to a probe path (``None``: not a probe), answered on the
        accepting thread; it must not block."""
        # Only an IPv6 address has a colon in it (config.parse_listen_address took the brackets).
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._probe = probe
        self._changed = threading.Condition()
        self._open: dict[socket.socket, _Stage] = {}
        """Every admitted connection, oldest first."""
        self._pending: queue.SimpleQueue[tuple[socket.socket, Any] | None] = queue.SimpleQueue()
        """Admitted connections for the workers; ``None`` tells a worker to end."""
        self._workers: list[threading.Thread] = []
        self._idle = 0
        """Workers waiting for a connection."""
        self._queued = 0
        """Connections put on ``_pending`` and not yet taken."""
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        """:meth:`shutdown` writes a byte here: the only thing besides a connection that ends
        :meth:`serve_forever`'s wait."""
        self._wake_fds: tuple[int, ...] = (self._wake_read, self._wake_write)
        """The pipe's descriptors until :meth:`server_close` closes them."""
        self._stopping = False
        self._loop_ended = threading.Event()
        super().__init__((host, port), handler)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept connections until :meth:`shutdown`. The thread sleeps until a connection or
        the shutdown byte arrives: the stdlib's loop woke every ``poll_interval`` (0.5 s) to
        look for a shutdown request, two wake-ups a second of an otherwise idle enforcer.
        ``poll_interval`` is accepted for the stdlib's signature and not used."""
        try:
            with selectors.PollSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake_read, selectors.EVENT_READ)
                while not self._stopping:
                    ready = {key.fileobj for key, _ in selector.select()}
                    if self._stopping or self._wake_read in ready:
                        return
                    self._accept_one()
        finally:
            self._loop_ended.set()

    def _accept_one(self) -> None:
        """The stdlib's ``_handle_request_noblock`` (private there): one connection accepted and
        handed to :meth:`process_request`; an error is logged and the connection closed."""
        try:
            request, client_address = self.get_request()
        except OSError:  # the client left before the accept
            return
        try:
            self.process_request(request, client_address)
        except Exception:  # noqa: BLE001 — handle_error logs it; the loop serves on
            self.handle_error(request, client_address)
            self.shutdown_request(request)
        except BaseException:
            self.shutdown_request(request)
            raise

    def shutdown(self) -> None:
        """End :meth:`serve_forever` and wait for it (from another thread): at once, not at its
        next poll. As the stdlib's: only while :meth:`serve_forever` runs or is about to."""
        self._stopping = True
        with contextlib.suppress(BlockingIOError):  # a byte is already there
            os.write(self._wake_write, b"x")
        self._loop_ended.wait()

    def process_request(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any
    ) -> None:
        assert isinstance(request, socket.socket)  # TCP: always a connected socket
        if self._answer_probe(request):
            return
        if not self._admit(request):
            if not self._answer_probe(request, wait=_PROBE_WAIT_SECONDS):
                log.debug("metrics_connection_refused", open_connections=_MAX_CONNECTIONS)
                self.shutdown_request(request)
            return
        with self._changed:
            self._queued += 1
            grow = self._queued > self._idle and len(self._workers) < _MAX_WORKERS
            if grow:
                thread = threading.Thread(target=self._work, name="metrics-http-conn")
                thread.daemon = True
                self._workers.append(thread)
        self._pending.put((request, client_address))
        if grow:
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (memory, pids limit): handle_error logs it
                with self._changed:
                    self._workers.remove(thread)
                if not self._workers:  # nobody would ever take the connection: drop it
                    self._drop_pending()
                raise

    def _work(self) -> None:
        """A worker: serves queued connections until the server closes."""
        while True:
            with self._changed:
                self._idle += 1
            item = self._pending.get()
            with self._changed:
                self._idle -= 1
                if item is not None:
                    self._queued -= 1
            if item is None:
                return
            self._serve(*item)

    def _drop_pending(self) -> None:
        while True:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                with self._changed:
                    self._queued -= 1
                self._release(item[0])
                self.shutdown_request(item[0])

    def _answer_probe(self, connection: socket.socket, *, wait: float = 0.0) -> bool:
        """Answers a probe whose whole request head has arrived right here, on the accepting
        thread, ahead of every ``/metrics`` request in flight or queued: under a flood of
        scrapes a probe waited for a connection thread to start and for its turn at the GIL
        (up to 770 ms measured, against the kubelet's 1 s timeout). Anything else, or a head
        still on its way, goes the usual way. ``wait``: seconds to let a head arrive first (only
        for a connection that would otherwise be closed unanswered)."""
        try:
            if wait:
                readable([connection], wait)
            head = connection.recv(_PROBE_HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing yet (EAGAIN), or the client already left
            return False
        path = _probe_path(head)
        reply = self._probe(path) if path is not None else None
        if reply is None:
            return False
        try:
            connection.settimeout(_READ_TIMEOUT_SECONDS)
            connection.recv(head.index(b"\r\n\r\n") + 4)  # the head, taken off the socket
            connection.sendall(_response(*reply))  # a few hundred bytes: the socket buffer
        except OSError:
            pass  # the prober hung up: its business
        self.shutdown_request(connection)
        return True

    def head_received(self, connection: socket.socket) -> None:
        """``connection`` sent its whole request head: from now on it is served, not displaced."""
        with self._changed:
            if self._open.get(connection) is _Stage.READING:
                self._open[connection] = _Stage.SERVING

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The stdlib prints a traceback to stderr, outside the JSON log.
        log.exception("metrics_request_failed")

    def server_close(self) -> None:
        super().server_close()
        # Once only: a descriptor closed twice may by then be another file's.
        fds, self._wake_fds = self._wake_fds, ()
        for fd in fds:
            os.close(fd)
        with self._changed:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self._changed.wait_for(lambda: not self._open, timeout=5)
            workers = list(self._workers)
        for _ in workers:
            self._pending.put(None)
        for worker in workers:
            worker.join(timeout=1)

    def _admit(self, connection: socket.socket) -> bool:
        with self._changed:
            live = [c for c, stage in self._open.items() if stage is not _Stage.DISPLACED]
            if len(live) >= _MAX_CONNECTIONS:
                oldest = next((c for c in live if self._open[c] is _Stage.READING), None)
                if oldest is None:
                    return False
                self._open[oldest] = _Stage.DISPLACED
                log.debug("metrics_connection_displaced", open_connections=_MAX_CONNECTIONS)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its blocked read returns at once
            # Waiting for each displaced thread to end made accepting slow under a flood (the
            # backlog fills, probes' SYNs are dropped); wait only when they pile up.
            if not self._changed.wait_for(
                lambda: len(self._open) < 2 * _MAX_CONNECTIONS, timeout=1.0
            ):
                return False
            self._open[connection] = _Stage.READING
            return True

    def _release(self, connection: socket.socket) -> None:
        # Before the socket is closed: _admit and server_close shut down only what is listed,
        # under the lock, so never a closed socket whose descriptor was reused.
        with self._changed:
            del self._open[connection]
            self._changed.notify_all()

    def _serve(self, connection: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(connection, client_address)
        except (ConnectionError, TimeoutError):
            pass  # the client hung up or stopped reading: its business, not an error of ours
        except Exception:
            log.exception("metrics_request_failed")
        finally:
            self._release(connection)
            self.shutdown_request(connection)


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0), its head read against the deadline; the stdlib's
    request-line and header limits (414, 431) hold as before."""

    server: _BoundedHTTPServer
    timeout = _READ_TIMEOUT_SECONDS  # set on the socket: bounds writing the response

    def setup(self) -> None:
        deadline = time.monotonic() + _READ_TIMEOUT_SECONDS
        super().setup()
        self.rfile.close()  # the plain reader, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.head_received(self.connection)
        self.connection.settimeout(_READ_TIMEOUT_SECONDS)  # the response gets its own seconds
        return parsed

    def log_error(self, format: str, *args: Any) -> None:
        # Timeouts and malformed requests: the client's trouble, worth a line only when debugging.
        log.debug("metrics_request_rejected", detail=format % args)

    def log_message(self, format: str, *args: Any) -> None:
        return  # scrapes are not worth a log line each


def _readiness_of(collector: SnapshotCollector) -> Callable[[], tuple[bool, str]]:
    return lambda: collector.ready


class MetricsServer:
    """``/metrics``, ``/healthz`` (the process answers) and ``/readyz`` (the process can do its
    job: for the enforcer, enforcement can act)."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        collector: SnapshotCollector | None = None,
        ready: Callable[[], tuple[bool, str]] | None = None,
        host: str,
        port: int,
    ) -> None:
        """``host``: an IPv4 address, a host name, or an IPv6 address without brackets (as
        ``config.parse_listen_address`` returns it); "" is every IPv4 interface.

        Readiness comes from exactly one of ``collector`` (the enforcer's last published poll)
        or ``ready``: called for each ``/readyz`` on a server thread, it returns
        ``(ready, reason)`` and must not block or raise."""
        if collector is not None and ready is None:
            ready = _readiness_of(collector)
        elif ready is None or collector is not None:
            raise TypeError("MetricsServer needs exactly one of collector= and ready=")
        exposition = Exposition(registry)
        ready_ = ready

        def probe(path: str) -> Reply | None:
            if path == "/healthz":
                return 200, b"ok\n", "text/plain"
            if path == "/readyz":
                ready, reason = ready_()
                body = b"ok\n" if ready else f"not ready: {reason}\n".encode()
                return 200 if ready else 503, body, "text/plain"
            return None

        class Handler(_Handler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                reply: Reply = (
                    (200, exposition.body(), CONTENT_TYPE_LATEST)
                    if path == "/metrics"
                    else probe(path) or (404, b"not found\n", "text/plain")
                )
                self.log_request(reply[0])
                self.wfile.write(_response(*reply))

        self._server = _BoundedHTTPServer(host, port, Handler, probe=probe)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Idempotent; also for a server never started (a failure between bind and start must
        surface as itself, not as this method's error)."""
        started = self._thread.ident is not None
        if self._thread.is_alive():  # shutdown() would wait for ever on a loop never started
            self._server.shutdown()
        self._server.server_close()
        if started:
            self._thread.join(timeout=5)
