"""``gpuguard demo``: the real enforcement pipeline on a simulated node (DESIGN §5.2).

Owns the demo scenario, its live view and its summary. Runs the real core, runtime and metrics
over ``gpuguard.sim``: no root, no GPU, no cluster. Exit 0 only if the scenario's expectations
held: the offender was stopped within grace + 2 polls of crossing its limit, and nobody else was
signalled.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from dataclasses import dataclass, field
from typing import TextIO

import structlog
from prometheus_client import CollectorRegistry
from rich.console import RenderableType

from gpuguard.app import build_telemetry
from gpuguard.core.model import (
    ContainerId,
    EnforcementPolicy,
    KillTarget,
    LimitPolicy,
    LimitValue,
    Mode,
    NamespacePolicy,
    PodEvent,
    SignalReport,
    StopSignal,
)
from gpuguard.core.policy import Decision, UsageState
from gpuguard.runtime.clock import SystemClock
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.sim import GiB, SimNode, SimProcess, ramp, sim_gpu, sim_pod, steady

log = structlog.get_logger("gpuguard.demo")

POLL_SECONDS = 0.25
GRACE_SECONDS = 2.0
TERM_TIMEOUT_SECONDS = 3.0
STALENESS_SECONDS = 5.0
# Scheduling slack on top of "grace + 2 polls": a loaded CI machine delays a cycle a little.
SLACK_SECONDS = 0.25

GREEDY_LIMIT = 20 * GiB
GREEDY_FROM, GREEDY_TO = 8 * GiB, 30 * GiB
GREEDY_RAMP = (3.0, 9.0)
GREEDY_CONTAINER = ContainerId("a" * 64)
GREEDY_UID = "0b6a4f0e-1c2d-4e3f-8a9b-0c1d2e3f4a5b"


@dataclass(slots=True, kw_only=True)
class _Scenario:
    node: SimNode
    greedy_pid: int
    protected: dict[int, str]
    """PID → who must survive (neighbour, default-limited pod, exempt pod, host process)."""

    def crossing_at(self) -> float:
        """Seconds after start when the greedy pod's usage first exceeds its limit."""
        start, end = GREEDY_RAMP
        frac = (GREEDY_LIMIT - GREEDY_FROM) / (GREEDY_TO - GREEDY_FROM)
        return start + (end - start) * frac


def build_scenario(clock: SystemClock) -> _Scenario:
    """Two GPUs; a greedy pod and its neighbour on GPU 0; three more tenants on GPU 1."""
    node = SimNode(clock=clock, node_name="demo-node", gpus=[sim_gpu(0), sim_gpu(1)])
    pods = [
        sim_pod(
            GREEDY_UID,
            "ml-team",
            "trainer-greedy",
            containers={GREEDY_CONTAINER: "trainer"},
            limit="20Gi",
        ),
        sim_pod(
            "1c7b5f1f-2d3e-4f40-9bac-1d2e3f4a5b6c",
            "ml-team",
            "notebook-neighbour",
            containers={"b" * 64: "jupyter"},
            limit="16Gi",
        ),
        sim_pod(
            "2d8c6020-3e4f-4051-acbd-2e3f4a5b6c7d",
            "research",
            "inference-default",
            containers={"c" * 64: "server"},
        ),
        sim_pod(
            "3e9d7131-4f50-4162-bdce-3f4a5b6c7d8e",
            "platform",
            "exempt-benchmark",
            containers={"d" * 64: "bench"},
            limit="4Gi",
        ),
    ]
    for pod in pods:
        node.add_pod(pod)
    node.add_process(
        SimProcess(
            pid=41001,
            start_ticks=9001,
            gpu=0,
            pod_uid=pods[0].uid,
            container_id=GREEDY_CONTAINER,
            usage=ramp(GREEDY_FROM, GREEDY_TO, from_s=GREEDY_RAMP[0], to_s=GREEDY_RAMP[1]),
        )
    )
    node.add_process(
        SimProcess(
            pid=41002,
            start_ticks=9002,
            gpu=0,
            pod_uid=pods[1].uid,
            container_id=ContainerId("b" * 64),
            usage=steady(10 * GiB),
        )
    )
    node.add_process(
        SimProcess(
            pid=41003,
            start_ticks=9003,
            gpu=1,
            pod_uid=pods[2].uid,
            container_id=ContainerId("c" * 64),
            usage=steady(12 * GiB),
        )
    )
    node.add_process(
        SimProcess(
            pid=41004,
            start_ticks=9004,
            gpu=1,
            pod_uid=pods[3].uid,
            container_id=ContainerId("d" * 64),
            usage=steady(12 * GiB),
        )
    )
    node.add_process(SimProcess(pid=2187, start_ticks=120, gpu=1, usage=steady(6 * GiB)))
    return _Scenario(
        node=node,
        greedy_pid=41001,
        protected={
            41002: "ml-team/notebook-neighbour (within its limit)",
            41003: "research/inference-default (namespace default)",
            41004: "platform/exempt-benchmark (exempt namespace)",
            2187: "host process without a pod",
        },
    )


