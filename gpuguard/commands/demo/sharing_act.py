"""Act two: one real sharing agent (``runtime.agent.Agent``) per Node of the script's simulated
cluster, a turn each per tick, narrated; the act's expectations are judged in ``verdict``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpuguard.commands.demo.narration import Feed
from gpuguard.commands.demo.scenario import (
    A100_NODE,
    ACT_TWO_MAX_SECONDS,
    AGENT_INTERVAL_SECONDS,
    AGENT_WRITE_INTERVAL_SECONDS,
    EXPECTED,
    Expected,
)
from gpuguard.commands.demo.verdict import sharing_checks, sharing_summary
from gpuguard.core.reconcile import MIG_CONFIG_STATE_LABEL, ReconcileError, WaitReason
from gpuguard.core.sharing import MIG_CONFIG_LABEL, SHARING_LABELS
from gpuguard.ports import AgentRecorder, Clock
from gpuguard.runtime.agent import Agent, AgentOptions, TurnReport
from gpuguard.sim.cluster import (
    SimAgentRecorder,
    SimCluster,
    SimHappening,
    SimNodeEventSink,
    SimSharingSource,
)

log = structlog.get_logger("gpuguard.demo")


@dataclass(slots=True, kw_only=True)
class NodeAgent:
    """One Node's real agent, the simulated parts it turns over and its last turn."""

    agent: Agent
    source: SimSharingSource
    events: SimNodeEventSink
    recorder: SimAgentRecorder
    last: TurnReport | None = None


WAITING_TEXT = {
    WaitReason.GPU_PODS: "holds {label}={value} until {pods} pod(s) holding a GPU finish",
    WaitReason.MIG_APPLYING: "waits for mig-manager to apply {label}={value} (state {state})",
    WaitReason.MIG_STATE_BUSY: "holds {label}={value} while mig-manager is busy ({state})",
    WaitReason.CORDON: "holds {label}={value} until the node is cordoned",
    WaitReason.NVIDIA_CONFIG_MISSING: (
        "holds {label}={value}: the NVIDIA ConfigMap that defines it cannot be read"
    ),
}
"""How the narration says why an agent holds a label back, for every ``WaitReason`` (a reason
without a line here raised ``KeyError`` mid-demo)."""


class _BothRecorders:
    """``ports.AgentRecorder``: the demo's ``SimAgentRecorder`` (what the checks read) and a
    real one (what ``/metrics`` shows), told the same."""

    def __init__(self, kept: SimAgentRecorder, shown: AgentRecorder) -> None:
        self._recorders: tuple[AgentRecorder, ...] = (kept, shown)

    def show_labels(
        self, *, rule: str | None, device_plugin_config: str | None, mig_config: str | None
    ) -> None:
        for r in self._recorders:
            r.show_labels(
                rule=rule, device_plugin_config=device_plugin_config, mig_config=mig_config
            )

    def count_reconcile_error(self, reason: ReconcileError) -> None:
        for r in self._recorders:
            r.count_reconcile_error(reason)

    def set_waiting(self, reason: WaitReason | None) -> None:
        for r in self._recorders:
            r.set_waiting(reason)


