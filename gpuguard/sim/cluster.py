"""The demo's simulated cluster: the sharing agent's world, in memory, for ``gpuguard demo``.

Owns ``SimCluster``: a few Nodes with their GPU pods, a sharing config and a mig-manager
(``SimMigManager``), read and written through the sharing agent's ports (``SimSharingSource``,
``SimNodeWriter``, ``SimNodeEventSink``, ``SimAgentRecorder``), every Node change with a new
resourceVersion as the API server's (docs/design.md, Sharing config). So the demo runs the real
agent. Must never touch an API server or the node it runs on (no kubernetes import, no
adapter: import-linter contracts).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuguard.core.agent import EvictionOutcome, NodePatch, SharingDocument, SharingInputs
from gpuguard.core.model import PodRef, PodUid
from gpuguard.core.reconcile import (
    CORDONED_BY_AGENT,
    CORDONED_BY_ANNOTATION,
    MIG_CONFIG_STATE_LABEL,
    CordonAction,
    NodeEvent,
    NodeView,
    ReconcileError,
    WaitReason,
)
from gpuguard.core.sharing import MIG_CONFIG_LABEL, parse_sharing
from gpuguard.errors import GpuguardError, WriteConflict
from gpuguard.ports import Clock


@dataclass(slots=True, kw_only=True)
class SimClusterNode:
    """One simulated Node: what the API server holds of it, and its running GPU pods."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    unschedulable: bool = False
    unschedulable_by_gpuguard: bool = False
    """``spec.unschedulable`` last set by the agent's field manager (``managedFields``)."""
    resource_version: str = ""
    gpu_pods: dict[PodUid, SimGpuPod] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimGpuPod:
    """A pod on a simulated Node holding a GPU resource (``nvidia.com/gpu``)."""

    ref: PodRef
    finishes_at: float | None = None
    """Seconds since the cluster started when it completes; ``None``: it runs on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeWrite:
    """One Node patch that landed, with what the Node was like when it did."""

    at: float
    """Seconds since the cluster started."""
    node: str
    labels: Mapping[str, str]
    """The labels the patch set."""
    cordon: CordonAction | None
    labels_before: Mapping[str, str]
    """The Node's labels just before the patch."""
    gpu_pods: int
    """GPU pods on the Node when the patch landed."""

    @property
    def mig_state(self) -> str | None:
        """``nvidia.com/mig.config.state`` when the patch landed."""
        return self.labels_before.get(MIG_CONFIG_STATE_LABEL)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimHappening:
    """Something the cluster did by itself in ``SimCluster.step()``."""

    at: float
    node: str
    kind: str
    """``pod_finished`` (``detail``: namespace/name) or ``mig_state`` (``detail``: the state)."""
    detail: str