def demo_policy() -> EnforcementPolicy:
    """Enforce mode; ``research`` has a namespace default; ``platform`` is exempt."""
    return EnforcementPolicy(
        mode=Mode.ENFORCE,
        grace_seconds=GRACE_SECONDS,
        termination_timeout_seconds=TERM_TIMEOUT_SECONDS,
        staleness_seconds=STALENESS_SECONDS,
        limits=LimitPolicy(
            namespaces={
                "research": NamespacePolicy(default_limit=LimitValue(limit_bytes=24 * GiB))
            },
            exempt_namespaces=frozenset({"kube-system", "platform"}),
        ),
    )


@dataclass(slots=True)
class _Feed:
    """What the live view shows besides the table."""

    lines: list[str] = field(default_factory=list)

    def add(self, t: float, text: str) -> None:
        self.lines.append(f"[{t:5.2f}s] {text}")
        del self.lines[:-8]


class _DemoKiller:
    """The simulated node's killer, narrated in the live view as each signal goes out."""

    def __init__(self, node: SimNode, feed: _Feed) -> None:
        self._node = node
        self._feed = feed
        self.stopped: dict[str, str] = {}
        """pod (namespace/name) → the last signal it received."""

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        report = self._node.signal_container(target, signal, wait_seconds=wait_seconds)
        if report.delivered:
            who = f"{target.pod.namespace}/{target.pod.name}"
            self.stopped[who] = signal.value
            self._feed.add(
                self._node.elapsed(),
                f"{signal.value} → {who} container {target.container_name} "
                f"({_gib(target.used_bytes).strip()} > {_gib(target.limit_bytes).strip()})",
            )
        return report


class _EventLog:
    """EventSink for the demo: keeps the Events and logs them as the real sink would."""

    def __init__(self, node: SimNode, feed: _Feed) -> None:
        self._node = node
        self._feed = feed

    def post(self, event: PodEvent) -> None:
        self._node.post(event)
        self._feed.add(
            self._node.elapsed(),
            f"Event {event.reason.value} on {event.pod.namespace}/{event.pod.name}",
        )
        log.info(
            "event_posted",
            reason=event.reason.value,
            namespace=event.pod.namespace,
            pod=event.pod.name,
            message=event.message,
        )


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:5.1f} GiB"


def _table(
    decision: Decision | None,
    elapsed: float,
    duration: float,
    feed: _Feed,
    stopped: dict[str, str],
) -> RenderableType:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    table = Table(
        title=f"gpuguard demo — simulated node, t={elapsed:4.1f}s / {duration:.0f}s", expand=True
    )
    for col in ("pod", "GPU", "used", "limit", "source", "state"):
        table.add_column(col)
    styles = {
        UsageState.OK: "green",
        UsageState.OVER: "bold red",
        UsageState.STOPPING: "bold yellow",
        UsageState.EXEMPT: "cyan",
    }
    if decision is not None:
        for u in sorted(decision.usages, key=lambda u: (u.device.index, u.pod.namespace)):
            style = styles.get(u.state, "")
            table.add_row(
                f"{u.pod.namespace}/{u.pod.name}",
                str(u.device.index),
                _gib(u.used_bytes),
                _gib(u.limit.limit_bytes),
                u.limit.source.value if u.limit.source else "-",
                f"[{style}]{u.state.value}[/]" if style else u.state.value,
            )
        shown = {f"{u.pod.namespace}/{u.pod.name}" for u in decision.usages}
        for who, sig in stopped.items():
            if who not in shown:
                table.add_row(who, "-", "-", "-", "-", f"[bold yellow]stopped ({sig})[/]")
        for key, n in sorted(decision.unattributed_bytes.items(), key=lambda kv: kv[0].uuid):
            if n:
                idx = next((d.index for d in decision.devices if d.key == key), "?")
                table.add_row(
                    "[dim](no pod: host / unattributed)[/]",
                    str(idx),
                    _gib(n),
                    "-",
                    "-",
                    "[dim]never signalled[/]",
                )
    return Group(table, Panel("\n".join(feed.lines) or "watching…", title="actions"))


