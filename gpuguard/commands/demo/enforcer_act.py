"""Act one: the real enforcer (``runtime.enforcer.Enforcer``, the real policy and metrics) over
the script's simulated node, its signals and Events narrated as they go out, and what it has seen
of each pod kept for the live table and the verdict."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from gpuguard.commands.demo.narration import Feed, gib, who
from gpuguard.commands.demo.scenario import POLL_SECONDS, Scenario, demo_policy
from gpuguard.core.model import KillTarget, PodEvent, SignalReport, StopSignal
from gpuguard.core.policy import Decision, PodUsage
from gpuguard.ports import Clock, MetricsRecorder, Publisher
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.runtime.sampling import ChangeDrivenSampler
from gpuguard.sim.node import SimNode

log = structlog.get_logger("gpuguard.demo")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """The last signal a pod's container received on one GPU, and what it used then."""

    signal: StopSignal
    at: float
    gpu_index: int
    used_bytes: int
    limit_bytes: int


@dataclass(slots=True)
class Seen:
    """What act one has seen of each (pod, GPU): its last usage and its last stop. A pod's row
    keeps its GPU, usage, limit and source once its processes are gone (the live table), and
    the summary's ``limits`` still names a pod that was stopped before the last cycle."""

    usages: dict[tuple[str, int], PodUsage] = field(default_factory=dict)
    stops: dict[tuple[str, int], Stop] = field(default_factory=dict)

    def update(self, decision: Decision) -> None:
        for u in decision.usages:
            self.usages[(who(u.pod), u.device.index)] = u


class _DemoKiller:
    """The simulated node's killer, narrated in the live view as each signal goes out."""

    def __init__(self, node: SimNode, feed: Feed, seen: Seen) -> None:
        self._node = node
        self._feed = feed
        self._seen = seen

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        report = self._node.signal_container(target, signal, wait_seconds=wait_seconds)
        if report.delivered:
            pod = who(target.pod)
            at = self._node.elapsed()
            self._seen.stops[(pod, target.gpu_index)] = Stop(
                signal=signal,
                at=at,
                gpu_index=target.gpu_index,
                used_bytes=target.used_bytes,
                limit_bytes=target.limit_bytes,
            )
            self._feed.add(
                at,
                f"{signal.value} → {pod} container {target.container_name} "
                f"({gib(target.used_bytes).strip()} > {gib(target.limit_bytes).strip()})",
            )
        return report


class _EventLog:
    """EventSink for the demo: keeps the Events and logs them as the real sink would."""

    def __init__(self, node: SimNode, feed: Feed) -> None:
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


def build_enforcer(
    scenario: Scenario,
    *,
    feed: Feed,
    seen: Seen,
    recorder: MetricsRecorder,
    publisher: Publisher,
    clock: Clock,
) -> Enforcer:
    """Act one's real enforcer over the scenario's node, its signals and Events narrated."""
    node = scenario.node
    return Enforcer(
        sampler=ChangeDrivenSampler.polling(node, clock=clock.monotonic, poll_seconds=POLL_SECONDS),
        resolver=node,
        pods=node,
        killer=_DemoKiller(node, feed, seen),
        events=_EventLog(node, feed),
        recorder=recorder,
        publisher=publisher,
        clock=clock,
        policy=demo_policy(),
        poll_interval_seconds=POLL_SECONDS,
    )


async def play(
    enforcer: Enforcer,
    scenario: Scenario,
    seen: Seen,
    *,
    duration: float,
    clock: Clock,
    on_cycle: Callable[[Decision], None] | None = None,
) -> None:
    """Turn the enforcer's loop (:meth:`Enforcer.step`, poll-only: every device listed at each
    turn) every ``POLL_SECONDS`` until ``duration`` seconds on the node's clock, the clock of the
    live view's title and of every action: act one ends at ``--duration`` of it, not that long
    after the setup. ``on_cycle`` gets each cycle's decision (the live view)."""
    node = scenario.node
    while node.elapsed() < duration:
        started = clock.monotonic()
        decision = await enforcer.step()
        seen.update(decision)
        if on_cycle is not None:
            on_cycle(decision)
        await asyncio.sleep(max(0.0, POLL_SECONDS - (clock.monotonic() - started)))