class SimCluster:
    """A few Nodes, their GPU pods, one sharing config and a mig-manager, all in memory.

    Every Node change (an agent patch, mig-manager's state label) gets a new resourceVersion, as
    the API server's; a patch based on an older one is a conflict. ``step()`` moves the world on:
    pods whose time has come finish, mig-manager reacts to a changed ``nvidia.com/mig.config``.
    Thread-safe: the agent's writes run in worker threads.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        sharing: object,
        device_plugin_profiles: frozenset[str],
        mig_profiles: frozenset[str],
        mig_apply_seconds: float = 1.0,
    ) -> None:
        self._clock = clock
        self._t0 = clock.monotonic()
        self._lock = threading.Lock()
        self._nodes: dict[str, SimClusterNode] = {}
        self._version = 100
        self._profiles = (device_plugin_profiles, mig_profiles)
        self._document_seq = 0
        self.document = self._parse(sharing)
        self.mig_manager = SimMigManager(self, apply_seconds=mig_apply_seconds)
        self.writes: list[NodeWrite] = []
        self.evictions: list[tuple[str, PodRef]] = []

    def elapsed(self) -> float:
        """Seconds since the cluster started."""
        return self._clock.monotonic() - self._t0

    # -- building -------------------------------------------------------------------------------

    def add_node(self, name: str, labels: Mapping[str, str]) -> None:
        with self._lock:
            self._nodes[name] = SimClusterNode(
                name=name, labels=dict(labels), resource_version=self._next_version()
            )
            self.mig_manager.adopt(name, labels.get(MIG_CONFIG_LABEL))

    def add_gpu_pod(self, node: str, pod: PodRef, *, finishes_at: float | None = None) -> None:
        with self._lock:
            self._nodes[node].gpu_pods[pod.uid] = SimGpuPod(ref=pod, finishes_at=finishes_at)

    def set_sharing(self, sharing: object) -> SharingDocument:
        """A new content of the sharing ConfigMap (a new version, validated again)."""
        document = self._parse(sharing)
        with self._lock:
            self.document = document
        return document

    def _parse(self, sharing: object) -> SharingDocument:
        self._document_seq += 1
        dp, mig = self._profiles
        validation = parse_sharing(sharing, device_plugin_profiles=dp, mig_profiles=mig)
        return SharingDocument(
            version=f"sim-{self._document_seq}",
            config=validation.config,
            errors=tuple(str(p) for p in validation.errors),
            warnings=tuple(str(p) for p in validation.warnings),
        )

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    # -- reading --------------------------------------------------------------------------------

    def node_names(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    def labels(self, node: str) -> dict[str, str]:
        with self._lock:
            return dict(self._nodes[node].labels)

    def view(self, node: str) -> tuple[NodeView, str] | None:
        """The Node as the agent reads it, and its resourceVersion; ``None`` if it is gone."""
        with self._lock:
            n = self._nodes.get(node)
            if n is None:
                return None
            view = NodeView(
                name=n.name,
                labels=dict(n.labels),
                annotations=dict(n.annotations),
                unschedulable=n.unschedulable,
                unschedulable_by_gpuguard=n.unschedulable_by_gpuguard,
            )
            return view, n.resource_version

    def gpu_pods(self, node: str) -> tuple[PodRef, ...]:
        with self._lock:
            n = self._nodes.get(node)
            pods = n.gpu_pods.values() if n is not None else ()
            return tuple(sorted((p.ref for p in pods), key=lambda r: (r.namespace, r.name)))

    # -- the API server's answers to the agent's writes -----------------------------------------

    def patch(self, node: str, patch: NodePatch) -> str:
        """Apply the agent's merge patch (``merge_node_patch``), conditional on the
        resourceVersion. Returns the new resourceVersion."""
        with self._lock:
            n = self._nodes.get(node)
            if n is None:
                raise GpuguardError(f"patch node {node}: not found (404)")
            if patch.resource_version != n.resource_version:
                raise WriteConflict(f"patch node {node}: the Node changed (409)")
            self.writes.append(
                NodeWrite(
                    at=self.elapsed(),
                    node=node,
                    labels=dict(patch.labels),
                    cordon=patch.cordon,
                    labels_before=dict(n.labels),
                    gpu_pods=len(n.gpu_pods),
                )
            )
            merged = merge_node_patch(
                NodeView(
                    name=n.name,
                    labels=n.labels,
                    annotations=n.annotations,
                    unschedulable=n.unschedulable,
                    unschedulable_by_gpuguard=n.unschedulable_by_gpuguard,
                ),
                patch,
            )
            n.labels, n.annotations = dict(merged.labels), dict(merged.annotations)
            n.unschedulable = merged.unschedulable
            n.unschedulable_by_gpuguard = merged.unschedulable_by_gpuguard
            n.resource_version = self._next_version()
            return n.resource_version

    def evict(self, node: str, pod: PodRef) -> EvictionOutcome:
        """The Eviction API with no PodDisruptionBudget: the pod is gone at once."""
        with self._lock:
            n = self._nodes.get(node)
            if n is None or n.gpu_pods.pop(pod.uid, None) is None:
                return EvictionOutcome.GONE
            self.evictions.append((node, pod))
            return EvictionOutcome.EVICTED

    def set_label(self, node: str, key: str, value: str) -> None:
        """Another writer (mig-manager) sets a label: a new resourceVersion."""
        with self._lock:
            n = self._nodes[node]
            n.labels[key] = value
            n.resource_version = self._next_version()

    # -- time passes ----------------------------------------------------------------------------

    def step(self) -> list[SimHappening]:
        """Finish the pods whose time has come, then let mig-manager react."""
        now = self.elapsed()
        happened: list[SimHappening] = []
        with self._lock:
            for n in self._nodes.values():
                for uid, pod in list(n.gpu_pods.items()):
                    if pod.finishes_at is not None and now >= pod.finishes_at:
                        del n.gpu_pods[uid]
                        who = f"{pod.ref.namespace}/{pod.ref.name}"
                        happened.append(
                            SimHappening(at=now, node=n.name, kind="pod_finished", detail=who)
                        )
        return happened + self.mig_manager.step(now)

    # -- the agent's ports, one per node --------------------------------------------------------

    def source(self, node: str) -> SimSharingSource:
        return SimSharingSource(self, node)

    def writer(self, node: str) -> SimNodeWriter:
        return SimNodeWriter(self, node)


def merge_node_patch(node: NodeView, patch: NodePatch) -> NodeView:
    """``node`` after the agent's merge patch, exactly as ``adapters.kube.agent.node_patch_body``
    says it: labels set; ``cordon`` sets ``spec.unschedulable`` (owned by gpuguard's field
    manager from then on) and the annotation, ``uncordon`` clears both, ``forget`` only the
    annotation. The resourceVersion is the
    caller's (``SimCluster.patch``, the unit tests' in-memory writer)."""
    annotations = dict(node.annotations)
    unschedulable, ours = node.unschedulable, node.unschedulable_by_gpuguard
    if patch.cordon is CordonAction.CORDON:
        unschedulable = ours = True
        annotations[CORDONED_BY_ANNOTATION] = CORDONED_BY_AGENT
    elif patch.cordon is CordonAction.UNCORDON:
        unschedulable = ours = False
        annotations.pop(CORDONED_BY_ANNOTATION, None)
    elif patch.cordon is CordonAction.FORGET:
        annotations.pop(CORDONED_BY_ANNOTATION, None)
    return NodeView(
        name=node.name,
        labels={**node.labels, **patch.labels},
        annotations=annotations,
        unschedulable=unschedulable,
        unschedulable_by_gpuguard=ours,
    )


class SimMigManager:
    """NVIDIA's mig-manager, simulated: when a Node's ``nvidia.com/mig.config`` differs from the
    config it last applied, it sets ``nvidia.com/mig.config.state`` to ``pending`` (at the next
    ``step``: it learns of the label through a watch), then ``success`` ``apply_seconds`` later."""

    def __init__(self, cluster: SimCluster, *, apply_seconds: float) -> None:
        self._cluster = cluster
        self._apply_seconds = apply_seconds
        self._applied: dict[str, str | None] = {}
        self._applying: dict[str, tuple[str, float]] = {}
        self.applied_log: list[tuple[float, str, str]] = []
        """``(at, node, config)`` for each config applied."""

    @property
    def busy(self) -> bool:
        """Some Node's config is being applied."""
        return bool(self._applying)

    def adopt(self, node: str, config: str | None) -> None:
        """A Node joins with this config already applied."""
        self._applied[node] = config

    def step(self, now: float) -> list[SimHappening]:
        happened: list[SimHappening] = []
        for node in self._cluster.node_names():
            wanted = self._cluster.labels(node).get(MIG_CONFIG_LABEL)
            applying = self._applying.get(node)
            if applying is not None and applying[0] != wanted:
                applying = None  # the label changed again: start over with the new config
            if applying is None:
                if wanted is None or wanted == self._applied.get(node):
                    self._applying.pop(node, None)
                    continue
                applying = self._applying[node] = (wanted, now)
                happened.append(self._state(node, "pending", now))
            elif now - applying[1] >= self._apply_seconds:
                del self._applying[node]
                self._applied[node] = applying[0]
                self.applied_log.append((now, node, applying[0]))
                happened.append(self._state(node, "success", now))
        return happened

    def _state(self, node: str, state: str, now: float) -> SimHappening:
        self._cluster.set_label(node, MIG_CONFIG_STATE_LABEL, state)
        return SimHappening(at=now, node=node, kind="mig_state", detail=state)