async def _run(duration: float, *, live: bool, metrics_port: int | None, out: TextIO) -> int:
    clock = SystemClock()
    scenario = build_scenario(clock)
    node = scenario.node
    feed = _Feed()
    telemetry = build_telemetry(hostname="demo-node")
    recorder, collector = telemetry.recorder, telemetry.collector
    server = None
    if metrics_port is not None:
        server = telemetry.server(host="127.0.0.1", port=metrics_port)
        server.start()
        log.info("metrics_serving", url=f"http://127.0.0.1:{server.port}/metrics")
    killer = _DemoKiller(node, feed)
    enforcer = Enforcer(
        gpu=node,
        resolver=node,
        pods=node,
        killer=killer,
        events=_EventLog(node, feed),
        recorder=recorder,
        publisher=collector,
        clock=clock,
        policy=demo_policy(),
        poll_interval_seconds=POLL_SECONDS,
    )
    log.info(
        "demo_started",
        duration_seconds=duration,
        poll_seconds=POLL_SECONDS,
        grace_seconds=GRACE_SECONDS,
        gpus=2,
        pods=len(node.pods()),
    )
    decision: Decision | None = None
    view = None
    if live:
        from rich.console import Console
        from rich.live import Live

        view = Live(console=Console(file=out), refresh_per_second=8, transient=False)
        view.start()
    try:
        t_end = clock.monotonic() + duration
        while clock.monotonic() < t_end:
            started = clock.monotonic()
            decision = await enforcer.cycle()
            if view is not None:
                view.update(_table(decision, node.elapsed(), duration, feed, killer.stopped))
            await asyncio.sleep(max(0.0, POLL_SECONDS - (clock.monotonic() - started)))
    finally:
        if view is not None:
            view.stop()
        if server is not None:
            server.stop()
    return _summarize(scenario, telemetry.registry, live=live, out=out)


def _summarize(scenario: _Scenario, registry: CollectorRegistry, *, live: bool, out: TextIO) -> int:
    node = scenario.node
    greedy = node.process(scenario.greedy_pid)
    first_signal = next((s for s in node.signals if s.pid == scenario.greedy_pid), None)
    wrong = [s for s in node.signals if s.container_id != GREEDY_CONTAINER]
    crossing = scenario.crossing_at()
    budget = GRACE_SECONDS + 2 * POLL_SECONDS
    latency = None if first_signal is None else first_signal.at - crossing
    kills = int(registry.get_sample_value("gpuguard_kills_total") or 0)
    survivors_ok = all(node.process(pid).alive for pid in scenario.protected)
    checks = {
        "offender_stopped": first_signal is not None and not greedy.alive,
        "within_grace_plus_two_polls": latency is not None and latency <= budget + SLACK_SECONDS,
        "nobody_else_signalled": not wrong,
        "protected_processes_alive": survivors_ok,
    }
    ok = all(checks.values())
    summary = {
        "kills": kills,
        "wrong_kills": len(wrong),
        "signals": [
            {"pid": s.pid, "signal": s.signal.value, "at_seconds": round(s.at, 3)}
            for s in node.signals
        ],
        "crossing_at_seconds": round(crossing, 3),
        "first_signal_at_seconds": None if first_signal is None else round(first_signal.at, 3),
        "crossing_to_signal_seconds": None if latency is None else round(latency, 3),
        "budget_seconds": budget,
        "events": [f"{e.reason.value} {e.pod.namespace}/{e.pod.name}" for e in node.events],
        "checks": checks,
        "passed": ok,
    }
    if live:
        verdict = "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"
        from rich.console import Console

        console = Console(file=out)
        console.print(f"\n{verdict}  kills={kills} wrong_kills={len(wrong)}")
        if latency is not None:
            console.print(
                f"offender crossed its limit at {crossing:.2f}s, first SIGTERM "
                f"{latency:.2f}s later (budget: grace {GRACE_SECONDS}s + 2 polls = "
                f"{budget:.2f}s)"
            )
        for pid, who in scenario.protected.items():
            alive = node.process(pid).alive
            console.print(f"  {'✓' if alive else '✗'} {who}: {'alive' if alive else 'KILLED'}")
        for name, passed in checks.items():
            console.print(f"  {'✓' if passed else '✗'} {name}")
    log.info("demo_summary", **summary)
    return 0 if ok else 1


def run_demo(
    *, duration: float, as_json: bool, metrics_port: int | None, out: TextIO | None = None
) -> int:
    """Entry point for ``gpuguard demo``. Returns the exit code."""
    from gpuguard import logs

    stream = out if out is not None else sys.stdout
    if as_json:
        logs.configure(level="info", json=True, stream=stream)
    else:
        logs.configure(level="error", json=False, stream=sys.stderr)
    if metrics_port is not None and metrics_port != 0:
        _check_port(metrics_port)
    live = not as_json
    return asyncio.run(_run(duration, live=live, metrics_port=metrics_port, out=stream))


def _check_port(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            from gpuguard.errors import PermanentError

            raise PermanentError(
                f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror}); "
                "pick a free port or 0 for any"
            ) from exc


__all__ = ["run_demo"]
