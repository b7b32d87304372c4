"""``gpuguard demo`` as a command: sets up logging and the metrics server, plays act one then
act two (live tables unless ``--json``), judges them and logs the ``demo_summary`` event; the exit
code is the verdict's."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from typing import TextIO

import structlog

from gpuguard.app import Telemetry, build_clock, build_telemetry
from gpuguard.commands.demo import enforcer_act, sharing_act
from gpuguard.commands.demo.enforcer_act import Seen, build_enforcer
from gpuguard.commands.demo.narration import Feed
from gpuguard.commands.demo.scenario import (
    A100_NODE,
    AGENT_INTERVAL_SECONDS,
    GRACE_SECONDS,
    POLL_SECONDS,
    Scenario,
    build_cluster,
    build_scenario,
)
from gpuguard.commands.demo.sharing_act import SharingAct
from gpuguard.commands.demo.verdict import judge
from gpuguard.commands.demo.view import cluster_table, live_view, node_table, print_verdict
from gpuguard.ports import AgentRecorder, Clock
from gpuguard.runtime.enforcer import Enforcer

log = structlog.get_logger("gpuguard.demo")


async def _run(duration: float, *, live: bool, metrics_port: int | None, out: TextIO) -> int:
    clock = build_clock()
    scenario = build_scenario(clock)
    feed = Feed()
    telemetry = build_telemetry(hostname="demo-node")
    # The A100 node's agent metrics on the same registry, from the start (every reason of the
    # error counter and the waiting gauge at 0), so a scrape sees gpuguard_sharing_* change.
    agent_metrics = telemetry.agent_recorder(node=A100_NODE)
    stop_metrics = _serve_metrics(telemetry, metrics_port)
    seen = Seen()
    enforcer = build_enforcer(
        scenario,
        feed=feed,
        seen=seen,
        recorder=telemetry.recorder,
        publisher=telemetry.collector,
        clock=clock,
    )
    log.info(
        "demo_started",
        duration_seconds=duration,
        poll_seconds=POLL_SECONDS,
        grace_seconds=GRACE_SECONDS,
        gpus=2,
        pods=len(scenario.node.pods()),
    )
    try:
        act = await _play_acts(
            scenario,
            enforcer,
            seen,
            feed,
            duration=duration,
            clock=clock,
            agent_metrics=agent_metrics,
            out=out if live else None,
        )
    finally:
        if stop_metrics is not None:
            stop_metrics()
    verdict = judge(scenario, act, seen, telemetry.registry)
    if live:
        print_verdict(verdict, scenario, act, out=out)
    log.info("demo_summary", **verdict.summary)
    return 0 if verdict.passed else 1


async def _play_acts(
    scenario: Scenario,
    enforcer: Enforcer,
    seen: Seen,
    feed: Feed,
    *,
    duration: float,
    clock: Clock,
    agent_metrics: AgentRecorder,
    out: TextIO | None,
) -> SharingAct:
    """Act one for ``duration`` seconds, then act two; each drawn live on ``out`` (``None``:
    ``--json``, nothing drawn), act one's last table left on screen above act two's."""
    node = scenario.node
    view = None if out is None else live_view(out)
    try:
        one = view
        await enforcer_act.play(
            enforcer,
            scenario,
            seen,
            duration=duration,
            clock=clock,
            on_cycle=None
            if one is None
            else lambda decision: one.update(
                node_table(decision, node.elapsed(), duration, feed, seen)
            ),
        )
        if view is not None and out is not None:
            view.stop()  # act one's last table stays on screen; act two gets its own
            view.console.line()
            view = live_view(out)
        act = _start_act_two(clock, feed, feed_time=node.elapsed, metrics=agent_metrics)
        two = view
        await sharing_act.play(
            act,
            clock=clock,
            on_tick=None if two is None else lambda: two.update(cluster_table(act)),
        )
    finally:
        if view is not None:
            view.stop()
    return act


def _serve_metrics(telemetry: Telemetry, port: int | None) -> Callable[[], None] | None:
    """With ``--metrics-port``, the enforcer's and the A100 agent's metrics, served; returns
    what stops the server."""
    if port is None:
        return None
    server = telemetry.server(host="127.0.0.1", port=port)
    server.start()
    log.info("metrics_serving", url=f"http://127.0.0.1:{server.port}/metrics")
    return server.stop


def _start_act_two(
    clock: Clock, feed: Feed, *, feed_time: Callable[[], float], metrics: AgentRecorder
) -> SharingAct:
    """Act two over the script's cluster, narrated on act one's clock; the A100 Node's agent
    also tells ``metrics``."""
    act = SharingAct(
        build_cluster(clock),
        clock=clock,
        feed=feed,
        feed_time=feed_time,
        metrics={A100_NODE: metrics},
    )
    log.info(
        "demo_sharing_started",
        at_seconds=round(act.started_at, 3),
        nodes=len(act.nodes),
        agent_interval_seconds=AGENT_INTERVAL_SECONDS,
        mig_change_policy="WhenIdle",
    )
    return act


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
