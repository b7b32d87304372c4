"""Every panel query of the committed dashboard on a real Prometheus 3.16: each
parses and, but for the few listed in ``EMPTY`` with their reason, returns data.

The data is real: ``gpuguard demo --metrics-port`` runs the real enforcer over a simulated node
(it stops ``ml-team/trainer-greedy``) and the real sharing agent over a simulated cluster (the
A100 node's ``PrometheusAgentRecorder`` on the same registry), a stand-in dcgm-exporter (an
``http.server`` here) serves ``DCGM_FI_DEV_FB_USED``/``FB_FREE``/``GPU_UTIL`` for the demo's GPU
UUIDs with dcgm-exporter 4.x's labels, and Prometheus scrapes both every second.

The queries are the Go checker's (``dashboards/validate -queries``), with Grafana's variables
replaced as ``substitute`` says. Each runs as Grafana runs it: a range query over the demo's run
(step 1 s), or an instant query at the demo's last scrape for ``"instant": true`` targets (the
tables) and the template variables. Every process started here is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dashboards import generate
from gpuguard.sim.node import sim_gpu
from rigs.controlplane import free_port
from tests.dashboard_validator import validate
from tests.helpers.demo_prometheus import demo_under_prometheus
from tests.promtools import get_json, tool

pytestmark = pytest.mark.tools

DEMO_SECONDS = 15
"""Act one's length: the offender crosses its limit at ~6.3 s and is stopped ~2.5 s later."""

EMPTY: dict[str, str] = {}
"""(None today.) The demo's own refusals are counted at its first poll, before the first scrape,
and its agent meets no reconcile error: ``late_events`` supplies both after scraping began."""
"""Panels that may return nothing over the demo's run, by title, and why. A query of theirs
must still parse."""

_INTERVAL = re.compile(
    r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}"
)
_OTHER = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")


def substitute(expr: str) -> str:
    """Grafana's variables as a dashboard with every value selected has them: the interval
    variables become 5m (``$__range`` too: the run is shorter) and any other variable, which only
    ever stands inside a quoted ``=~`` matcher, ``.*``. The same patterns as the Go checker's
    ``substitute`` (``dashboards/validate/main.go``), which only parses and so writes ``x``."""
    return _OTHER.sub(".*", _INTERVAL.sub("5m", expr))


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    panel: int
    title: str
    expr: str
    instant: bool


def queries(validator: Path) -> list[Query]:
    """The committed dashboard's queries as the Go checker lists them, each marked instant when
    its target is (template variables are instant: Grafana lists their values now)."""
    run = validate(validator, generate.OUTPUT, "-queries")
    assert run.returncode == 0, run.stdout + run.stderr
    dashboard = json.loads(generate.OUTPUT.read_text())
    instant = {
        (panel["id"], target["expr"])
        for row in dashboard["panels"]
        for panel in [row, *row.get("panels", [])]
        for target in panel.get("targets", [])
        if target.get("instant")
    }
    found = []
    for line in run.stdout.splitlines():
        q = json.loads(line)
        found.append(
            Query(
                panel=q["panel"],
                title=q["title"],
                expr=q["expr"],
                instant=q["panel"] == 0 or (q["panel"], q["expr"]) in instant,
            )
        )
    return found


# -- a stand-in dcgm-exporter -------------------------------------------------------------------

GPUS = [sim_gpu(0), sim_gpu(1)]
"""The demo's node (``gpuguard.commands.demo.scenario.build_scenario``): two simulated 80 GiB
GPUs."""