class SimSharingSource:
    """``ports.SharingSource`` for one Node of a ``SimCluster``: always synced, never failing."""

    def __init__(self, cluster: SimCluster, node: str) -> None:
        self._cluster = cluster
        self.node_name = node

    def inputs(self) -> SharingInputs:
        seen = self._cluster.view(self.node_name)
        return SharingInputs(
            synced=True,
            node=seen[0] if seen else None,
            resource_version=seen[1] if seen else "",
            gpu_pods=self._cluster.gpu_pods(self.node_name),
            document=self._cluster.document,
        )

    def gpu_pods_now(self) -> tuple[PodRef, ...]:
        """The simulated cluster is its own source of truth."""
        return self._cluster.gpu_pods(self.node_name)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def wait_synced(self, timeout_seconds: float) -> bool:
        return True

    def problem(self) -> GpuguardError | None:
        return None


class SimNodeWriter:
    """``ports.NodeWriter`` for one Node of a ``SimCluster``."""

    def __init__(self, cluster: SimCluster, node: str) -> None:
        self._cluster = cluster
        self.node_name = node

    def patch_node(self, patch: NodePatch) -> str:
        return self._cluster.patch(self.node_name, patch)

    def evict(self, pod: PodRef) -> EvictionOutcome:
        return self._cluster.evict(self.node_name, pod)


