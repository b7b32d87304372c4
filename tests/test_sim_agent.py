"""The demo's second act: the real sharing agent over ``gpuguard.sim``'s simulated cluster.

The sim adapters are checked against their ports (by the type checker, as ``tests/fakes.py``)
and against the semantics of the real ones (the merge patch of ``adapters.kube.agent``, a 409 on
a stale resourceVersion, mig-manager's ``pending`` → ``success``); the act's own checks are
checked to be honest: they fail when the agent writes the mig label under a GPU pod.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpuguard import ports
from gpuguard.commands.demo.scenario import (
    A100_NODE,
    AGENT_INTERVAL_SECONDS,
    DEVICE_PLUGIN_PROFILES,
    MIG_PROFILES,
    TRAINING_POD,
    build_cluster,
    sharing_config,
)
from gpuguard.commands.demo.sharing_act import SharingAct
from gpuguard.core.agent import EvictionOutcome, NodePatch
from gpuguard.core.model import PodRef, PodUid
from gpuguard.core.reconcile import (
    CORDONED_BY_ANNOTATION,
    MIG_CONFIG_STATE_LABEL,
    CordonAction,
    NodeEventReason,
    WaitReason,
)
from gpuguard.core.sharing import DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL
from gpuguard.errors import WriteConflict
from gpuguard.sim.cluster import (
    SimAgentRecorder,
    SimCluster,
    SimNodeEventSink,
    SimNodeWriter,
    SimSharingSource,
)
from tests.fakes import FakeClock

WAIT_TEXT = (
    "agent: gpu-a100-1 holds nvidia.com/mig.config=all-1g.10gb until 1 pod(s) holding a GPU finish"
)


async def _play(act: SharingAct, clock: FakeClock, seconds: float) -> None:
    """Turn the act's agents every ``AGENT_INTERVAL_SECONDS`` of simulated time."""
    for _ in range(round(seconds / AGENT_INTERVAL_SECONDS)):
        await act.tick()
        clock.advance(AGENT_INTERVAL_SECONDS)


def _mig_writes(cluster: SimCluster) -> list[float]:
    return [w.at for w in cluster.writes if MIG_CONFIG_LABEL in w.labels]


