"""The observability chain for real: ``gpuguard enforce`` over the NVML stand-in
stops a greedy pod; a real Prometheus 3.16 scrapes it with the shipped rules
(``helm/gpuguard/files/alerts.yaml``, loaded unchanged); GPUGuardContainerKilled fires and a real
Alertmanager 0.25 delivers it to a webhook this test serves; the delivered alert names the pod.
The chart's opt-in GPUGuardUnboundedGPUMemory, rendered by the real ``helm template``
(``tests/chart_rules.py``) and loaded as rendered, fires the same way for memory nothing bounds
and names the GPU and the bytes, while memory an annotation bounds stays silent.

Owns: a Prometheus (``scripts/ensure-prometheus.sh``) and an Alertmanager
(``scripts/ensure-alertmanager.sh``) per test, each on 127.0.0.1 only with its state in the
test's temporary directory, started and stopped by PID (also when the test fails), and the
webhook receiver (``http.server`` in a thread). Scrape and rule evaluation every second, the
Alertmanager's group_wait 0 s: what remains is the chain's own latency.

Must not: edit or shorten the shipped rules (the kill alert has no ``for:`` and its windows
hold hundreds of 1 s samples, so the file is loaded as it ships) or what helm renders (only the
chart's values choose the unbounded alert's threshold and ``for:``), or listen beyond loopback.
A missing tool skips locally and fails in CI (``rigs.prereq.require``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigs.controlplane import free_port, terminate, wait_until
from rigs.node import GIB, GPU_UUID, PodInfo, Rig
from tests.chart_rules import helm_tool, rendered_groups
from tests.promtools import ALERTMANAGER, get_json, tool

pytestmark = [
    pytest.mark.apiserver,
    pytest.mark.kernel,
    pytest.mark.nvml_stub,
    pytest.mark.tools,
]

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "helm" / "gpuguard" / "files" / "alerts.yaml"
KILL_ALERT = "GPUGuardContainerKilled"
JOB = "gpuguard"
"""The scrape job: the rules' health alerts match ``job=~".*gpuguard.*"``."""


# ---------------------------------------------------------------------------------------------
# The tools, from their ensure scripts (cached; a warm call costs a few --version runs)


@pytest.fixture
def prometheus_bin() -> Path:
    return tool("prometheus")


@pytest.fixture
def alertmanager_bin() -> Path:
    return tool("alertmanager", ALERTMANAGER)


# ---------------------------------------------------------------------------------------------
# Processes and HTTP


@dataclass(slots=True, kw_only=True)
class Server:
    """A tool this test started on ``127.0.0.1:port``; stopped by its PID."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, **query: str) -> Any:
        """GET a JSON API path; the decoded body."""
        return get_json(self.url(path), **query)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}")
        try:
            with urllib.request.urlopen(self.url("/-/ready"), timeout=2) as r:
                return int(r.status) == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> int:
        terminate(self.proc, timeout)
        return int(self.proc.returncode)


def start_server(name: str, argv: list[str], *, port: int, workdir: Path) -> Server:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(name=name, proc=proc, port=port, log_path=log_path)


@dataclass(slots=True)
class Webhook:
    """Alertmanager's webhook receiver: every POSTed notification, with when it arrived."""

    deliveries: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def alerts(self) -> list[tuple[float, dict[str, Any]]]:
        """Every alert delivered so far, with its notification's arrival (wall time)."""
        with self.lock:
            return [(at, alert) for at, doc in self.deliveries for alert in doc.get("alerts", [])]


