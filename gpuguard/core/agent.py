"""What the sharing agent reads and writes (docs/design.md, Sharing config), and which sharing
config is in force.

Owns the agent's input snapshot (``SharingInputs``: its Node, its node's GPU pods, the sharing
config as validated against NVIDIA's two ConfigMaps), the one Node write a turn makes
(``NodePatch``: the two labels, the cordon and its annotation, conditional on the Node's
``resourceVersion``), the outcome of an eviction, and ``ConfigInForce``: the last good config
stays in force when a new one is invalid or the ConfigMap is deleted, and each rejected content
is reported once. Must not do I/O, read a clock or log (``runtime.agent`` does).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuguard.core.model import PodRef, PodUid
from gpuguard.core.reconcile import CordonAction, NodeView
from gpuguard.core.sharing import SharingConfig
from gpuguard.core.text import printable

GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu", "nvidia.com/mig-")
"""A pod holds a GPU when a container requests or limits a resource named with one of these
(``nvidia.com/gpu``, ``nvidia.com/gpu.shared``, ``nvidia.com/mig-1g.10gb``, …) above zero (the
translation drops a zero quantity before it asks)."""


def holds_gpu(resource_names: frozenset[str] | set[str]) -> bool:
    """Whether these container resource names include a GPU resource."""
    return any(name.startswith(GPU_RESOURCE_PREFIXES) for name in resource_names)


DAEMONSET_KIND = "DaemonSet"


@dataclass(frozen=True, slots=True, kw_only=True)
class PodOwner:
    """Who keeps a GPU pod on its node, for a drain (``kubectl drain``'s rules): a DaemonSet's
    pod tolerates the cordon and comes back at once under a new UID, a mirror pod is the
    kubelet's copy of a static pod; evicting either only starts it again. Both are written by
    whoever creates the pod (hostile text: shown through ``core.text.printable``)."""

    kind: str = ""
    """The controller's kind (``ownerReferences`` with ``controller: true``); ``""``: none."""
    name: str = ""
    mirror: bool = False
    """The annotation ``kubernetes.io/config.mirror`` is set."""

    @property
    def evictable(self) -> bool:
        """Neither a DaemonSet's pod nor a mirror pod: ``Drain`` may evict it."""
        return not self.mirror and self.kind != DAEMONSET_KIND


@dataclass(frozen=True, slots=True, kw_only=True)
class SharingDocument:
    """The sharing config as last read, validated against the NVIDIA configs it names."""

    version: str
    """Identifies the content validated (the three ConfigMaps' resourceVersions): the same
    version is validated, and reported, once."""
    config: SharingConfig | None
    """The config when valid, else ``None``."""
    errors: tuple[str, ...] = ()
    """Every error, ``"<where>: <what> (<code>)"`` as ``check-sharing`` prints them."""
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SharingInputs:
    """Everything one agent turn reads, from the adapter's in-memory views (never blocking)."""

    synced: bool
    """Every source (the sharing ConfigMap, the NVIDIA ConfigMaps it names, the Node, the
    pods) answered its first list: before that the agent decides nothing."""
    node: NodeView | None
    """The agent's Node; ``None`` when it does not exist."""
    resource_version: str = ""
    """The Node's ``metadata.resourceVersion``: every patch is conditional on it."""
    gpu_pods: tuple[PodRef, ...] = ()
    """Pods on the node (not finished) whose containers hold a GPU resource."""
    terminating: frozenset[PodUid] = frozenset()
    """Those of ``gpu_pods`` already being deleted: they still hold their GPU, but are not
    evicted again."""
    owners: Mapping[PodUid, PodOwner] = field(default_factory=dict)
    """Who keeps each of ``gpu_pods`` on the node; a pod absent here has no controller."""
    document: SharingDocument | None = None
    """``None``: the sharing ConfigMap does not exist (or has no ``sharing.yaml``)."""


def evictable_pods(inputs: SharingInputs) -> tuple[PodRef, ...]:
    """The GPU pods ``Drain`` may evict: not being deleted already (a pod holds its GPU until it
    is gone), not a DaemonSet's pod, not a mirror pod (``PodOwner.evictable``)."""
    return tuple(
        pod
        for pod in inputs.gpu_pods
        if pod.uid not in inputs.terminating and inputs.owners.get(pod.uid, PodOwner()).evictable
    )


def unevictable_pods(inputs: SharingInputs, *, limit: int) -> tuple[str, ...]:
    """The GPU pods a drain never evicts, each named with its owner, escaped
    (``core.text.printable``; owner names are written by whoever creates the pod), at most
    ``limit`` of them and then ``and N more``: what a ``Drain`` change waits for."""
    named: list[str] = []
    for pod in inputs.gpu_pods:
        owner = inputs.owners.get(pod.uid, PodOwner())
        if owner.evictable:
            continue
        where = f"{pod.namespace}/{pod.name}"
        if owner.mirror:
            named.append(printable(f"mirror pod {where} (a static pod: remove its manifest)"))
        else:
            named.append(printable(f"{owner.kind} {pod.namespace}/{owner.name} (pod {where})"))
    if len(named) > limit:
        named = [*named[:limit], f"and {len(named) - limit} more"]
    return tuple(named)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodePatch:
    """One merge patch of the agent's Node: labels, cordon and annotation, all or nothing."""

    resource_version: str
    labels: Mapping[str, str] = field(default_factory=dict)
    cordon: CordonAction | None = None

    @property
    def empty(self) -> bool:
        return not self.labels and self.cordon is None


class EvictionOutcome(enum.StrEnum):
    """What the Eviction API said."""

    EVICTED = "evicted"
    """Accepted: the pod is being deleted (it holds its GPU until it is gone)."""
    BLOCKED = "blocked"
    """429: a PodDisruptionBudget does not allow it now; tried again next turn."""
    GONE = "gone"
    """404: the pod no longer exists."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigTurn:
    """What ``ConfigInForce.update`` decided this turn."""

    config: SharingConfig | None
    """The config in force (the new one if valid, else the last good one, else ``None``)."""
    rejected: SharingDocument | None = None
    """A newly rejected document, to report once (Event ``SharingConfigInvalid``, metric)."""
    adopted: SharingDocument | None = None
    """A newly adopted valid document (to log)."""
    deleted: bool = False
    """The ConfigMap was there and is now gone (report once; nothing changes)."""


@dataclass(slots=True)
class ConfigInForce:
    """The last good sharing config, and which document versions were already handled.

    A valid new document replaces the config in force; an invalid one is rejected whole (the
    last good one stays) and reported once per version; a deleted ConfigMap (``None``) changes
    nothing. A restarted agent starts with no config in force: until a valid document is read,
    it changes nothing.
    """

    config: SharingConfig | None = None
    seen_version: str | None = None
    generation: int = 0
    """Counts adopted configs that differ from the one before (``reconcile``'s
    ``config_generation``): the same rules read again (an NVIDIA ConfigMap's new
    resourceVersion) are not a new config."""

    def update(self, document: SharingDocument | None) -> ConfigTurn:
        if document is None:
            deleted = self.seen_version is not None
            self.seen_version = None  # a recreated ConfigMap is handled afresh
            return ConfigTurn(config=self.config, deleted=deleted)
        if document.version == self.seen_version:
            return ConfigTurn(config=self.config)
        self.seen_version = document.version
        if document.config is None:
            return ConfigTurn(config=self.config, rejected=document)
        if document.config != self.config:
            self.generation += 1
        self.config = document.config
        return ConfigTurn(config=self.config, adopted=document)
