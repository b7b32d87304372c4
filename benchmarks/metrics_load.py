"""The metrics endpoint under load on loopback: does serving scrapes, a flood
of requests and slow clients slow the enforcement poll, and does ``/healthz`` keep answering?

Runs the real ``gpuguard enforce`` (pods file, the NVML stand-in listing a few processes, the
poll every ``--poll`` seconds with the fast path off so the poll is periodic, debug logs: one
``poll_finished`` line per poll), then two phases of ``--seconds`` each:

- quiet: only the ``/healthz`` prober (a request every 50 ms, its latency timed);
- loaded: the prober, ``h2load`` (Debian's ``nghttp2-client``, fetched by
  ``scripts/ensure-h2load.sh``) at ``--rps`` requests a second on ``/metrics`` over 10
  connections, and ``--slow`` slow clients that send a request head a byte a second (and
  reconnect when dropped).

Prints one table: per phase, the poll interval p50/p99 (between consecutive ``poll_finished``
lines), ``/healthz`` latency p99/max and failures, and what h2load achieved; then the two
verdicts (poll interval p99 within 10 % of quiet; ``/healthz`` within 100 ms
throughout), and the sampling settings the enforcer ran with against gpuguard's shipped defaults.

Not as shipped, on purpose: the shipped default reads memory every 50 ms and lists a device only
when it moved or every ``poll_interval_seconds`` (1 s), so the time between two ``poll_finished``
lines would measure the workload, not the server's interference. With the fast path off every
poll is a full listing on a fixed cadence (``--poll``, 0.25 s: gpuguard's default before
``b413ffe``), whose delay is what the metrics server could cost the enforcer.

Every process it starts is killed at the end. Run as any user:

    make -C tests/nvml_stub
    .venv/bin/python -m benchmarks.metrics_load [--seconds 60] [--rps 1000] [--slow 200] \
        [--record docs/performance.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuguard.config import EnforcementSettings
from rigs.measure import append_record, machine, pct
from rigs.nvml_stub import STUB_LIB, stub_device, stub_scenario, stub_uuid
from rigs.processes import Gpuguard, free_port, gpuguard_argv, gpuguard_env, read_jsonl

REPO = Path(__file__).resolve().parents[1]

CONNECTIONS = 10


@dataclass
class Prober:
    """``GET /healthz`` every 50 ms; latency of each, failures counted."""

    port: int
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(0.05):
            start = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    reply = s.recv(64)
                ok = reply.startswith(b"HTTP/1.") and b" 200 " in reply[:16]
            except OSError:
                ok = False
            if ok:
                self.latencies.append(time.monotonic() - start)
            else:
                self.failures += 1

    def stop(self) -> None:
        self._stop.set()


@dataclass
class SlowClients:
    """``count`` connections that each send a request head one byte a second, reconnecting
    when the server drops them (it does, after its 5 s head deadline)."""

    port: int
    count: int
    reconnects: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        head = b"GET /metrics HTTP/1.1\r\nHost: slow\r\n\r\n"
        socks: list[tuple[socket.socket | None, int]] = [(None, 0)] * self.count
        while not self._stop.wait(1.0):
            for i, (open_sock, sent_before) in enumerate(socks):
                sock, sent = open_sock, sent_before
                try:
                    if sock is None:
                        sock = socket.create_connection(("127.0.0.1", self.port), timeout=1.0)
                        sent = 0
                    sock.sendall(head[sent % len(head) : sent % len(head) + 1])
                    socks[i] = (sock, sent + 1)
                except OSError:
                    if sock is not None:
                        sock.close()
                    socks[i] = (None, 0)
                    self.reconnects += 1
        for sock, _sent in socks:
            if sock is not None:
                sock.close()

    def stop(self) -> None:
        self._stop.set()


def poll_intervals(log: Path, since: float, until: float) -> list[float]:
    """Seconds between consecutive ``poll_finished`` lines whose wall time is in the window."""
    stamps = [
        datetime.datetime.fromisoformat(doc["timestamp"].replace("Z", "+00:00")).timestamp()
        for doc in read_jsonl(log)
        if doc.get("event") == "poll_finished"
    ]
    window = [t for t in stamps if since <= t <= until]
    return [b - a for a, b in itertools.pairwise(window)]


@contextlib.contextmanager
def enforcer(work: Path, poll: float) -> Iterator[Gpuguard]:
    """``gpuguard enforce`` on a pods file with no pods and the stand-in listing 16 processes
    of 1 GiB, polling every ``poll`` seconds with the fast path off; once ready, until the
    block ends."""
    port = free_port()
    scenario = work / "scenario.json"
    processes = [(4_000_000 + i, 2**30) for i in range(16)]
    scenario.write_text(
        json.dumps(stub_scenario([stub_device(uuid=stub_uuid(0), processes=processes)]))
    )
    pods = work / "pods.yaml"
    pods.write_text("apiVersion: v1\nkind: List\nitems: []\n")
    config = work / "config.toml"
    config.write_text(
        'version = 1\n[enforcement]\nmode = "enforce"\n'
        f"poll_interval_seconds = {poll}\nfast_interval_seconds = 0\n"
        f'lock_file = "{work / "enforcer.lock"}"\n'  # not the host's: other runs may be on it
        f'[metrics]\naddress = "127.0.0.1:{port}"\n'
        f'[nvml]\nlibrary_path = "{STUB_LIB}"\n[logging]\nlevel = "debug"\nformat = "json"\n'
    )
    argv = gpuguard_argv("enforce", "--config", str(config), "--pods-file", str(pods),
                         "--node-name", "load-node")  # fmt: skip
    running = Gpuguard(
        name="gpuguard enforce",
        argv=argv,
        env=gpuguard_env({"NVML_STUB_SCENARIO": str(scenario)}),
        log=work / "enforcer.log",
        port=port,
    )
    running.launch()
    try:
        try:
            running.wait_ready()
        except (RuntimeError, TimeoutError) as e:
            raise SystemExit(str(e)) from None
        yield running
    finally:
        running.stop(timeout=10)


@dataclass
class Phase:
    name: str
    intervals: list[float]
    prober: Prober
    h2load: str = "-"


def _h2load_summary(h2: subprocess.Popen[bytes], requests_log: Path, seconds: float) -> str:
    """What h2load got, from its per-request log (start time µs, status, µs to the end). h2load
    1.52 with ``--rps`` and ``-D`` against a server that closes each connection sometimes never
    exits after its duration (it did so against the old server as well): it is stopped after
    5 s, and the figures come from the log, not from its final summary."""
    try:
        h2.wait(timeout=5)
    except subprocess.TimeoutExpired:
        h2.send_signal(signal.SIGINT)
        try:
            h2.wait(timeout=5)
        except subprocess.TimeoutExpired:
            h2.kill()
            h2.wait()
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    with contextlib.suppress(FileNotFoundError), requests_log.open() as rows:
        for row in rows:
            fields = row.split("\t")
            if len(fields) >= 3:
                statuses[fields[1]] = statuses.get(fields[1], 0) + 1
                latencies.append(int(fields[2]) / 1000)
    ok = statuses.get("200", 0)
    other = sum(statuses.values()) - ok
    return (
        f"{ok / seconds:.0f} req/s answered 200 ({ok} responses, {other} other); "
        f"latency p50 {pct(latencies, 50):.1f} ms, p99 {pct(latencies, 99):.1f} ms"
    )


def run_phase(
    name: str, port: int, log: Path, seconds: float, load: argparse.Namespace | None
) -> Phase:
    prober = Prober(port)
    threads = [threading.Thread(target=prober.run, daemon=True)]
    slow = None
    h2 = None
    if load is not None:
        slow = SlowClients(port, load.slow)
        threads.append(threading.Thread(target=slow.run, daemon=True))
        h2load = (
            subprocess.run(
                [str(REPO / "scripts/ensure-h2load.sh")], check=True, capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        per_client = max(1, load.rps // CONNECTIONS)
        requests_log = log.with_name("h2load-requests.tsv")
        h2 = subprocess.Popen(
            [h2load, "--h1", "-c", str(CONNECTIONS), "--rps", str(per_client),
             "-D", str(int(seconds)), f"--log-file={requests_log}",
             f"http://127.0.0.1:{port}/metrics"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    start = time.time()
    for t in threads:
        t.start()
    time.sleep(seconds)
    prober.stop()
    if slow is not None:
        slow.stop()
    for t in threads:
        t.join(timeout=10)
    summary = "-"
    if h2 is not None:
        summary = _h2load_summary(h2, log.with_name("h2load-requests.tsv"), seconds)
    until = time.time()
    return Phase(name, poll_intervals(log, start + 1, until), prober, summary)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60, help="each phase (default 60)")
    parser.add_argument("--rps", type=int, default=1000, help="h2load's rate (default 1000)")
    parser.add_argument("--slow", type=int, default=200, help="slow clients (default 200)")
    parser.add_argument("--poll", type=float, default=0.25, help="poll interval (default 0.25)")
    parser.add_argument("--record", type=Path, help="append the results to this file")
    args = parser.parse_args(argv)
    if not STUB_LIB.exists():
        raise SystemExit(f"{STUB_LIB} missing: run make -C tests/nvml_stub")
    info = machine()  # its load is taken now, before the run: how busy the machine was
    print("\n".join(f"# {k}: {v}" for k, v in info.items()), flush=True)  # the header
    with (
        tempfile.TemporaryDirectory(prefix="gpuguard-load-") as tmp,
        enforcer(Path(tmp), args.poll) as running,
    ):
        time.sleep(3)
        quiet = run_phase("quiet", running.port, running.log, args.seconds, None)
        loaded = run_phase("loaded", running.port, running.log, args.seconds, args)
    rows = [
        "| phase | polls | poll interval p50 / p99 ms | /healthz p99 / max ms | /healthz failed"
        " | h2load |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for p in (quiet, loaded):
        lat = [x * 1000 for x in p.prober.latencies]
        rows.append(
            f"| {p.name} | {len(p.intervals) + 1} | {pct(p.intervals, 50) * 1000:.1f} / "
            f"{pct(p.intervals, 99) * 1000:.1f} | {pct(lat, 99):.1f} / "
            f"{max(lat, default=float('nan')):.1f} | {p.prober.failures} | {p.h2load} |"
        )
    q99, l99 = pct(quiet.intervals, 99), pct(loaded.intervals, 99)
    worst = max((x * 1000 for x in loaded.prober.latencies), default=float("inf"))
    verdicts = [
        f"- poll interval p99 loaded {l99 * 1000:.1f} ms vs quiet {q99 * 1000:.1f} ms: "
        + ("within 10 %" if l99 <= 1.1 * q99 else f"MISSES 10 % (+{(l99 / q99 - 1) * 100:.0f} %)"),
        f"- /healthz slowest under load {worst:.1f} ms, {loaded.prober.failures} failed: "
        + ("within 100 ms" if worst <= 100 and not loaded.prober.failures else "MISSES 100 ms"),
    ]
    shipped = EnforcementSettings()
    settings = (
        f"- enforcer sampling: poll_interval_seconds = {args.poll:g}, fast_interval_seconds = 0 "
        f"(the fast path off, so that every poll is a full listing on a fixed cadence); "
        f"gpuguard's shipped defaults: poll_interval_seconds = "
        f"{shipped.poll_interval_seconds:g}, fast_interval_seconds = "
        f"{shipped.fast_interval_seconds:g}"
    )
    text = "\n".join([*rows, "", *verdicts, settings])
    print(text)
    if args.record is not None:
        append_record(args.record, f"Metrics endpoint under load ({info['date']})", info, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