@contextlib.contextmanager
def webhook_server() -> Iterator[tuple[Webhook, int]]:
    hook = Webhook()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            arrived = time.time()
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with hook.lock:
                hook.deliveries.append((arrived, json.loads(body)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # pytest's output stays readable; deliveries are in ``hook``

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="test-webhook", daemon=True)
    thread.start()
    try:
        yield hook, int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# The chain


@dataclass(slots=True, kw_only=True)
class Chain:
    prometheus: Server
    alertmanager: Server
    webhook: Webhook


def start_chain(
    stack: contextlib.ExitStack,
    *,
    prometheus_bin: Path,
    alertmanager_bin: Path,
    metrics_port: int,
    workdir: Path,
    rules: Path = RULES,
) -> Chain:
    """Webhook ← Alertmanager ← Prometheus (evaluating ``rules``) → the enforcer at
    ``metrics_port``; every piece is stopped when ``stack`` closes."""
    hook, hook_port = stack.enter_context(webhook_server())

    am_port = free_port()
    am_dir = workdir / "alertmanager"
    am_dir.mkdir()
    am_config = am_dir / "alertmanager.yml"
    am_config.write_text(
        yaml.safe_dump(
            {
                "route": {
                    "receiver": "webhook",
                    "group_by": ["..."],  # one notification per alert: each names its pod
                    "group_wait": "0s",
                    "group_interval": "1s",
                    "repeat_interval": "1h",
                },
                "receivers": [
                    {
                        "name": "webhook",
                        "webhook_configs": [
                            {"url": f"http://127.0.0.1:{hook_port}/", "send_resolved": True}
                        ],
                    }
                ],
            }
        )
    )
    alertmanager = start_server(
        "alertmanager",
        [
            str(alertmanager_bin),
            f"--config.file={am_config}",
            f"--storage.path={am_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{am_port}",
            "--cluster.listen-address=",  # no gossip: a single instance, nothing on 0.0.0.0
            "--log.level=debug",
        ],
        port=am_port,
        workdir=am_dir,
    )
    stack.callback(_stop_and_show, alertmanager)

    prom_port = free_port()
    prom_dir = workdir / "prometheus"
    prom_dir.mkdir()
    prom_config = prom_dir / "prometheus.yml"
    prom_config.write_text(
        yaml.safe_dump(
            {
                "global": {
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "evaluation_interval": "1s",
                },
                "rule_files": [str(rules)],  # a file as it ships or as helm renders it
                "alerting": {
                    "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
                },
                "scrape_configs": [
                    {
                        "job_name": JOB,
                        # The chart's ServiceMonitor default: the per-pod series keep the
                        # workload's namespace/pod/container (docs/alerts.md).
                        "honor_labels": True,
                        "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                    }
                ],
            }
        )
    )
    prometheus = start_server(
        "prometheus",
        [
            str(prometheus_bin),
            f"--config.file={prom_config}",
            f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=debug",
        ],
        port=prom_port,
        workdir=prom_dir,
    )
    stack.callback(_stop_and_show, prometheus)

    wait_until(alertmanager.ready, timeout=30, interval=0.1, what="Alertmanager ready")
    wait_until(prometheus.ready, timeout=30, interval=0.1, what="Prometheus ready")
    return Chain(prometheus=prometheus, alertmanager=alertmanager, webhook=hook)


def _stop_and_show(server: Server) -> None:
    code = server.stop()
    # Shown by pytest when the test failed: what the tool saw and did.
    print(f"--- {server.name} {server.proc.pid} exit {code}, log tail:\n{server.log()[-6000:]}")


def query(prometheus: Server, promql: str) -> list[dict[str, Any]]:
    doc = prometheus.get("/api/v1/query", query=promql)
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


def names_pod(labels: dict[str, str], pod: PodInfo) -> bool:
    return labels.get("namespace") == pod.namespace and labels.get("pod") == pod.name


# ---------------------------------------------------------------------------------------------


def test_a_kill_reaches_alertmanagers_webhook_naming_the_pod_and_its_gpu(
    rig: Rig, prometheus_bin: Path, alertmanager_bin: Path, tmp_path: Path
) -> None:
    greedy = rig.add_pod("greedy", limit="1Gi")
    modest = rig.add_pod("modest", limit="4Gi")
    hog = rig.spawn(greedy, "hog", used_bytes=GIB // 2)  # under its limit until told otherwise
    calm = rig.spawn(modest, "calm", used_bytes=1 * GIB)
    # A 5 s grace: at 1 s scrapes, Prometheus sees the pod above its limit before the kill,
    # which is what lets the alert name it. A kill within one scrape interval (the pressure
    # path) names only the node (docs/alerts.md#gpuguardcontainerkilled). 5 s, not 3: at 3 s, one
    # run in ~25 on a loaded 2-core machine delivered the alert without the pod's labels
    # (likely scrapes timing out; the assertion on `seen` below now says which).
    enforcer = rig.start_enforcer(grace_seconds=5.0)
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")

    with contextlib.ExitStack() as stack:
        chain = start_chain(
            stack,
            prometheus_bin=prometheus_bin,
            alertmanager_bin=alertmanager_bin,
            metrics_port=enforcer.metrics_port,
            workdir=tmp_path,
        )
        prom = chain.prometheus

        def kill_rule() -> dict[str, Any]:
            groups = prom.get("/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert not [r for r in rules if r["health"] == "err"], rules
            found: dict[str, Any] = next(r for r in rules if r["name"] == KILL_ALERT)
            return found

        wait_until(
            lambda: kill_rule()["health"] == "ok",
            timeout=20,
            what="the shipped rules loaded and the kill alert evaluated",
        )
        assert kill_rule()["duration"] == 0, "no `for:`: it fires on the first evaluation"
        wait_until(
            lambda: prom.get("/api/v1/alertmanagers")["data"]["activeAlertmanagers"],
            timeout=20,
            what="Prometheus to know its Alertmanager",
        )
        wait_until(
            lambda: query(prom, f'gpuguard_pod_gpu_memory_used_bytes{{pod="{greedy.name}"}}'),
            timeout=20,
            what="Prometheus to scrape the greedy pod's usage",
        )
        assert query(prom, "gpuguard_kills_total") != [], "the counter exists (at 0) before a kill"
        assert chain.webhook.alerts() == [], "nothing fires before the kill"

        rig.set_usage(hog, 2 * GIB)  # over its 1 GiB limit: SIGTERM after the grace
        wait_until(lambda: not hog.alive(), timeout=30, what="the greedy pod's process to stop")
        signalled = enforcer.wait_for("container_signalled", pod=greedy.name, signal="SIGTERM")
        killed_at = datetime.fromisoformat(signalled["timestamp"]).timestamp()

        def delivered() -> list[tuple[float, dict[str, Any]]]:
            return [
                (at, a)
                for at, a in chain.webhook.alerts()
                if a["labels"].get("alertname") == KILL_ALERT and a["status"] == "firing"
            ]

        wait_until(delivered, timeout=60, interval=0.02, what=f"{KILL_ALERT} at the webhook")
        arrived_at, alert = delivered()[0]
        latency = arrived_at - killed_at
        print(f"kill -> webhook delivery: {latency:.2f} s")

        # The rule can name the pod only if a scrape saw it above its limit: say so if none did.
        seen = query(prom, f'gpuguard_pod_gpu_memory_used_bytes{{pod="{greedy.name}"}}[1m]')
        scrapes = query(prom, "scrape_duration_seconds[1m]")
        assert [v for s in seen for _, v in s["values"] if int(v) > GIB], (
            f"no scrape saw {greedy.name} above its limit before the kill at {killed_at}: "
            f"{seen}; scrapes: {scrapes}"
        )
        labels = alert["labels"]
        print(f"delivered: {json.dumps(chain.webhook.alerts())}")
        assert {k: labels.get(k) for k in ("namespace", "pod", "pod_uid", "container")} == {
            "namespace": greedy.namespace,
            "pod": greedy.name,
            "pod_uid": greedy.uid,
            "container": "main",
        }, f"delivered: {chain.webhook.alerts()}"
        assert (labels.get("gpu"), labels.get("UUID"), labels.get("hostname")) == (
            "0",
            GPU_UUID,
            rig.node,
        )
        assert labels.get("severity") == "warning"
        assert labels.get("job") == JOB
        assert alert["annotations"]["summary"] == (
            f"gpuguard stopped a container of {greedy.namespace}/{greedy.name} "
            f"on GPU 0 of {rig.node}"
        )
        assert alert["annotations"]["runbook_url"] == "docs/alerts.md#gpuguardcontainerkilled"
        assert 0 < latency < 20, f"kill -> delivery took {latency:.2f} s (expected ~2 s)"

        time.sleep(3.0)  # three more evaluations and group intervals: anything else would show
        kills = [a for _, a in delivered()]
        assert {(a["labels"].get("namespace"), a["labels"].get("pod")) for a in kills} == {
            (greedy.namespace, greedy.name)
        }, "one enforcer, one pod named: the node-only branches stay silent"
        assert not [a for _, a in chain.webhook.alerts() if names_pod(a["labels"], modest)]
        active = prom.get("/api/v1/alerts")["data"]["alerts"]
        assert not [a for a in active if names_pod(a["labels"], modest)]
        assert calm.received() == []
        assert calm.alive()


# ---------------------------------------------------------------------------------------------
# GPUGuardUnboundedGPUMemory: the chart's opt-in alert, as helm renders it


UNBOUNDED_ALERT = "GPUGuardUnboundedGPUMemory"
UNBOUNDED_FOR_SECONDS = 2
"""The rendered rule's ``for:`` (the values schema takes any Prometheus duration): long enough
to prove the rule holds the alert pending, short enough for a test."""


def render_unbounded_rules(workdir: Path) -> Path:
    """The chart's PrometheusRule groups, rendered by the real ``helm template`` with the
    alert on at a 1 GiB threshold, written as a Prometheus rules file without any change."""
    groups = rendered_groups(
        helm_tool(workdir / "helm-home"),
        workdir,
        {"thresholdBytes": GIB, "for": f"{UNBOUNDED_FOR_SECONDS}s"},
    )
    path = workdir / "rendered-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def alert_rule(prometheus: Server, name: str) -> dict[str, Any]:
    """The loaded alerting rule ``name``, after checking that no rule failed to evaluate."""
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert not [r for r in rules if r["health"] == "err"], rules
    found: dict[str, Any] = next(r for r in rules if r["name"] == name)
    return found


def instant(stamp: str) -> float:
    """Prometheus's and Alertmanager's RFC 3339 times (nanoseconds, ``Z``) as epoch seconds."""
    return datetime.fromisoformat(stamp).timestamp()


def device_memory(prometheus: Server) -> dict[str, int]:
    """GPU 0's memory by ``bound_by``, as Prometheus last scraped it."""
    found = query(prometheus, 'gpuguard_gpu_memory_bound_bytes{gpu="0"}')
    return {s["metric"]["bound_by"]: int(float(s["value"][1])) for s in found}


def wait_for_memory(prometheus: Server, expected: dict[str, int], timeout: float = 20) -> None:
    """Wait, at most ``timeout`` s, until Prometheus has scraped GPU 0's memory by
    ``bound_by`` as ``expected``; else fail saying what it scraped."""
    deadline = time.monotonic() + timeout
    scraped: dict[str, int] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, KeyError, ValueError):
            scraped = device_memory(prometheus)
            if expected.items() <= scraped.items():
                return
        time.sleep(0.1)
    pytest.fail(
        f"Prometheus did not scrape GPU 0's memory as {expected} (bytes by bound_by) within "
        f"{timeout} s; last scraped: {scraped}"
    )


def _check_delivery(chain: Chain, rig: Rig, raised_at: float) -> None:
    """Wait, at most 60 s, for the unbounded alert at the webhook; then check that it names
    GPU 0 of the node and the unbounded pod's 2 GiB alone, after the rule's ``for:``."""
    prom = chain.prometheus

    def delivered() -> list[tuple[float, dict[str, Any]]]:
        return [
            (at, a)
            for at, a in chain.webhook.alerts()
            if a["labels"].get("alertname") == UNBOUNDED_ALERT and a["status"] == "firing"
        ]

    deadline = time.monotonic() + 60
    while not delivered() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not delivered():
        pytest.fail(
            f"{UNBOUNDED_ALERT} did not reach the webhook within 60 s of the unbounded pod "
            f"holding 2 GiB; Prometheus scraped GPU 0 as {device_memory(prom)} (bytes by "
            f"bound_by); the rule: {alert_rule(prom, UNBOUNDED_ALERT)}"
        )
    arrived_at, alert = delivered()[0]
    print(f"unbounded 2 GiB -> webhook delivery: {arrived_at - raised_at:.2f} s")
    labels = alert["labels"]
    assert {k: labels.get(k) for k in ("gpu", "UUID", "hostname", "bound_by", "severity")} == {
        "gpu": "0",
        "UUID": GPU_UUID,
        "hostname": rig.node,
        "bound_by": "none",
        "severity": "warning",
    }, f"delivered: {chain.webhook.alerts()}"
    assert alert["annotations"] == {
        "summary": f"2GiB of GPU memory on GPU 0 of {rig.node} is bounded by no limit",
        "description": (
            "Pods that nothing bounds (no limit from any source gpuguard reads, or exempt) have"
            f" held 2GiB on GPU 0 ({GPU_UUID}) of node {rig.node}, more than {GIB} bytes, for"
            f" {UNBOUNDED_FOR_SECONDS}s. gpuguard never stops a process for this memory;"
            " gpuguard_pods_unbounded counts the pods."
        ),
        "runbook_url": "docs/alerts.md#gpuguardunboundedgpumemory",
    }
    (firing,) = [
        a
        for a in prom.get("/api/v1/alerts")["data"]["alerts"]
        if a["labels"].get("alertname") == UNBOUNDED_ALERT
    ]
    assert float(firing["value"]) == 2 * GIB, "the bounded pod's 4 GiB is not in the value"
    held_for = instant(alert["startsAt"]) - instant(firing["activeAt"])
    print(f"pending -> firing: {held_for:.2f} s")
    assert held_for >= UNBOUNDED_FOR_SECONDS - 1e-3, "fired before its for:"
    (pods,) = query(prom, 'gpuguard_pods_unbounded{gpu="0"}')
    assert pods["value"][1] == "1"
    assert 0 < arrived_at - raised_at < 20


def test_unbounded_gpu_memory_reaches_alertmanagers_webhook_naming_the_gpu_and_the_bytes(
    rig: Rig, prometheus_bin: Path, alertmanager_bin: Path, tmp_path: Path
) -> None:
    """The enforcer runs with no default limit; pod ``bounded`` (annotated 8Gi) holds 4 GiB and
    pod ``free`` (nothing bounds it) 0.5 GiB on GPU 0. The chart's rule (threshold 1 GiB, ``for:
    2s``) stays silent for more than its ``for:``: only bound memory is above the threshold.
    ``free`` then holds 2 GiB: the alert fires after its ``for:`` and reaches the webhook naming
    GPU 0 (gpu, UUID, hostname) and 2GiB.

    What fails it, each tried by hand: ``bound_by`` always ``annotation`` (the enforcer no
    longer tells unbounded memory apart) or always ``none`` (bound memory counted as unbounded)
    fails the bounded wait for Prometheus to scrape 4 GiB ``annotation`` and 0.5 GiB ``none``,
    showing what it scraped; with the rendered rule's selector wrong nothing fires and the
    60 s wait for the delivery fails, showing the scrape and the rule; a rule that counted bound
    memory goes pending in the first phase; one without its ``for:`` fails the duration and the
    pending time checks; counting both pods as unbounded would say 6GiB, not 2GiB."""
    rules = render_unbounded_rules(tmp_path)
    free = rig.add_pod("free")
    bounded = rig.add_pod("bounded", limit="8Gi")
    held = rig.spawn(bounded, "held", used_bytes=4 * GIB)
    loose = rig.spawn(free, "loose", used_bytes=GIB // 2)
    enforcer = rig.start_enforcer()
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")

    with contextlib.ExitStack() as stack:
        chain = start_chain(
            stack,
            prometheus_bin=prometheus_bin,
            alertmanager_bin=alertmanager_bin,
            metrics_port=enforcer.metrics_port,
            workdir=tmp_path,
            rules=rules,
        )
        prom = chain.prometheus
        wait_until(
            lambda: alert_rule(prom, UNBOUNDED_ALERT)["health"] == "ok",
            timeout=20,
            what=f"the rendered rules loaded and {UNBOUNDED_ALERT} evaluated",
        )
        assert alert_rule(prom, UNBOUNDED_ALERT)["duration"] == UNBOUNDED_FOR_SECONDS
        wait_until(
            lambda: prom.get("/api/v1/alertmanagers")["data"]["activeAlertmanagers"],
            timeout=20,
            what="Prometheus to know its Alertmanager",
        )
        wait_for_memory(prom, {"annotation": 4 * GIB, "none": GIB // 2})
        seen_at = time.time()
        # Several evaluations past the `for:` over bounded memory above the threshold.
        quiet = seen_at + UNBOUNDED_FOR_SECONDS + 3
        wait_until(
            lambda: instant(alert_rule(prom, UNBOUNDED_ALERT)["lastEvaluation"]) > quiet,
            timeout=30,
            what="the rule to evaluate for 5 s over the bounded pod's memory",
        )
        ever = query(prom, f'count_over_time(ALERTS{{alertname="{UNBOUNDED_ALERT}"}}[5m])')
        assert ever == [], f"bound memory made it pending or firing: {ever}"

        rig.set_usage(loose, 2 * GIB)
        raised_at = time.time()
        _check_delivery(chain, rig, raised_at)
        # No limit was broken: the enforcer signals neither pod.
        assert (held.received(), loose.received()) == ([], [])
        assert (held.alive(), loose.alive()) == (True, True)
