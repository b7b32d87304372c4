"""The demo's verdict: whether what the two acts did is what the script expects, and the
``demo_summary`` event that reports it. The exit code is ``0`` only if every check held.

Act one: the offender was stopped within grace + 2 polls (+ slack) of crossing its limit, nobody
else was signalled and every protected process lives. Act two: ``sharing_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuguard.commands.demo.scenario import (
    GRACE_SECONDS,
    GREEDY_CONTAINER,
    POLL_SECONDS,
    SLACK_SECONDS,
    Scenario,
)
from gpuguard.core.reconcile import MIG_CONFIG_STATE_LABEL, NodeEventReason, WaitReason
from gpuguard.core.sharing import MIG_CONFIG_LABEL, SHARING_LABELS

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from gpuguard.commands.demo.enforcer_act import Seen
    from gpuguard.commands.demo.sharing_act import SharingAct


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """Each expectation of both acts, held or not, and the ``demo_summary`` event's fields."""

    checks: dict[str, bool]
    summary: dict[str, Any]
    kills: int
    """``gpuguard_kills_total`` as the enforcer's metrics counted it."""
    wrong_kills: int
    crossing_seconds: float
    """When the offender crossed its limit, on act one's clock."""
    latency_seconds: float | None
    """From crossing to the first signal; ``None``: never signalled."""
    budget_seconds: float
    """Grace + 2 polls: what the first signal may take (plus ``SLACK_SECONDS``)."""

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


def judge(scenario: Scenario, act: SharingAct, seen: Seen, registry: CollectorRegistry) -> Verdict:
    """Both acts' checks, from the simulated node's signals, the enforcer's metrics
    (``registry``), what act one saw (``seen``) and act two's cluster."""
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
        **act.checks(),
    }
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
        # Every pod act one saw, the stopped one too (its last cycle is before the last one).
        "limits": {
            who: {
                "limit_bytes": u.limit.limit_bytes,
                "source": None if u.limit.source is None else u.limit.source.value,
            }
            for (who, _), u in seen.usages.items()
        },
        "agent": act.summary(),
        "checks": checks,
        "passed": all(checks.values()),
    }
    return Verdict(
        checks=checks,
        summary=summary,
        kills=kills,
        wrong_kills=len(wrong),
        crossing_seconds=crossing,
        latency_seconds=latency,
        budget_seconds=budget,
    )


def sharing_checks(act: SharingAct) -> dict[str, bool]:
    """Act two's expectations: every Node ends with exactly its first matching rule's labels;
    the mig label is never written while a GPU pod is on the Node or mig-manager is busy;
    nothing but changes of the two sharing labels is written; the A100 Node's MIG change
    waited for its GPU pods; every MIG change succeeded."""
    writes = act.cluster.writes
    mig_writes = [w for w in writes if MIG_CONFIG_LABEL in w.labels]
    waited = True
    if act.waits_for_gpu_pods is not None:
        node = act.nodes[act.waits_for_gpu_pods]
        waited = WaitReason.GPU_PODS in node.recorder.waited and any(
            e.reason is NodeEventReason.MIG_CHANGE_WAITING for e in node.events.events
        )
    return {
        "agent_labels_match_first_rule": all(
            act.final_labels(name) == want.labels and act.nodes[name].recorder.rule == want.rule
            for name, want in act.expected.items()
        ),
        "agent_mig_label_never_written_with_gpu_pods": all(w.gpu_pods == 0 for w in mig_writes),
        "agent_mig_label_never_written_while_mig_busy": all(
            w.mig_state not in ("pending", "rebooting") for w in mig_writes
        ),
        "agent_wrote_only_the_two_labels": all(
            set(w.labels) <= set(SHARING_LABELS) for w in writes
        ),
        "agent_wrote_only_changes": all(
            w.labels_before.get(k) != v for w in writes for k, v in w.labels.items()
        ),
        "agent_waited_for_gpu_pods": waited,
        "mig_changes_succeeded": all(
            act.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL) == "success"
            for name, want in act.expected.items()
            if want.labels.get(MIG_CONFIG_LABEL) is not None
        ),
    }


def sharing_summary(act: SharingAct) -> dict[str, Any]:
    """The act for the demo's JSON summary. ``seconds`` and each write's ``at_seconds`` are
    on the act's own clock (0 when it started); ``started_at_seconds`` is when it started
    on ``now()``'s, the clock of the narration and of act one's ``signals``."""
    nodes = []
    for name, node in act.nodes.items():
        nodes.append(
            {
                "name": name,
                "rule": node.recorder.rule,
                "labels": act.final_labels(name),
                "mig_state": act.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL),
                "waited": [w.value for w in node.recorder.waited],
                "writes": sum(1 for w in act.cluster.writes if w.node == name),
            }
        )
    return {
        "nodes": nodes,
        "writes": [
            {
                "at_seconds": round(w.at, 3),
                "node": w.node,
                "labels": dict(w.labels),
                "cordon": w.cordon.value if w.cordon is not None else None,
                "gpu_pods": w.gpu_pods,
                "mig_state": w.mig_state,
            }
            for w in act.cluster.writes
        ],
        "events": [
            f"{e.reason.value} {name}: {e.message}"
            for name, node in act.nodes.items()
            for e in node.events.events
        ],
        "seconds": round(act.cluster.elapsed(), 3),
        "started_at_seconds": round(act.started_at, 3),
        "settled": act.settled(),
    }