class SharingAct:
    """Act two: one real ``runtime.agent.Agent`` per Node of a ``SimCluster``, a turn each per
    ``tick()``, narrated; then the expectations (``checks()``) and the summary. ``metrics``:
    Node name → a real recorder told what that Node's agent records, too."""

    def __init__(
        self,
        cluster: SimCluster,
        *,
        clock: Clock,
        feed: Feed | None = None,
        feed_time: Callable[[], float] | None = None,
        expected: dict[str, Expected] | None = None,
        waits_for_gpu_pods: str | None = A100_NODE,
        metrics: Mapping[str, AgentRecorder] | None = None,
    ) -> None:
        self.cluster = cluster
        self.feed = feed if feed is not None else Feed()
        self._now = feed_time or cluster.elapsed
        self.started_at = self.now()
        """When the act started, on ``now()``'s clock."""
        self.expected = EXPECTED if expected is None else expected
        self.waits_for_gpu_pods = waits_for_gpu_pods
        """The Node whose MIG change must have waited for its GPU pods (``checks()``)."""
        options = AgentOptions(
            interval_seconds=AGENT_INTERVAL_SECONDS,
            min_write_interval_seconds=AGENT_WRITE_INTERVAL_SECONDS,
        )
        self.nodes: dict[str, NodeAgent] = {}
        for name in cluster.node_names():
            source = cluster.source(name)
            events = SimNodeEventSink(node=name)
            recorder = SimAgentRecorder()
            shown = (metrics or {}).get(name)
            agent = Agent(
                source=source,
                writer=cluster.writer(name),
                events=events,
                recorder=recorder if shown is None else _BothRecorders(recorder, shown),
                clock=clock,
                options=options,
            )
            self.nodes[name] = NodeAgent(
                agent=agent, source=source, events=events, recorder=recorder
            )
        self.narration: list[str] = []

    def now(self) -> float:
        """Seconds on the clock the narration is stamped with: ``feed_time``, in ``gpuguard
        demo`` the demo's (started with act one's node), else the cluster's."""
        return self._now()

    async def tick(self) -> None:
        """The world moves on (pods finish, mig-manager reacts), then each agent takes a turn."""
        for happening in self.cluster.step():
            self._narrate_happening(happening)
        for name, node in self.nodes.items():
            with structlog.contextvars.bound_contextvars(node=name):
                report = await node.agent.turn()
            self._narrate_turn(name, node, report)
            node.last = report

    def settled(self) -> bool:
        """Every agent's last turn wrote nothing, held nothing back and waits for nothing, and
        mig-manager is idle."""
        for name, node in self.nodes.items():
            report = node.last
            if report is None or not report.synced or report.patched or report.held:
                return False
            if report.decision is not None and report.decision.waiting is not None:
                return False
            if self.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL) in ("pending", "rebooting"):
                return False
        return not self.cluster.mig_manager.busy

    # -- narration ----------------------------------------------------------------------------

    def _say(self, node: str, text: str) -> None:
        self.narration.append(text)
        at = self.now()
        self.feed.add(at, text)
        log.info("demo_narration", act="sharing", node=node, text=text, at_seconds=round(at, 3))

    def _narrate_happening(self, h: SimHappening) -> None:
        if h.kind == "pod_finished":
            self._say(h.node, f"pod {h.detail} finished on {h.node}: its GPU is free")
        elif h.kind == "mig_state":
            self._say(h.node, f"mig-manager: {h.node} {MIG_CONFIG_STATE_LABEL}={h.detail}")

    def _narrate_turn(self, name: str, node: NodeAgent, report: TurnReport) -> None:
        if report.patched is not None:
            changes = ", ".join(f"{k}={v}" for k, v in sorted(report.patched.labels.items()))
            cordon = report.patched.cordon
            what = changes + (f", {cordon.value}" if cordon is not None else "")
            self._say(name, f"agent: {name} applied {what} (rule {report.rule})")
        before = node.last.decision.waiting if node.last and node.last.decision else None
        waiting = report.decision.waiting if report.decision else None
        if waiting is None or waiting == before or report.decision is None:
            return
        track = report.decision.state.labels.get(MIG_CONFIG_LABEL)
        text = WAITING_TEXT[waiting].format(
            label=MIG_CONFIG_LABEL,
            value=track.value if track is not None else "?",
            pods=len(node.source.inputs().gpu_pods),
            state=self.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL),
        )
        self._say(name, f"agent: {name} {text}")

    # -- the verdict (``verdict``) ----------------------------------------------------------------

    def final_labels(self, name: str) -> dict[str, str | None]:
        """Both sharing labels on the Node now; ``None``: absent."""
        labels = self.cluster.labels(name)
        return {label: labels.get(label) for label in SHARING_LABELS}

    def checks(self) -> dict[str, bool]:
        """Act two's expectations, each held or not (``verdict.sharing_checks``)."""
        return sharing_checks(self)

    def summary(self) -> dict[str, Any]:
        """The act for the demo's JSON summary (``verdict.sharing_summary``)."""
        return sharing_summary(self)


async def play(act: SharingAct, *, clock: Clock, on_tick: Callable[[], None] | None = None) -> None:
    """Turn the agents until they settle, at most ``ACT_TWO_MAX_SECONDS``."""
    t_end = clock.monotonic() + ACT_TWO_MAX_SECONDS
    while clock.monotonic() < t_end:
        started = clock.monotonic()
        await act.tick()
        if on_tick is not None:
            on_tick()
        if act.settled():
            return
        await asyncio.sleep(max(0.0, AGENT_INTERVAL_SECONDS - (clock.monotonic() - started)))
