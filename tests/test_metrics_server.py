"""The metrics HTTP server against real clients on loopback: stalled, trickling, crowding and
hanging-up ones, and the listen address as ``metrics.address`` spells it.

The server also answers the kubelet's liveness and readiness probes (``/healthz``, ``/readyz``),
whose default timeout is 1 s: that is the bar here. Bounds are generous, never tight timings.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuguard.adapters.metrics import (
    MetricsRegistry,
    MetricsServer,
    PrometheusRecorder,
    SnapshotCollector,
)
from gpuguard.adapters.metrics.server import _MAX_WORKERS
from gpuguard.adapters.readiness import readable
from gpuguard.config import load_settings
from gpuguard.core.model import Trigger
from gpuguard.errors import ConfigError
from tests.descriptors import descriptors_past_fd_setsize
from tests.idle_threads import wakeups_while_idle

PROBE_TIMEOUT_SECONDS = 1.0
"""The kubelet's default ``timeoutSeconds`` for liveness and readiness probes."""

DROP_WITHIN_SECONDS = 12.0
"""A stalled request must be dropped within this (the server allows a few seconds)."""


class _Padding:
    """A collector whose exposition is megabytes long, so a response takes many writes."""

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("gpuguard_test_padding", "x" * 8_000_000, value=1.0)


def _server(*, host: str = "127.0.0.1", padded: bool = False) -> MetricsServer:
    registry = CollectorRegistry()
    collector = SnapshotCollector(hostname="test-node")
    registry.register(collector)
    if padded:
        registry.register(_Padding())
    return MetricsServer(registry=registry, collector=collector, host=host, port=0)


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    running = _server()
    running.start()
    yield running
    running.stop()


def _get(port: int, path: str, *, host: str = "127.0.0.1") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=PROBE_TIMEOUT_SECONDS)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _is_closed(sock: socket.socket) -> bool:
    """True once the peer has closed (EOF or reset); never blocks."""
    if not readable([sock], 0):
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionError:
        return True