@dataclass(slots=True)
class SimNodeEventSink:
    """``ports.NodeEventSink``: keeps the Events posted on one Node, in order."""

    node: str
    events: list[NodeEvent] = field(default_factory=list)

    def post_node(self, event: NodeEvent) -> None:
        self.events.append(event)


@dataclass(slots=True)
class SimAgentRecorder:
    """``ports.AgentRecorder``: keeps what the agent's metrics would show, for one Node."""

    rule: str | None = None
    labels: dict[str, str | None] = field(default_factory=dict)
    """The last ``device_plugin_config`` and ``mig_config`` shown."""
    errors: list[ReconcileError] = field(default_factory=list)
    waiting: WaitReason | None = None
    waited: list[WaitReason] = field(default_factory=list)
    """Every reason waited for, in order of first appearance."""

    def show_labels(
        self, *, rule: str | None, device_plugin_config: str | None, mig_config: str | None
    ) -> None:
        self.rule = rule
        self.labels = {"device_plugin_config": device_plugin_config, "mig_config": mig_config}

    def count_reconcile_error(self, reason: ReconcileError) -> None:
        self.errors.append(reason)

    def set_waiting(self, reason: WaitReason | None) -> None:
        self.waiting = reason
        if reason is not None and reason not in self.waited:
            self.waited.append(reason)


# Each simulated adapter is checked against its port by the type checker, as ``tests/fakes.py``'s
# fakes are: one that drifts from its port fails `make lint`, not a demo run later.
if TYPE_CHECKING:
    from gpuguard import ports

    def _check_ports(cluster: SimCluster) -> list[object]:
        source: ports.SharingSource = cluster.source("n")
        writer: ports.NodeWriter = cluster.writer("n")
        node_events: ports.NodeEventSink = SimNodeEventSink(node="n")
        recorder: ports.AgentRecorder = SimAgentRecorder()
        return [source, writer, node_events, recorder]
