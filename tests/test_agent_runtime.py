"""The agent's turn (``runtime.agent``) over in-memory ports, and the pure pieces it stands on:
``core.agent`` (config in force, GPU resources), the agent's JSON translation and its merge
patch. The same code runs against the real API server in ``tests/kube/test_agent.py``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuguard import ports
from gpuguard.adapters.kube.agent import node_patch_body
from gpuguard.adapters.sharing_documents import Findings, validate_sharing
from gpuguard.core.agent import (
    ConfigInForce,
    EvictionOutcome,
    NodePatch,
    PodOwner,
    SharingDocument,
    SharingInputs,
    holds_gpu,
)
from gpuguard.core.model import PodRef, PodUid
from gpuguard.core.reconcile import (
    CordonAction,
    NodeEventReason,
    NodeView,
    ReconcileError,
    WaitReason,
)
from gpuguard.core.sharing import MissingConfig, SharingConfig, parse_sharing
from gpuguard.errors import GpuguardError, KubeError, KubeForbidden, WriteConflict
from gpuguard.kubemodel.translate import (
    agent_node_from_json,
    gpu_pod_from_json,
    gpu_pod_owner_from_json,
)
from gpuguard.runtime.agent import (
    EVICTION_RETRY_SECONDS,
    OWNER_EVICTION_WINDOW_SECONDS,
    OWNER_EVICTIONS,
    Agent,
    AgentOptions,
)
from gpuguard.sim.cluster import SimAgentRecorder, SimNodeEventSink, merge_node_patch
from tests.fakes import FakeClock

DP = "nvidia.com/device-plugin.config"
MIG = "nvidia.com/mig.config"
STATE = "nvidia.com/mig.config.state"


def config(**rule: Any) -> SharingConfig:
    document = {
        "version": "v1",
        "migChangePolicy": rule.pop("policy", "WhenIdle"),
        "rules": [{"name": "r", "nodeNames": ["n1"], **rule}],
    }
    parsed = parse_sharing(document)
    assert parsed.config is not None, parsed.errors
    return parsed.config


def document(version: str, cfg: SharingConfig | None, *errors: str) -> SharingDocument:
    return SharingDocument(version=version, config=cfg, errors=errors)


# -- in-memory ports -----------------------------------------------------------------------------
# The source and the writer answer what the test sets; the Node Events and the recorder are the
# demo's (``gpuguard.sim``): they only keep what they are given.


@dataclass
class MemorySource:
    """``ports.SharingSource``: what the test says the cluster holds."""

    inputs_now: SharingInputs

    pods_now: tuple[PodRef, ...] | None = None
    """What a quorum read finds (``None``: the same as the view)."""

    def inputs(self) -> SharingInputs:
        return self.inputs_now

    def gpu_pods_now(self) -> tuple[PodRef, ...]:
        return self.inputs_now.gpu_pods if self.pods_now is None else self.pods_now

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def wait_synced(self, timeout_seconds: float) -> bool:
        return self.inputs_now.synced

    def problem(self) -> GpuguardError | None:
        return None


@dataclass
class MemoryWriter:
    """``ports.NodeWriter`` over a ``MemorySource``'s Node: applies patches as the API server
    applies the merge patch (``sim.merge_node_patch``, the demo's), or fails the way the test
    asks."""

    source: MemorySource
    fail_with: list[Exception] = field(default_factory=list)
    lose_answers: int = 0
    """Patches applied whose answer is then lost (a timeout after the API server stored it)."""
    evictions: dict[str, EvictionOutcome] = field(default_factory=dict)
    patches: list[NodePatch] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)

    def patch_node(self, patch: NodePatch) -> str:
        if self.fail_with:
            raise self.fail_with.pop(0)
        current = self.source.inputs_now
        assert patch.resource_version == current.resource_version, "a stale patch got through"
        assert current.node is not None
        version = str(int(current.resource_version) + 1)
        self.source.inputs_now = replace(
            current, node=merge_node_patch(current.node, patch), resource_version=version
        )
        self.patches.append(patch)
        if self.lose_answers:
            self.lose_answers -= 1
            raise KubeError("patch nodes: read timed out")
        return version

    def evict(self, pod: PodRef) -> EvictionOutcome:
        name = f"{pod.namespace}/{pod.name}"
        self.evicted.append(name)
        if self.fail_with:
            raise self.fail_with.pop(0)
        return self.evictions.get(name, EvictionOutcome.EVICTED)


# Each in-memory class is checked against its port by mypy here.
_source: ports.SharingSource = MemorySource(SharingInputs(synced=False, node=None))
_writer: ports.NodeWriter = MemoryWriter(MemorySource(SharingInputs(synced=False, node=None)))


@dataclass
class World:
    source: MemorySource
    writer: MemoryWriter
    events: SimNodeEventSink
    recorder: SimAgentRecorder
    clock: FakeClock
    agent: Agent

    def set(self, **changes: Any) -> None:
        self.source.inputs_now = replace(self.source.inputs_now, **changes)

    def label(self, **labels: str) -> None:
        node = self.source.inputs_now.node
        assert node is not None
        self.set(
            node=replace(node, labels={**node.labels, **_dotted(labels)}),
            resource_version=str(int(self.source.inputs_now.resource_version) + 1),
        )


def _reasons(w: World) -> list[str]:
    """The reasons of the Node Events posted, in order."""
    return [e.reason.value for e in w.events.events]


def _dotted(labels: Mapping[str, str]) -> dict[str, str]:
    """``nvidia_com_device_plugin_config`` → ``nvidia.com/device-plugin.config`` (keyword names)."""
    known = {
        "nvidia_com_device_plugin_config": DP,
        "nvidia_com_mig_config": MIG,
        "nvidia_com_mig_config_state": STATE,
    }
    return {known.get(k, k): v for k, v in labels.items()}


def world(
    cfg: SharingConfig | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    pods: int = 0,
    **options: Any,
) -> World:
    source = MemorySource(
        SharingInputs(
            synced=True,
            node=NodeView(name="n1", labels=dict(labels or {})),
            resource_version="1",
            gpu_pods=tuple(
                PodRef(uid=PodUid(f"uid-{i}"), namespace="team", name=f"p{i}") for i in range(pods)
            ),
            document=document("v1", cfg) if cfg else None,
        )
    )
    writer, events, recorder, clock = (
        MemoryWriter(source),
        SimNodeEventSink(node="n1"),
        SimAgentRecorder(),
        FakeClock(),
    )
    agent = Agent(
        source=source,
        writer=writer,
        events=events,
        recorder=recorder,
        clock=clock,
        options=AgentOptions(**options),
    )
    return World(source, writer, events, recorder, clock, agent)


def draining_world(more_labels: Mapping[str, str] | None = None) -> World:
    """A node that must leave ``all-disabled`` for MIG ``all-1g.10gb`` under ``Drain``, with
    two GPU pods the agent may evict, and no pause between writes."""
    return world(
        config(mig="all-1g.10gb", policy="Drain"),
        labels={MIG: "all-disabled", **(more_labels or {})},
        pods=2,
        allow_eviction=True,
        min_write_interval_seconds=0.0,
    )


# -- the turn ----------------------------------------------------------------------------------


async def test_before_every_source_answered_nothing_is_decided() -> None:
    w = world(config(timeSlicing="slice-4"))
    w.set(synced=False)
    report = await w.agent.turn()
    assert not report.synced
    assert w.writer.patches == []
    assert w.recorder.labels == {}


async def test_a_missing_node_is_waited_for_not_written() -> None:
    w = world(config(timeSlicing="slice-4"))
    w.set(node=None)
    assert (await w.agent.turn()).decision is None
    assert w.writer.patches == []


async def test_the_label_is_written_once_and_the_metric_shows_it() -> None:
    w = world(config(timeSlicing="slice-4"))
    report = await w.agent.turn()
    assert report.patched == NodePatch(resource_version="1", labels={DP: "slice-4"})
    w.clock.advance(5)
    await w.agent.turn()
    assert len(w.writer.patches) == 1
    assert w.recorder.rule == "r"
    assert w.recorder.labels == {"device_plugin_config": "slice-4", "mig_config": None}
    assert _reasons(w) == ["SharingLabelsApplied"]


async def test_writes_are_rate_limited_and_a_held_decision_is_not_committed() -> None:
    w = world(config(timeSlicing="slice-4"), min_write_interval_seconds=5.0)
    await w.agent.turn()
    w.clock.advance(1)
    await w.agent.turn()  # sees its write
    w.label(nvidia_com_device_plugin_config="someone-else")  # another writer reverts it
    w.clock.advance(1)
    held = await w.agent.turn()
    assert held.held == "rate_limit"
    assert len(w.writer.patches) == 1
    w.clock.advance(5)
    again = await w.agent.turn()
    assert again.held is None
    assert again.patched is not None
    assert again.patched.labels == {DP: "slice-4"}


async def test_a_conflict_is_decided_again_from_the_fresh_node_and_counts_no_error() -> None:
    w = world(config(timeSlicing="slice-4"), min_write_interval_seconds=0.0)
    w.writer.fail_with.append(WriteConflict("409"))
    held = await w.agent.turn()
    assert held.held == "conflict"
    assert w.events.events == []
    assert w.recorder.errors == []
    w.label(team="a")  # the Node the conflict was about
    report = await w.agent.turn()
    assert report.patched == NodePatch(resource_version="2", labels={DP: "slice-4"})


async def test_an_api_error_is_counted_and_retried_with_a_doubling_wait_up_to_a_minute() -> None:
    w = world(config(timeSlicing="slice-4"), min_write_interval_seconds=1.0)
    w.writer.fail_with.extend(KubeForbidden(f"denied {i}") for i in range(7))
    waits = []
    while True:
        report = await w.agent.turn()
        if report.held is None:
            break
        if report.held == "api_error":
            waits.append(1.0)  # the clock moves 1 s per turn: seconds until the next attempt
        else:
            assert report.held == "rate_limit"
            waits[-1] += 1.0
        w.clock.advance(1.0)
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert w.recorder.errors == [ReconcileError.API_ERROR] * 7
    assert report.patched is not None
    w.clock.advance(1.0)
    await w.agent.turn()  # sees its write
    w.label(nvidia_com_device_plugin_config="again")
    w.clock.advance(1.0)
    assert (await w.agent.turn()).patched is not None, "a success resets the wait"


async def test_an_invalid_config_is_reported_once_per_content_and_the_last_good_one_stays() -> None:
    w = world(config(timeSlicing="slice-4"), min_write_interval_seconds=0.0)
    await w.agent.turn()
    w.set(document=document("v2", None, "rules[0]: bad (code)"))
    for _ in range(3):
        w.clock.advance(1)
        report = await w.agent.turn()
        assert report.rule == "r"  # still the last good config
    assert _reasons(w).count("SharingConfigInvalid") == 1
    invalid = next(e for e in w.events.events if e.reason is NodeEventReason.CONFIG_INVALID)
    assert invalid.warning
    assert "last good config stays in force" in invalid.message
    assert "rules[0]: bad (code)" in invalid.message
    assert w.recorder.errors == [ReconcileError.CONFIG_INVALID]
    w.set(document=document("v3", None, "other (code)"))
    await w.agent.turn()
    assert w.recorder.errors.count(ReconcileError.CONFIG_INVALID) == 2


async def test_an_invalid_first_config_changes_nothing() -> None:
    w = world(labels={DP: "mine"})
    w.set(document=document("v1", None, "x (code)"))
    report = await w.agent.turn()
    assert report.rule is None
    assert w.writer.patches == []
    assert "nothing is changed" in w.events.events[0].message


async def test_a_config_whose_rule_selects_every_node_is_applied_and_its_warning_logged() -> None:
    """An admin who applies the ConfigMap without running check-sharing still learns that a rule
    selects every node: the agent validates with the same code and logs the warning."""
    raw = {
        "version": "v1",
        "migConfig": {"namespace": "gpu-operator", "name": "nvidia-mig-config"},
        "migChangePolicy": "Force",
        "rules": [{"name": "all-gpus", "nodeSelector": {"matchLabels": None}, "mig": "x"}],
    }
    findings = Findings()
    validation = validate_sharing(
        raw, where="configmap gpuguard/gpuguard-sharing", findings=findings,
        device_plugin=None, mig=frozenset({"x"}),
    )  # fmt: skip
    assert findings.errors == []
    w = world(labels={MIG: "all-disabled"}, pods=1)
    w.set(
        document=SharingDocument(
            version="v1", config=validation.config, warnings=tuple(findings.warnings)
        )
    )
    with capture_logs() as logs:
        report = await w.agent.turn()
    assert report.rule == "all-gpus"  # valid: a catch-all is legitimate
    assert report.patched is not None  # Force: under the running GPU pod
    assert report.patched.labels == {MIG: "x"}
    (adopted,) = [e for e in logs if e["event"] == "sharing_config_adopted"]
    (warning,) = adopted["warnings"]
    assert warning.startswith(
        "configmap gpuguard/gpuguard-sharing: rules[0].nodeSelector: rule 'all-gpus': "
        "nodeSelector {matchLabels: null} has no requirement, so it matches every node;"
    )
    assert "migChangePolicy Force every matching node's MIG layout is changed" in warning
    assert warning.endswith("(selects_every_node)")
    assert "SharingConfigInvalid" not in _reasons(w)  # a warning rejects nothing


async def test_a_deleted_config_keeps_the_last_good_one() -> None:
    w = world(config(timeSlicing="slice-4"), min_write_interval_seconds=0.0)
    await w.agent.turn()
    await w.agent.turn()  # sees its write
    w.set(document=None)
    w.label(nvidia_com_device_plugin_config="manual")
    report = await w.agent.turn()
    assert report.rule == "r"
    assert report.patched is not None
    assert report.patched.labels == {DP: "slice-4"}


async def test_a_deleted_config_is_reported_once_and_a_recreated_one_is_read_afresh() -> None:
    w = world(config(timeSlicing="slice-4"), min_write_interval_seconds=0.0)
    await w.agent.turn()
    w.set(document=None)
    for _ in range(3):
        await w.agent.turn()
    assert w.recorder.errors == [ReconcileError.CONFIG_MISSING]
    deleted = [e for e in w.events.events if "deleted" in e.message]
    assert len(deleted) == 1
    assert deleted[0].warning
    assert "last good config stays in force" in deleted[0].message
    w.set(document=document("v1", config(timeSlicing="slice-8")))  # same version string
    report = await w.agent.turn()
    assert report.patched is not None
    assert report.patched.labels == {DP: "slice-8"}


async def test_a_node_deleted_and_registered_again_is_labelled_afresh_not_counted_as_reverts() -> (
    None
):
    w = world(config(timeSlicing="slice-4"), min_write_interval_seconds=0.0)
    for _ in range(3):
        await w.agent.turn()  # written and seen
        await w.agent.turn()
        w.set(node=None)
        await w.agent.turn()
        w.set(node=NodeView(name="n1"), resource_version="100")
    report = await w.agent.turn()
    assert report.patched is not None
    assert report.patched.labels == {DP: "slice-4"}
    assert ReconcileError.LABEL_CONFLICT not in w.recorder.errors


async def test_drain_evicts_each_pod_at_most_every_retry_interval_and_counts_a_pdb_once() -> None:
    w = draining_world({STATE: "success"})
    w.writer.evictions["team/p1"] = EvictionOutcome.BLOCKED
    cordon = await w.agent.turn()
    assert cordon.patched is not None
    assert cordon.patched.cordon is CordonAction.CORDON
    first = await w.agent.turn()
    assert first.evictions == {
        "team/p0": EvictionOutcome.EVICTED,
        "team/p1": EvictionOutcome.BLOCKED,
    }
    w.clock.advance(EVICTION_RETRY_SECONDS / 2)
    assert (await w.agent.turn()).evictions == {}
    w.clock.advance(EVICTION_RETRY_SECONDS)
    again = await w.agent.turn()
    assert set(again.evictions) == {"team/p0", "team/p1"}
    assert w.recorder.errors.count(ReconcileError.EVICTION_BLOCKED) == 1
    blocked = [e for e in w.events.events if "PodDisruptionBudget" in e.message]
    assert len(blocked) == 1
    assert w.recorder.waiting is WaitReason.GPU_PODS
    assert MIG not in (w.writer.patches[-1].labels if w.writer.patches else {})
    w.set(gpu_pods=())
    w.clock.advance(1)
    applied = await w.agent.turn()
    assert applied.patched is not None
    assert applied.patched.labels == {MIG: "all-1g.10gb"}


async def test_an_eviction_the_api_fails_is_counted_and_does_not_stop_the_others() -> None:
    w = draining_world()
    await w.agent.turn()  # cordon
    w.writer.fail_with.append(KubeError("eviction: HTTP 500"))
    report = await w.agent.turn()
    assert report.evictions == {"team/p1": EvictionOutcome.EVICTED}
    assert w.recorder.errors == [ReconcileError.API_ERROR]


async def test_a_gpu_pod_the_watch_has_not_shown_yet_holds_the_mig_change() -> None:
    w = world(
        config(mig="all-1g.10gb"),
        labels={MIG: "all-disabled", STATE: "success"},
        min_write_interval_seconds=0.0,
    )
    late = PodRef(uid=PodUid("late"), namespace="team", name="just-bound")
    w.source.pods_now = (late,)
    for _ in range(3):
        report = await w.agent.turn()
        assert report.held == "gpu_pods"
        assert w.writer.patches == []
    w.set(gpu_pods=(late,))  # the watch catches up
    w.source.pods_now = None
    report = await w.agent.turn()
    assert report.held is None
    assert w.recorder.waiting is WaitReason.GPU_PODS
    w.set(gpu_pods=())
    applied = await w.agent.turn()
    assert applied.patched is not None
    assert applied.patched.labels == {MIG: "all-1g.10gb"}


async def test_force_needs_no_idle_check() -> None:
    w = world(config(mig="all-1g.10gb", policy="Force"), labels={MIG: "all-disabled"}, pods=1)
    w.source.pods_now = (PodRef(uid=PodUid("x"), namespace="t", name="x"),)
    report = await w.agent.turn()
    assert report.patched is not None
    assert report.patched.labels == {MIG: "all-1g.10gb"}


async def test_a_mig_write_whose_answer_is_lost_keeps_the_cordon_until_mig_manager_reports() -> (
    None
):
    """Review finding: the label landed but the answer was lost; the next turn saw the label
    at its value with the old success and lifted the cordon before mig-manager started."""
    w = world(
        config(mig="all-1g.10gb", policy="Cordon"),
        labels={MIG: "all-disabled", STATE: "success"},
        min_write_interval_seconds=0.0,
    )
    cordon = await w.agent.turn()
    assert cordon.patched is not None
    assert cordon.patched.cordon is CordonAction.CORDON
    w.writer.lose_answers = 1
    lost = await w.agent.turn()
    assert lost.held == "api_error"
    assert w.source.inputs_now.node is not None
    assert w.source.inputs_now.node.labels[MIG] == "all-1g.10gb"  # it landed
    for _ in range(20):  # within mig-manager's pick-up window the old success proves nothing
        w.clock.advance(1.0)
        report = await w.agent.turn()
        assert report.patched is None or report.patched.cordon is not CordonAction.UNCORDON
    assert w.source.inputs_now.node.unschedulable
    w.label(nvidia_com_mig_config_state="pending")
    w.clock.advance(1.0)
    await w.agent.turn()
    w.label(nvidia_com_mig_config_state="success")
    w.clock.advance(1.0)
    done = await w.agent.turn()
    assert done.patched is not None
    assert done.patched.cordon is CordonAction.UNCORDON


async def test_a_pod_being_deleted_is_not_evicted_again() -> None:
    w = draining_world()
    w.set(terminating=frozenset({PodUid("uid-0")}))
    await w.agent.turn()  # cordon
    report = await w.agent.turn()
    assert report.evictions == {"team/p1": EvictionOutcome.EVICTED}
    assert w.writer.evicted == ["team/p1"]


# -- pure pieces ---------------------------------------------------------------------------------


def test_config_in_force_keeps_the_last_good_one_and_handles_each_version_once() -> None:
    good, other = config(timeSlicing="a"), config(timeSlicing="b")
    tracker = ConfigInForce()
    assert tracker.update(None).config is None
    first = tracker.update(document("1", good))
    assert first.config is good
    assert first.adopted is not None
    assert tracker.update(document("1", good)).adopted is None
    bad = tracker.update(document("2", None, "e"))
    assert bad.config is good
    assert bad.rejected is not None
    assert tracker.update(document("2", None, "e")).rejected is None
    assert tracker.update(None).config is good
    assert tracker.update(document("3", other)).config is other


@pytest.mark.parametrize(
    ("names", "holds"),
    [
        ({"nvidia.com/gpu"}, True),
        ({"nvidia.com/gpu.shared"}, True),
        ({"nvidia.com/mig-1g.10gb"}, True),
        ({"cpu", "memory"}, False),
        # a prefix of nvidia.com/gpu*, as docs/design.md, Sharing config says
        ({"nvidia.com/gpumem-ish"}, True),
        ({"example.com/nvidia.com/gpu"}, False),
        ({"amd.com/gpu"}, False),
        (set(), False),
    ],
)
def test_gpu_resources_are_nvidia_gpu_and_mig_prefixes(names: set[str], holds: bool) -> None:
    assert holds_gpu(names) is holds


def _pod(phase: str | None = "Running", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"uid": "u1", "name": "p", "namespace": "ns"},
        "spec": spec,
        "status": {} if phase is None else {"phase": phase},
    }


GPU = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
CPU = {"resources": {"requests": {"cpu": "1"}}}


@pytest.mark.parametrize(
    ("pod", "holds"),
    [
        (_pod(containers=[GPU]), True),
        (_pod(containers=[{"resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}]), True),
        (_pod(containers=[CPU]), False),
        (_pod("Succeeded", containers=[GPU]), False),
        (_pod("Failed", containers=[GPU]), False),
        (_pod(None, containers=[GPU]), True),
        (_pod("Pending", containers=[CPU], initContainers=[GPU]), True),
        (_pod("Running", containers=[CPU], initContainers=[GPU]), False),
        (
            _pod("Running", containers=[CPU], initContainers=[{**GPU, "restartPolicy": "Always"}]),
            True,
        ),
        (_pod(containers="not a list"), False),
        (_pod(containers=[{"resources": {"limits": ["nvidia.com/gpu"]}}]), False),
        ({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [GPU]}}, False),
        ("not a pod", False),
    ],
)
def test_a_pod_holds_a_gpu_while_a_running_container_requests_one(pod: object, holds: bool) -> None:
    ref = gpu_pod_from_json(pod)
    assert (ref is not None) is holds
    if ref is not None:
        assert ref == PodRef(uid=PodUid("u1"), namespace="ns", name="p")


def test_the_agents_node_view_keeps_string_labels_and_only_a_true_unschedulable() -> None:
    view, version = agent_node_from_json(
        {
            "metadata": {
                "name": "n1",
                "resourceVersion": "42",
                "labels": {DP: "slice-4", "odd": 3},
                "annotations": {"gpuguard.io/cordoned-by": "agent", "x": None},
            },
            "spec": {"unschedulable": "true"},
        }
    )
    assert version == "42"
    assert dict(view.labels) == {DP: "slice-4"}
    assert dict(view.annotations) == {"gpuguard.io/cordoned-by": "agent"}
    assert view.unschedulable is False  # only the boolean true cordons
    assert agent_node_from_json({"spec": {"unschedulable": True}})[0].unschedulable is True
    assert agent_node_from_json(["junk"]) == (NodeView(), "")


@pytest.mark.parametrize(
    ("patch", "body"),
    [
        (
            NodePatch(resource_version="7", labels={DP: "s"}),
            {"metadata": {"resourceVersion": "7", "labels": {DP: "s"}}},
        ),
        (
            NodePatch(resource_version="7", cordon=CordonAction.CORDON),
            {
                "metadata": {
                    "resourceVersion": "7",
                    "annotations": {"gpuguard.io/cordoned-by": "agent"},
                },
                "spec": {"unschedulable": True},
            },
        ),
        (
            NodePatch(resource_version="7", labels={MIG: "m"}, cordon=CordonAction.UNCORDON),
            {
                "metadata": {
                    "resourceVersion": "7",
                    "labels": {MIG: "m"},
                    "annotations": {"gpuguard.io/cordoned-by": None},
                },
                "spec": {"unschedulable": None},
            },
        ),
        (
            NodePatch(resource_version="7", cordon=CordonAction.FORGET),
            {
                "metadata": {
                    "resourceVersion": "7",
                    "annotations": {"gpuguard.io/cordoned-by": None},
                }
            },
        ),
    ],
)
def test_the_merge_patch_carries_the_resource_version_and_only_the_agents_fields(
    patch: NodePatch, body: dict[str, Any]
) -> None:
    assert node_patch_body(patch) == body


def test_a_429_is_a_pod_disruption_budget_only_when_the_api_server_says_so() -> None:
    """The API server's own throttling answers 429 too: that is a retryable error, not a
    PodDisruptionBudget."""
    import json

    from kubernetes.client import ApiException

    from gpuguard.adapters.kube.agent import _budget

    def answer(body: object) -> ApiException:
        exc = ApiException(status=429, reason="Too Many Requests")
        exc.body = json.dumps(body)
        return exc

    pdb = {"code": 429, "details": {"causes": [{"reason": "DisruptionBudget", "message": "x"}]}}
    assert _budget(answer(pdb))
    assert not _budget(answer({"code": 429, "message": "too many requests, try again"}))
    assert not _budget(answer({"details": {"causes": "not a list"}}))
    broken = ApiException(status=429)
    broken.body = "<html>"
    assert not _budget(broken)


async def test_a_rule_whose_mig_config_map_is_missing_gets_its_time_slicing_and_a_report() -> None:
    """The mig-parted ConfigMap is missing (a cluster with only the device
    plugin). The rule's time-slicing label is written; its mig label is never written unchecked,
    reported once (Event, error, waiting), and written once the ConfigMap is there."""
    raw = {
        "version": "v1",
        "devicePluginConfig": {"namespace": "gpu-operator", "name": "nvidia-time-slicing-config"},
        "migConfig": {"namespace": "gpu-operator", "name": "nvidia-mig-config"},
        "migChangePolicy": "Force",
        "rules": [{"name": "a100", "nodeNames": ["n1"], "timeSlicing": "s4", "mig": "all-1g"}],
    }
    missing = MissingConfig(
        code="config_map_missing", detail="configmap gpu-operator/nvidia-mig-config is not found"
    )
    held = parse_sharing(
        raw, device_plugin_profiles=frozenset({"s4"}), missing={"migConfig": missing}
    )
    assert held.config is not None
    w = world(held.config, labels={MIG: "all-disabled"}, min_write_interval_seconds=0.0)
    for _ in range(3):
        await w.agent.turn()
    assert [p.labels for p in w.writer.patches] == [{DP: "s4"}]
    assert _reasons(w).count("SharingConfigInvalid") == 1
    (report,) = [e for e in w.events.events if e.reason is NodeEventReason.CONFIG_INVALID]
    assert "nvidia-mig-config is not found (config_map_missing)" in report.message
    assert w.recorder.errors == [ReconcileError.NVIDIA_CONFIG_MISSING]
    assert w.recorder.waiting is WaitReason.NVIDIA_CONFIG_MISSING
    assert w.recorder.rule == "a100"
    assert w.recorder.labels == {"device_plugin_config": "s4", "mig_config": "all-disabled"}
    full = parse_sharing(
        raw, device_plugin_profiles=frozenset({"s4"}), mig_profiles=frozenset({"all-1g"})
    )
    w.set(document=document("v2", full.config))  # the ConfigMap was created
    await w.agent.turn()
    assert w.writer.patches[-1].labels == {MIG: "all-1g"}
    assert w.recorder.waiting is None


# -- zero quantities, whose cordon it is, what a drain never evicts ------------------------------


def _gpus(part: str, amount: object) -> dict[str, Any]:
    return _pod(containers=[{"resources": {part: {"nvidia.com/gpu": amount}}}])


@pytest.mark.parametrize(
    ("amount", "holds"),
    [
        ("1", True),
        ("500m", True),
        ("1e3", True),
        (2, True),
        ("0", False),
        ("0.0", False),
        ("0k", False),
        ("0Mi", False),
        ("-1", False),
        (0, False),
        (0.0, False),
        # not a quantity (only a pods file or a manifest can carry one): counted, never idle
        ("one", True),
        (" 1", True),
        ("0" * 100, True),
        (True, True),
        (None, True),
        (float("nan"), True),
    ],
)
@pytest.mark.parametrize("part", ["requests", "limits"])
def test_a_gpu_resource_counts_only_above_zero(part: str, amount: object, holds: bool) -> None:
    assert (gpu_pod_from_json(_gpus(part, amount)) is not None) is holds


def test_a_zero_request_with_a_positive_limit_holds_a_gpu() -> None:
    pod = _pod(
        containers=[
            {"resources": {"requests": {"nvidia.com/gpu": "0"}, "limits": {"nvidia.com/gpu": "1"}}}
        ]
    )
    assert gpu_pod_from_json(pod) is not None


def _managed(*entries: tuple[object, object]) -> list[object]:
    """managedFields entries (manager, fieldsV1)."""
    return [{"manager": m, "operation": "Update", "fieldsV1": f} for m, f in entries]


UNSCHEDULABLE: dict[str, object] = {"f:spec": {"f:unschedulable": {}}}
LABELS: dict[str, object] = {"f:metadata": {"f:labels": {"f:x": {}}}}


@pytest.mark.parametrize(
    ("unschedulable", "managed", "ours"),
    [
        (True, _managed(("gpuguard", UNSCHEDULABLE), ("kubelet", LABELS)), True),
        (True, _managed(("gpuguard", UNSCHEDULABLE), ("gpuguard", LABELS)), True),
        (True, _managed(("gpuguard", LABELS), ("kubectl-cordon", UNSCHEDULABLE)), False),
        (True, _managed(("gpuguard", UNSCHEDULABLE), ("admin-apply", UNSCHEDULABLE)), False),
        (True, _managed(("gpuguard", LABELS)), False),
        (True, None, False),
        (True, "junk", False),
        (True, [None, {"manager": "gpuguard"}, {"fieldsV1": UNSCHEDULABLE}], False),
        (True, _managed((7, UNSCHEDULABLE)), False),
        (False, _managed(("gpuguard", UNSCHEDULABLE)), False),
    ],
)
def test_the_node_view_says_whether_gpuguard_alone_set_the_cordon(
    unschedulable: bool, managed: object, ours: bool
) -> None:
    view, _ = agent_node_from_json(
        {
            "metadata": {
                "name": "n1",
                "annotations": {"gpuguard.io/cordoned-by": "agent"},
                "managedFields": managed,
            },
            "spec": {"unschedulable": unschedulable},
        }
    )
    assert view.unschedulable_by_gpuguard is ours
    assert view.agent_cordoned is ours


def _owned(*refs: dict[str, object], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    pod = _pod(containers=[GPU])
    pod["metadata"]["ownerReferences"] = list(refs)
    if annotations:
        pod["metadata"]["annotations"] = annotations
    return pod


@pytest.mark.parametrize(
    ("pod", "owner"),
    [
        (
            _owned({"kind": "DaemonSet", "name": "dcgm", "controller": True}),
            ("DaemonSet", "dcgm", False),
        ),
        (
            _owned({"kind": "ReplicaSet", "name": "rs", "controller": True}),
            ("ReplicaSet", "rs", True),
        ),
        (_owned({"kind": "DaemonSet", "name": "dcgm"}), ("", "", True)),
        (_owned({"kind": "DaemonSet", "name": "dcgm", "controller": "true"}), ("", "", True)),
        (_owned(annotations={"kubernetes.io/config.mirror": "x"}), ("", "", False)),
        (_owned("junk", {"kind": 3, "name": "n", "controller": True}), ("", "", True)),  # type: ignore[arg-type]
        (_owned({"kind": "Job", "name": "j" * 1000, "controller": True}), ("Job", "j" * 253, True)),
        ("not a pod", ("", "", True)),
    ],
)
def test_a_pods_owner_is_its_controller_and_daemon_set_and_mirror_pods_are_never_evicted(
    pod: object, owner: tuple[str, str, bool]
) -> None:
    got = gpu_pod_owner_from_json(pod)
    assert (got.kind, got.name, got.evictable) == owner


def _drain_with_owners(owners: Mapping[str, PodOwner]) -> World:
    w = draining_world({STATE: "success"})
    pods = w.source.inputs_now.gpu_pods
    w.set(owners={p.uid: owners[p.name] for p in pods if p.name in owners})
    return w


async def test_drain_skips_daemon_set_and_mirror_pods_and_reports_them_escaped() -> None:
    w = _drain_with_owners(
        {"p0": PodOwner(kind="DaemonSet", name="dcgm\x1b[2J"), "p1": PodOwner(mirror=True)}
    )
    await w.agent.turn()  # cordon
    for _ in range(3):
        assert (await w.agent.turn()).evictions == {}
        w.clock.advance(EVICTION_RETRY_SECONDS)
    assert w.writer.evicted == []
    named = [e.message for e in w.events.events if "never evicts" in e.message]
    assert len(named) == 1
    assert "DaemonSet team/dcgm\\x1b[2J (pod team/p0)" in named[0]
    assert "mirror pod team/p1" in named[0]
    assert w.recorder.waiting is WaitReason.GPU_PODS


async def test_evictions_of_one_owner_are_limited_and_refusals_do_not_count() -> None:
    w = _drain_with_owners({"p0": PodOwner(kind="ReplicaSet", name="rs")})
    w.writer.evictions["team/p1"] = EvictionOutcome.BLOCKED
    await w.agent.turn()  # cordon
    evicted = refused = 0
    for i in range(40):  # p0's owner puts a new pod (a new UID) back every turn
        w.set(
            gpu_pods=(
                PodRef(uid=PodUid(f"new-{i}"), namespace="team", name="p0"),
                w.source.inputs_now.gpu_pods[1],
            ),
            owners={PodUid(f"new-{i}"): PodOwner(kind="ReplicaSet", name="rs")},
        )
        report = await w.agent.turn()
        evicted += report.evictions.get("team/p0") is EvictionOutcome.EVICTED
        refused += report.evictions.get("team/p1") is EvictionOutcome.BLOCKED
        w.clock.advance(1.0)
    assert evicted == OWNER_EVICTIONS
    assert refused == 4, "the budget's refusals are retried every EVICTION_RETRY_SECONDS"
    limited = [e.message for e in w.events.events if "keeps putting" in e.message]
    assert limited == [
        f"ReplicaSet team/rs: {OWNER_EVICTIONS} of its pods evicted within 60s, and it keeps "
        f"putting pods back on this node; evicting at most {OWNER_EVICTIONS} of them per 60s"
    ]
    w.clock.advance(OWNER_EVICTION_WINDOW_SECONDS)
    assert (await w.agent.turn()).evictions.get("team/p0") is EvictionOutcome.EVICTED


# -- a label that flips: the rules change with the labels they set ------------------------------

PRODUCT = "nvidia.com/gpu.product"


def gfd_chain(*, other: str = "slice-8") -> SharingConfig:
    """Rules over the product name feature discovery derives from the agent's own label: with
    time-slicing it appends ``-SHARED``. Valid (a warning only): validation cannot see the
    chain, the agent's hold must catch it."""
    parsed = parse_sharing(
        {
            "version": "v1",
            "rules": [
                {
                    "name": "plain",
                    "nodeSelector": {"matchLabels": {PRODUCT: "Tesla-T4"}},
                    "timeSlicing": "slice-4",
                },
                {
                    "name": "shared",
                    "nodeSelector": {"matchLabels": {PRODUCT: "Tesla-T4-SHARED"}},
                    "timeSlicing": other,
                },
            ],
        }
    )
    assert parsed.config is not None, parsed.errors
    assert "selects_rewritten_label" in {p.code for p in parsed.warnings}
    return parsed.config


def feature_discovery(w: World) -> None:
    """What GFD does after the device plugin took a new config: ``slice-4`` → ``-SHARED``."""
    node = w.source.inputs_now.node
    assert node is not None
    shared = node.labels.get(DP) == "slice-4"
    w.label(**{PRODUCT: "Tesla-T4-SHARED" if shared else "Tesla-T4"})


async def flip_turns(w: World, turns: int, *, seconds: float = 1.0) -> list[NodePatch]:
    start = len(w.writer.patches)
    for _ in range(turns):
        await w.agent.turn()
        feature_discovery(w)
        w.clock.advance(seconds)
    return w.writer.patches[start:]


async def test_a_rule_chain_through_another_controller_stops_flipping_after_four_changes() -> None:
    """Each turn the node moved to the other rule and the label flipped (29 writes in 30
    turns, an Event each); now four changes, then the label is held and reported once."""
    w = world(gfd_chain(), labels={PRODUCT: "Tesla-T4"}, min_write_interval_seconds=1.0)
    patches = await flip_turns(w, 30)
    assert [p.labels[DP] for p in patches] == ["slice-4", "slice-8", "slice-4", "slice-8"]
    assert w.recorder.errors == [ReconcileError.LABEL_FLAPPING]
    (held,) = [e for e in w.events.events if e.reason is NodeEventReason.LABEL_CONFLICT]
    assert "written 4 times within 600s" in held.message
    assert "'slice-4', 'slice-8'" in held.message
    # The same rules read again (another ConfigMap's resourceVersion moved) lift nothing.
    w.set(document=document("v2", gfd_chain()))
    assert await flip_turns(w, 5) == []
    # A config that differs is the admin's fix: it applies at once.
    w.set(document=document("v3", gfd_chain(other="slice-4")))
    fixed = await flip_turns(w, 5)
    assert [p.labels for p in fixed] == [{DP: "slice-4"}]


async def test_the_hold_ends_once_the_changes_leave_the_window() -> None:
    w = world(gfd_chain(), labels={PRODUCT: "Tesla-T4"}, min_write_interval_seconds=1.0)
    assert len(await flip_turns(w, 10)) == 4
    w.clock.advance(600.0)
    assert len(await flip_turns(w, 10)) == 4
    assert w.recorder.errors == [ReconcileError.LABEL_FLAPPING] * 2


async def test_writes_whose_answers_are_lost_still_count_toward_the_hold() -> None:
    """Such a write may have landed: forgetting it on the API error would let a flip go on as
    long as the answers are lost."""
    w = world(gfd_chain(), labels={PRODUCT: "Tesla-T4"}, min_write_interval_seconds=0.0)
    w.writer.lose_answers = 100
    # A turn a minute: past the longest backoff after a failed write, within one window.
    patches = await flip_turns(w, 9, seconds=60.0)
    assert len(patches) == 4
    assert ReconcileError.LABEL_FLAPPING in w.recorder.errors


def test_a_config_in_force_counts_a_new_generation_only_for_different_rules() -> None:
    held = ConfigInForce()
    first = config(timeSlicing="slice-4")
    held.update(document("v1", first))
    assert held.generation == 1
    held.update(document("v2", config(timeSlicing="slice-4")))  # re-read, same rules
    held.update(document("v3", None, "bad"))  # rejected: the last good one stays
    held.update(None)  # deleted: nothing changes
    assert held.generation == 1
    held.update(document("v4", config(timeSlicing="slice-8")))
    assert held.generation == 2