def _hang_up_hard(sock: socket.socket) -> None:
    """Close with a reset, as a client killed mid-read does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _wait_for_threads(at_most: int) -> None:
    deadline = time.monotonic() + 10
    while threading.active_count() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_request_head_not_finished_in_time_is_dropped_unanswered(server: MetricsServer) -> None:
    silent = socket.create_connection(("127.0.0.1", server.port))
    trickling = socket.create_connection(("127.0.0.1", server.port))
    try:
        silent.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: never complete
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nUser-Agent: " + b"s" * 200
        started = time.monotonic()
        closed: dict[str, float] = {}
        sent = 0
        while len(closed) < 2 and time.monotonic() - started < DROP_WITHIN_SECONDS:
            if "silent" not in closed and _is_closed(silent):
                closed["silent"] = time.monotonic() - started
            if "trickling" not in closed:
                try:
                    # One byte every 0.2 s: each read succeeds, the head never completes.
                    trickling.sendall(head[sent : sent + 1])
                    sent += 1
                    if _is_closed(trickling):
                        closed["trickling"] = time.monotonic() - started
                except ConnectionError:
                    closed["trickling"] = time.monotonic() - started
            time.sleep(0.2)
        assert set(closed) == {"silent", "trickling"}, f"still open after {DROP_WITHIN_SECONDS} s"
        _, response = _get(server.port, "/healthz")
        assert response == b"ok\n"
    finally:
        silent.close()
        trickling.close()


_SERVER_OWN_THREADS = 1
"""Threads a ``MetricsServer`` runs besides its worker pool: the accepting loop."""


def test_probes_answer_within_a_second_and_threads_stay_bounded_under_200_idle_connections() -> (
    None
):
    before = set(threading.enumerate())  # taken before the server starts: its threads are new
    running = _server()
    running.start()
    crowd: list[socket.socket] = []

    def started() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before]

    try:
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", running.port), timeout=5)
            if i % 2:
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # started, never finished
            crowd.append(sock)
        threads = [started()]
        for path, expected in [("/healthz", 200), ("/readyz", 503)] * 3:
            began = time.monotonic()
            status, _ = _get(running.port, path)
            elapsed = time.monotonic() - began
            assert status == expected
            assert elapsed < PROBE_TIMEOUT_SECONDS, f"{path} took {elapsed:.2f} s"
            threads.append(started())
        # A thread per connection would be 200 more; the pool stops at its cap.
        most = max(threads, key=len)
        names = Counter(t.name for t in most)
        assert len(most) <= _MAX_WORKERS + _SERVER_OWN_THREADS, f"{len(most)} threads: {names}"
    finally:
        for sock in crowd:
            sock.close()
        running.stop()


def test_a_client_hanging_up_mid_response_writes_nothing_to_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    running = _server(padded=True)
    running.start()
    try:
        baseline = threading.active_count()
        for read_first in (True, False, True, False):
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.settimeout(5)
            client.connect(("127.0.0.1", running.port))
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            if read_first:
                assert client.recv(1024).startswith(b"HTTP/1.0 200")  # the response has begun
            _hang_up_hard(client)
        _wait_for_threads(at_most=baseline)  # the server has finished with every one of them
        status, _ = _get(running.port, "/healthz")
        assert status == 200
    finally:
        running.stop()
    _, err = capfd.readouterr()
    assert err == ""


def test_an_ipv6_address_in_brackets_binds_on_ipv6_and_answers() -> None:
    from gpuguard.config import parse_listen_address

    assert load_settings(environ={"GPUGUARD_METRICS_ADDRESS": "[::1]:0"}).metrics.address == (
        "[::1]:0"
    )
    address = parse_listen_address("[::1]:0")
    assert (address.host, address.port) == ("::1", 0)
    running = _server(host=address.host)
    running.start()
    try:
        assert _get(running.port, "/healthz", host="::1") == (200, b"ok\n")
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("0.0.0.0:9410", "0.0.0.0", 9410),
        (":9410", "", 9410),
        ("metrics.local:0", "metrics.local", 0),
        ("[::]:65535", "::", 65535),
        ("[::ffff:10.0.0.1]:9410", "::ffff:10.0.0.1", 9410),
    ],
)
def test_parses_ipv4_hostname_empty_and_bracketed_ipv6_hosts(
    text: str, host: str, port: int
) -> None:
    from gpuguard.config import parse_listen_address

    address = parse_listen_address(text)
    assert (address.host, address.port) == (host, port)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (":99999", 'port "99999" is not a whole number from 0 to 65535'),
        ("host:-1", 'port "-1" is not a whole number from 0 to 65535'),
        ("host:abc", 'port "abc" is not a whole number from 0 to 65535'),
        ("host:", 'port "" is not a whole number from 0 to 65535'),
        ("[::1", '"[" without a closing "]"'),
        ("[::1]9410", '":port" must follow "]"'),
        ("[10.0.0.1]:9410", '"10.0.0.1" in brackets is not an IPv6 address'),
        ("9410", 'no ":port"'),
        ("::1:9410", "IPv6 hosts go in brackets"),
        ("bad_host:9410", 'host "bad_host" is not an IPv4 address or host name'),
    ],
)
def test_a_bad_address_is_a_config_error_naming_the_value_and_the_expected_form(
    text: str, reason: str
) -> None:
    from gpuguard.config import parse_listen_address

    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"GPUGUARD_METRICS_ADDRESS": text})
    (problem,) = caught.value.problems
    assert problem.startswith(f'env GPUGUARD_METRICS_ADDRESS: metrics.address = "{text}": ')
    assert reason in problem
    assert 'must be "host:port"' in problem
    with pytest.raises(ValueError, match="must be") as direct:
        parse_listen_address(text)
    assert f'"{text}"' in str(direct.value)
    assert reason in str(direct.value)


@pytest.mark.parametrize(
    ("host", "port", "url"),
    [
        ("0.0.0.0", 9410, "http://0.0.0.0:9410/metrics"),
        ("::1", 40123, "http://[::1]:40123/metrics"),
        ("node.example", 1, "http://node.example:1/metrics"),
    ],
)
def test_the_started_log_shows_the_url_as_bound(host: str, port: int, url: str) -> None:
    """``enforcer_started`` printed the configured address (``:0``, ``[::1]`` unbracketed)."""
    from gpuguard.app import metrics_url

    assert metrics_url(host, port) == url


def _telemetry() -> tuple[MetricsRegistry, SnapshotCollector, PrometheusRecorder]:
    registry = MetricsRegistry()
    collector = SnapshotCollector(hostname="n", changed=registry.changed)
    registry.register(collector)
    return registry, collector, PrometheusRecorder(registry, hostname="n")


def test_the_server_serves_what_was_recorded_after_a_cached_scrape() -> None:
    registry, collector, recorder = _telemetry()
    server = MetricsServer(registry=registry, collector=collector, host="127.0.0.1", port=0)
    server.start()
    try:
        _get(server.port, "/metrics")
        recorder.count_violation(Trigger.PRESSURE)
        _, body = _get(server.port, "/metrics")
        assert b'gpuguard_violations_total{trigger="pressure"} 1.0' in body
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# Probes are answered on arrival, ahead of /metrics work


class _Stuck(Collector):
    """A collector whose rendering blocks until released: every /metrics request waits."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def collect(self) -> Iterable[Metric]:
        self.entered.set()
        self.release.wait(30)
        yield GaugeMetricFamily("test_stuck", "blocked rendering", value=1.0)