def dcgm_metrics() -> str:
    """dcgm-exporter 4.x's exposition for the demo's GPUs (FB in MiB; ``Hostname`` as 4.x
    before 4.6 spells the host; the dashboard joins on ``UUID`` only)."""
    lines = []
    families: list[tuple[str, str, tuple[int, int]]] = [
        ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", (22528, 30720)),
        ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", (59392, 51200)),
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", (87, 47)),
    ]
    for name, help_text, values in families:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for g in GPUS:
            labels = (
                f'gpu="{g.index}",UUID="{g.uuid}",pci_bus_id="00000000:{g.index + 0x18:02X}:00.0",'
                f'device="nvidia{g.index}",modelName="NVIDIA H100 80GB HBM3",Hostname="demo-node"'
            )
            lines.append(f"{name}{{{labels}}} {values[g.index]}")
    return "\n".join(lines) + "\n"


class _DcgmHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = dcgm_metrics().encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def dcgm_exporter() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DcgmHandler)
    thread = threading.Thread(target=server.serve_forever, name="dcgm-stand-in", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


# -- a second node whose refusals and reconcile errors come after scraping began ----------------


@contextlib.contextmanager
def late_events() -> Iterator[tuple[int, threading.Event]]:
    """gpuguard's real recorders and metrics server for another node (``gpu-t4-1``), whose
    enforcer refuses (an exempt pod) and whose agent fails a reconcile once a second after
    ``scraped`` is set: the demo counts its refusals at its first poll, which no scrape can see
    increase, and its agent never errs. Yields the port and the ``scraped`` event."""
    from prometheus_client import CollectorRegistry

    from gpuguard.adapters.metrics import (
        MetricsServer,
        PrometheusAgentRecorder,
        PrometheusRecorder,
    )
    from gpuguard.core.model import RefusalReason
    from gpuguard.core.reconcile import ReconcileError

    registry = CollectorRegistry()
    recorder = PrometheusRecorder(registry, hostname="gpu-t4-1")
    agent = PrometheusAgentRecorder(registry, node="gpu-t4-1")
    agent.show_labels(rule="t4-shared", device_plugin_config="slice-4", mig_config=None)
    server = MetricsServer(registry=registry, ready=lambda: (True, ""), host="127.0.0.1", port=0)
    server.start()
    scraped, stop = threading.Event(), threading.Event()

    def events() -> None:
        scraped.wait()
        while not stop.wait(1.0):
            recorder.count_refusal(RefusalReason.EXEMPT)
            agent.count_reconcile_error(ReconcileError.API_ERROR)

    thread = threading.Thread(target=events, name="late-events", daemon=True)
    thread.start()
    try:
        yield server.port, scraped
    finally:
        stop.set()
        scraped.set()
        thread.join(10)
        server.stop()


# -- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    api: str
    start: float
    end: float
    """Unix time of the demo's last scrape (before its series went stale)."""


def _wait(what: str, until: Any, seconds: float, log: Path) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            found = until()
            if found:
                return found
        time.sleep(0.5)
    pytest.fail(f"{what} within {seconds:.0f} s; Prometheus log:\n{log.read_text()[-3000:]}")


def _last_scrape(api: str, start: float, instance: str) -> float | None:
    """The last evaluation time (1 s grid) at which the demo's target was up, once a later
    scrape has failed (the demo exited): its series are fresh there and stale after."""
    result = get_json(
        f"{api}/query_range",
        query=f'up{{instance="{instance}"}}',  # the demo's: the second node's stays up
        start=str(start),
        end=str(time.time()),
        step="1",
    )["data"]["result"]
    if not result:
        return None
    values = result[0]["values"]
    if values[-1][1] != "0":
        return None
    up = [float(t) for t, v in values if v == "1"]
    return up[-1] if up else None


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    prometheus = tool("prometheus")
    tmp = tmp_path_factory.mktemp("dashboard-queries")
    metrics_port = free_port()
    with dcgm_exporter() as dcgm_port, late_events() as (late_port, late_scraped):
        start = time.time()
        with demo_under_prometheus(
            prometheus,
            tmp,
            demo_seconds=DEMO_SECONDS,
            metrics_port=metrics_port,
            other_jobs={
                "gpuguard": [f"127.0.0.1:{late_port}"],
                "dcgm-exporter": [f"127.0.0.1:{dcgm_port}"],
            },
        ) as run:
            _wait(
                "the second node was never scraped",
                lambda: get_json(
                    f"{run.api}/query", query=f'up{{instance="127.0.0.1:{late_port}"}} == 1'
                )["data"]["result"],
                30,
                run.log,
            )
            late_scraped.set()
            _wait(
                "the demo stopped no container",
                lambda: get_json(f"{run.api}/query", query="gpuguard_kills_total > 0")["data"][
                    "result"
                ],
                DEMO_SECONDS + 30,
                run.log,
            )
            rc = run.demo.wait(60)
            assert rc == 0, run.demo_log.read_text()[-3000:]
            end = _wait(
                "no failed scrape after the demo exited",
                lambda: _last_scrape(run.api, start, f"127.0.0.1:{metrics_port}"),
                20,
                run.log,
            )
            yield Run(api=run.api, start=start, end=end)


def _series(run: Run, query: Query) -> list[dict[str, Any]]:
    expr = substitute(query.expr)
    if query.instant:
        answer = get_json(f"{run.api}/query", query=expr, time=str(run.end))
    else:
        answer = get_json(
            f"{run.api}/query_range", query=expr, start=str(run.start), end=str(run.end), step="1"
        )
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def test_every_panel_query_parses_and_returns_data_on_a_real_prometheus(
    validator: Path, demo_run: Run
) -> None:
    listed = queries(validator)
    assert len(listed) > 20, listed
    problems = []
    for query in listed:
        try:
            series = _series(demo_run, query)
        except OSError as exc:  # a 400 (bad_data: the query does not parse) is an HTTPError
            body = exc.read().decode() if hasattr(exc, "read") else ""
            problems.append(f"{query.title}: {substitute(query.expr)}: {exc} {body}")
            continue
        if not series and query.title not in EMPTY:
            problems.append(f"{query.title}: no data: {substitute(query.expr)}")
    assert not problems, "\n".join(problems)
    assert set(EMPTY) <= {q.title for q in listed}, "EMPTY names a panel the dashboard lacks"


def test_the_agent_panels_show_the_a100_nodes_labels(demo_run: Run) -> None:
    # Act two's A100 node ends with rule a100-mig (slice-2, all-1g.10gb) and waited for its
    # training pod: the real recorder's series say so, not the simulated one's.
    info = get_json(
        f"{demo_run.api}/query",
        query='gpuguard_sharing_labels_info{node!="gpu-t4-1"}',  # not late_events' node
        time=str(demo_run.end),
    )["data"]["result"]
    assert [s["metric"] for s in info] == [
        {
            "__name__": "gpuguard_sharing_labels_info",
            "instance": info[0]["metric"]["instance"],
            "job": "gpuguard",
            "node": "gpu-a100-1",
            "rule": "a100-mig",
            "device_plugin_config": "slice-2",
            "mig_config": "all-1g.10gb",
        }
    ], info
    waited = get_json(
        f"{demo_run.api}/query",
        query=(
            'max_over_time(gpuguard_sharing_waiting{reason="gpu_pods",'
            f'instance="{info[0]["metric"]["instance"]}"}}[5m])'
        ),
        time=str(demo_run.end),
    )["data"]["result"]
    assert [s["value"][1] for s in waited] == ["1"], waited


def test_a_query_that_does_not_parse_is_reported_not_taken_for_empty(demo_run: Run) -> None:
    # What the panel test relies on: Prometheus answers a query it cannot parse with a 400
    # (bad_data), which urllib raises, never with an empty success.
    broken = Query(
        panel=1, title="broken", expr="sum by (UUID (gpuguard_kills_total)", instant=False
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        _series(demo_run, broken)
    assert raised.value.code == 400
    assert json.loads(raised.value.read())["errorType"] == "bad_data"