async def test_the_mig_label_waits_for_the_training_pod_and_lands_once_it_is_gone() -> None:
    clock = FakeClock()
    cluster = build_cluster(clock, training_seconds=2.0)
    act = SharingAct(cluster, clock=clock)
    await _play(act, clock, 6.0)
    assert act.checks() == dict.fromkeys(act.checks(), True)
    assert act.settled()
    writes = _mig_writes(cluster)
    assert len(writes) == 1
    assert writes[0] >= 2.0
    assert cluster.labels(A100_NODE)[MIG_CONFIG_STATE_LABEL] == "success"
    summary = act.summary()
    assert {n["name"]: n["labels"] for n in summary["nodes"]} == {
        "gpu-t4-1": {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4", MIG_CONFIG_LABEL: None},
        "gpu-t4-2": {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4", MIG_CONFIG_LABEL: None},
        A100_NODE: {DEVICE_PLUGIN_CONFIG_LABEL: "slice-2", MIG_CONFIG_LABEL: "all-1g.10gb"},
    }
    assert {n["name"]: n["rule"] for n in summary["nodes"]} == {
        "gpu-t4-1": "t4-shared",
        "gpu-t4-2": "t4-shared",
        A100_NODE: "a100-mig",
    }
    # gpu-t4-2 already carried its label: the agent never wrote to it.
    assert {n["name"]: n["writes"] for n in summary["nodes"]}["gpu-t4-2"] == 0
    said = act.narration
    assert WAIT_TEXT in said
    applied = "agent: gpu-a100-1 applied nvidia.com/mig.config=all-1g.10gb (rule a100-mig)"
    assert said.index(WAIT_TEXT) < said.index(applied)
    assert "mig-manager: gpu-a100-1 nvidia.com/mig.config.state=success" in said


async def test_never_writes_the_mig_label_while_the_training_pod_runs() -> None:
    clock = FakeClock()
    cluster = build_cluster(clock, training_seconds=None)
    act = SharingAct(cluster, clock=clock)
    await _play(act, clock, 60.0)
    assert _mig_writes(cluster) == []
    assert cluster.labels(A100_NODE)[MIG_CONFIG_LABEL] == "all-disabled"
    # The time-slicing label does not wait for the pod.
    assert cluster.labels(A100_NODE)[DEVICE_PLUGIN_CONFIG_LABEL] == "slice-2"
    node = act.nodes[A100_NODE]
    assert node.recorder.waiting is WaitReason.GPU_PODS
    waiting = [e for e in node.events.events if e.reason is NodeEventReason.MIG_CHANGE_WAITING]
    assert len(waiting) == 1, "waiting is reported once per episode, not once per turn"
    assert "1 pod(s) holding a GPU" in waiting[0].message
    assert act.narration.count(WAIT_TEXT) == 1
    checks = act.checks()
    assert checks["agent_mig_label_never_written_with_gpu_pods"] is True
    assert checks["agent_waited_for_gpu_pods"] is True
    assert checks["agent_labels_match_first_rule"] is False
    assert not act.settled()


async def test_the_checks_fail_when_the_mig_label_is_written_under_a_gpu_pod() -> None:
    # migChangePolicy Force applies at once: the very thing act two's checks must catch.
    clock = FakeClock()
    cluster = build_cluster(clock, training_seconds=None, policy="Force")
    act = SharingAct(cluster, clock=clock)
    await _play(act, clock, 3.0)
    assert [w.gpu_pods for w in cluster.writes if MIG_CONFIG_LABEL in w.labels] == [1]
    checks = act.checks()
    assert checks["agent_mig_label_never_written_with_gpu_pods"] is False
    assert checks["agent_waited_for_gpu_pods"] is False


async def test_never_writes_the_mig_label_while_mig_manager_is_busy() -> None:
    clock = FakeClock()
    cluster = build_cluster(clock, training_seconds=0.0)
    cluster.set_label(A100_NODE, MIG_CONFIG_STATE_LABEL, "rebooting")
    act = SharingAct(cluster, clock=clock)
    await _play(act, clock, 5.0)
    assert _mig_writes(cluster) == []
    assert act.nodes[A100_NODE].recorder.waiting is WaitReason.MIG_STATE_BUSY
    held = "agent: gpu-a100-1 holds nvidia.com/mig.config=all-1g.10gb while mig-manager is busy"
    assert f"{held} (rebooting)" in act.narration
    cluster.set_label(A100_NODE, MIG_CONFIG_STATE_LABEL, "success")
    await _play(act, clock, 3.0)
    assert len(_mig_writes(cluster)) == 1
    assert act.checks()["agent_mig_label_never_written_while_mig_busy"] is True
    assert act.checks()["agent_labels_match_first_rule"] is True


async def test_the_checks_fail_when_the_mig_label_is_written_while_mig_manager_is_busy() -> None:
    clock = FakeClock()
    cluster = build_cluster(clock, training_seconds=0.0, policy="Force")
    act = SharingAct(cluster, clock=clock)
    await act.tick()  # the device-plugin label lands; Force waits for nothing but mig-manager
    cluster.set_label(A100_NODE, MIG_CONFIG_STATE_LABEL, "pending")
    version = cluster.view(A100_NODE)
    assert version is not None
    # A writer that ignored the rule (the agent never does: see the test above).
    cluster.patch(
        A100_NODE,
        NodePatch(resource_version=version[1], labels={MIG_CONFIG_LABEL: "all-3g.40gb"}),
    )
    assert act.checks()["agent_mig_label_never_written_while_mig_busy"] is False


# -- the sim adapters behave as the real ones ----------------------------------------------------


def _cluster(clock: FakeClock) -> SimCluster:
    cluster = SimCluster(
        clock=clock,
        sharing=sharing_config(),
        device_plugin_profiles=DEVICE_PLUGIN_PROFILES,
        mig_profiles=MIG_PROFILES,
        mig_apply_seconds=1.0,
    )
    cluster.add_node("n1", {"a": "b"})
    return cluster


def test_a_patch_on_a_stale_resource_version_is_a_conflict_and_every_write_a_new_version() -> None:
    cluster = _cluster(FakeClock())
    writer = cluster.writer("n1")
    source = cluster.source("n1")
    old = source.inputs().resource_version
    new = writer.patch_node(NodePatch(resource_version=old, labels={MIG_CONFIG_LABEL: "x"}))
    assert new != old
    assert source.inputs().resource_version == new
    with pytest.raises(WriteConflict):
        writer.patch_node(NodePatch(resource_version=old, labels={MIG_CONFIG_LABEL: "y"}))
    assert cluster.labels("n1") == {"a": "b", MIG_CONFIG_LABEL: "x"}
    assert len(cluster.writes) == 1


def test_cordon_uncordon_and_forget_patch_the_node_as_the_merge_patch_does() -> None:
    cluster = _cluster(FakeClock())
    writer, source = cluster.writer("n1"), cluster.source("n1")

    def patch(action: CordonAction) -> None:
        rv = source.inputs().resource_version
        writer.patch_node(NodePatch(resource_version=rv, cordon=action))

    patch(CordonAction.CORDON)
    node = source.inputs().node
    assert node is not None
    assert node.unschedulable
    assert node.agent_cordoned
    patch(CordonAction.UNCORDON)
    node = source.inputs().node
    assert node is not None
    assert not node.unschedulable
    assert CORDONED_BY_ANNOTATION not in node.annotations
    patch(CordonAction.CORDON)
    patch(CordonAction.FORGET)
    node = source.inputs().node
    assert node is not None
    assert node.unschedulable
    assert not node.agent_cordoned
    assert CORDONED_BY_ANNOTATION not in node.annotations


def test_an_eviction_removes_the_pod_and_a_second_one_finds_it_gone() -> None:
    cluster = _cluster(FakeClock())
    pod = PodRef(uid=PodUid("00000000-0000-4000-8000-000000000001"), namespace="t", name="p")
    cluster.add_gpu_pod("n1", pod)
    assert cluster.source("n1").inputs().gpu_pods == (pod,)
    assert cluster.writer("n1").evict(pod) is EvictionOutcome.EVICTED
    assert cluster.source("n1").inputs().gpu_pods == ()
    assert cluster.writer("n1").evict(pod) is EvictionOutcome.GONE


def _busy(cluster: SimCluster) -> bool:
    return cluster.mig_manager.busy


def test_mig_manager_goes_pending_then_success_after_a_changed_mig_label() -> None:
    clock = FakeClock()
    cluster = _cluster(clock)
    assert cluster.step() == []
    rv = cluster.source("n1").inputs().resource_version
    cluster.patch("n1", NodePatch(resource_version=rv, labels={MIG_CONFIG_LABEL: "all-1g.10gb"}))
    assert [(h.kind, h.detail) for h in cluster.step()] == [("mig_state", "pending")]
    assert _busy(cluster)
    clock.advance(0.5)
    assert cluster.step() == []
    assert cluster.labels("n1")[MIG_CONFIG_STATE_LABEL] == "pending"
    clock.advance(0.5)
    assert [(h.kind, h.detail) for h in cluster.step()] == [("mig_state", "success")]
    assert not _busy(cluster)
    assert cluster.step() == []


def test_a_finished_pod_leaves_the_node_at_its_time() -> None:
    clock = FakeClock()
    cluster = build_cluster(clock, training_seconds=2.0)
    clock.advance(1.9)
    assert cluster.step() == []
    clock.advance(0.1)
    [finished] = cluster.step()
    assert (finished.node, finished.kind, finished.detail) == (
        A100_NODE,
        "pod_finished",
        f"{TRAINING_POD.namespace}/{TRAINING_POD.name}",
    )
    assert cluster.gpu_pods(A100_NODE) == ()


async def test_an_invalid_new_sharing_config_is_rejected_and_the_last_good_one_stays() -> None:
    clock = FakeClock()
    cluster = build_cluster(clock, training_seconds=0.0)
    act = SharingAct(cluster, clock=clock)
    await _play(act, clock, 4.0)
    assert act.checks()["agent_labels_match_first_rule"] is True
    bad = sharing_config()
    bad["rules"][0]["timeSlicing"] = "slice-99"
    document = cluster.set_sharing(bad)
    assert document.config is None
    assert any("unknown_profile" in e for e in document.errors)
    await _play(act, clock, 2.0)
    events = act.nodes["gpu-t4-1"].events.events
    assert [e.reason for e in events][-1] is NodeEventReason.CONFIG_INVALID
    assert act.checks()["agent_labels_match_first_rule"] is True


# Each sim adapter is checked against its port by the type checker (mypy --strict covers tests/),
# as tests/fakes.py does for the fakes.
if TYPE_CHECKING:
    _cluster_for_ports = SimCluster(
        clock=FakeClock(),
        sharing={},
        device_plugin_profiles=frozenset(),
        mig_profiles=frozenset(),
    )
    _source: ports.SharingSource = SimSharingSource(_cluster_for_ports, "n")
    _writer: ports.NodeWriter = SimNodeWriter(_cluster_for_ports, "n")
    _node_events: ports.NodeEventSink = SimNodeEventSink(node="n")
    _recorder: ports.AgentRecorder = SimAgentRecorder()