def _raw(port: int, request: bytes, *, pause_after: int | None = None) -> bytes:
    """The whole response to ``request``; with ``pause_after``, the head is sent in two parts
    0.2 s apart (not yet complete when the connection is accepted)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if pause_after is None:
            s.sendall(request)
        else:
            s.sendall(request[:pause_after])
            time.sleep(0.2)
            s.sendall(request[pause_after:])
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


@contextmanager
def _every_connection_busy() -> Iterator[MetricsServer]:
    """A started server whose every admitted connection is a scrape stuck in its rendering."""
    registry = MetricsRegistry()
    collector = SnapshotCollector(hostname="n", changed=registry.changed)
    registry.register(collector)
    stuck = _Stuck()
    registry.register(stuck)
    server = MetricsServer(registry=registry, collector=collector, host="127.0.0.1", port=0)
    server.start()
    scrapes = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(40)]
    try:
        for s in scrapes:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert stuck.entered.wait(10)
        time.sleep(0.3)  # every admitted scrape is now serving, queued behind the rendering
        yield server
    finally:
        stuck.release.set()
        for s in scrapes:
            s.close()
        server.stop()


def test_probes_answer_while_every_connection_is_busy_rendering_metrics() -> None:
    """Before the probe path, 32 scrapes stuck in a rendering left no connection for a probe:
    it was closed unanswered (and, under a flood, waited up to 770 ms for its turn)."""
    with _every_connection_busy() as server:
        for path, expected in [("/healthz", 200), ("/readyz", 503)] * 3:
            start = time.monotonic()
            status, _ = _get(server.port, path)
            assert (status, time.monotonic() - start < PROBE_TIMEOUT_SECONDS) == (expected, True)


def test_a_probe_arriving_late_while_every_connection_is_busy_is_answered_past_fd_1024() -> None:
    """A probe whose head comes just after its connection was accepted, with no connection
    free, is waited for a moment (the refused path). With the server's descriptors numbered
    past FD_SETSIZE, as the enforcer's are once it pins a thousand GPU processes, that wait was
    a ``select(2)``: ValueError, the probe closed unanswered, the kubelet's probe failed."""
    with _every_connection_busy() as server, descriptors_past_fd_setsize():
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                time.sleep(0.01)  # accepted and found no head yet: the refused path waits
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.0 200"), "closed unanswered"


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/healthz?verbose=1", "/nowhere"])
def test_a_probe_gets_the_same_response_on_arrival_and_when_its_head_trickles_in(
    server: MetricsServer, path: str
) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.37\r\n\r\n".encode()
    at_once = _raw(server.port, request)
    trickled = _raw(server.port, request, pause_after=10)
    assert at_once == trickled
    assert at_once.startswith(b"HTTP/1.0 ")


def test_only_a_complete_plain_get_is_answered_on_arrival(server: MetricsServer) -> None:
    assert _raw(server.port, b"POST /healthz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
        b"HTTP/1.0 501"
    )
    assert _raw(server.port, b"GET /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 200")


def test_an_idle_server_sleeps_until_a_request_and_stops_at_once() -> None:
    """The stdlib's accept loop woke every 0.5 s to look for a shutdown request (two
    wake-ups a second of an idle enforcer). Now it sleeps until a connection comes, still
    serves, and a stop ends it at once."""
    running = _server()
    running.start()
    try:
        assert _get(running.port, "/healthz") == (200, b"ok\n")
        accepting = running._thread
        woke = wakeups_while_idle(accepting, 2.0)
        assert woke <= 1, f"the accepting thread ran {woke} times in 2 s without a request"
        status, body = _get(running.port, "/metrics")
        assert status == 200
        assert b"gpuguard" in body
    finally:
        started = time.monotonic()
        running.stop()
        took = time.monotonic() - started
    assert not accepting.is_alive()
    assert took < 0.5, f"stop() took {took:.2f} s"
    running.stop()  # idempotent: the wake-up pipe is closed once only


def test_a_server_stopped_before_it_was_started_closes_cleanly() -> None:
    running = _server()
    running.stop()
    running.stop()
