"""Model types shared by every layer: GPUs, processes, pods, limits and decisions.

Owns the vocabulary only. Must not do I/O, read a clock, log, or import anything outside the
standard library. Unknown values are ``None`` (never 0) so the type checker forces the branch.

Size: over 600 lines, on purpose: the vocabulary every layer shares: frozen dataclasses and enums
with their contracts in docstrings, no logic beyond small properties; one module so that core has
one set of names.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NewType

PodUid = NewType("PodUid", str)
"""A pod's ``metadata.uid`` (36-char dashed UUID) or a static pod's 32-hex config hash."""

ContainerId = NewType("ContainerId", str)
"""A bare runtime container ID (64 hex), without the ``containerd://`` prefix."""

GpuUuid = NewType("GpuUuid", str)
"""NVML's UUID of a physical GPU (``GPU-…``)."""


class Runtime(enum.StrEnum):
    """Container runtime, as it appears in ``containerStatuses[].containerID`` prefixes."""

    CONTAINERD = "containerd"
    CRIO = "cri-o"
    DOCKER = "docker"


class Mode(enum.StrEnum):
    """Enforcement mode: ``audit`` makes the same decisions and sends nothing."""

    ENFORCE = "enforce"
    AUDIT = "audit"


class Unallocated(enum.StrEnum):
    """What is done about a pod's GPU use that none of its allocations names
    (``enforcement.unallocated``)."""

    REPORT = "report"
    """A Warning Event ``GPUUsedWithoutAllocation``, a counter, ``inspect``/``explain``."""
    STOP = "stop"
    """Reported, then its containers on the device stopped through the graduated stop."""


class StopSignal(enum.StrEnum):
    """The two steps of a graduated stop."""

    TERM = "SIGTERM"
    KILL = "SIGKILL"


class SigtermFate(enum.StrEnum):
    """What a SIGTERM sent to one process from the host does, as its ``/proc/<pid>/status``
    shows it just before the signal (``core.stopping.sigterm_fate``; docs/safety.md, Signals that
    land)."""

    CAUGHT = "caught"
    """A handler is installed (``SigCgt``): the process can use the termination timeout."""
    BLOCKED = "blocked"
    """Blocked (``SigBlk``) and not caught: it stays pending, and ``signalfd(2)`` or
    ``sigwaitinfo(2)`` may take it. Counted as caught: it may use the termination timeout."""
    TERMINATES = "terminates"
    """The default action on a process that is not its PID namespace's init: it ends at once."""
    DROPPED_BY_INIT = "dropped_by_init"
    """PID 1 of its PID namespace (``NSpid`` ends in 1) without a handler: the kernel drops the
    signal, from the host too (only SIGKILL from an ancestor namespace reaches it)."""
    IGNORED = "ignored"
    """Ignored (``SigIgn``), not blocked: the kernel discards it."""
    UNKNOWN = "unknown"
    """``status`` could not be read or parsed. Counted as caught (the cautious side): the
    process gets SIGTERM and the termination timeout, as every process did before the SIGTERM-step
    rule of ``core.stopping``."""


class Trigger(enum.StrEnum):
    """What let a confirmed violation be acted on (``gpuguard_violations_total{trigger}``)."""

    GRACE = "grace"
    """Over the limit for the whole grace period."""
    PRESSURE = "pressure"
    """The device's free memory fell below ``pressure_free_fraction``: the grace period was
    skipped (two fresh listings were still required), as the kubelet's hard eviction does."""
    ALLOCATION = "allocation"
    """The allocation guard froze a caller of the pod at an allocation that a listing of the
    device taken after the freeze shows over the limit (the listing's usage plus the frozen
    size): the grace period was skipped, as the allocation is asked for now, not a transient
    excursion, and the listing and the probe's count are two independent reads."""


class LimitSource(enum.StrEnum):
    """Where a pod's effective limit came from (``check-pod``'s ``source``: docs/design.md, CLI
    outputs)."""

    ANNOTATION = "annotation"
    NAMESPACE_DEFAULT = "namespace-default"
    DEFAULT = "default"
    REPLICAS = "replicas"
    KAI = "kai"
    """KAI-Scheduler's pod annotations ``gpu-memory`` (MiB) or ``gpu-fraction``."""
    HAMI = "hami"
    """HAMi's container limits ``nvidia.com/gpumem`` (MiB) or ``nvidia.com/gpumem-percentage``."""
    GPUSHARE = "gpushare"
    """Aliyun gpushare's container limit ``aliyun.com/gpu-mem`` (GiB, or MiB by config)."""
    VOLCANO = "volcano"
    """Volcano's container limits ``volcano.sh/vgpu-memory`` (MiB) or ``-percentage``."""
    DRA = "dra"
    """The memory shares DRA allocated the pod (``consumedCapacity.memory`` of the ResourceClaim
    results its containers use), on the device each was allocated (docs/dra.md)."""


class BoundBy(enum.StrEnum):
    """What bounds a device's memory (``gpuguard_gpu_memory_bound_bytes{bound_by}``,
    ``inspect``'s ``bound_by``; docs/design.md, Metrics): the declaration that bound a pod's
    limit there, ``none`` for a pod nothing gpuguard enforces bounds (no limit applies, or its
    namespace is exempt), ``unattributed`` for memory charged to no pod."""

    ANNOTATION = "annotation"
    DEFAULT = "default"
    """The cluster default or the pod's namespace default (``LimitSource`` ``default`` and
    ``namespace-default``): both are an admin's default."""
    NAMESPACE_MAX = "namespace_max"
    """The namespace maximum: it capped a larger limit, or no other limit applies."""
    KAI = "kai"
    HAMI = "hami"
    GPUSHARE = "gpushare"
    VOLCANO = "volcano"
    DRA = "dra"
    REPLICAS = "replicas"
    NONE = "none"
    UNATTRIBUTED = "unattributed"


FOREIGN_SOURCES = (
    LimitSource.KAI,
    LimitSource.HAMI,
    LimitSource.GPUSHARE,
    LimitSource.VOLCANO,
    LimitSource.DRA,
)
"""Other schedulers' declarations (docs/design.md, Limit sources): read only where
``limits.sources`` lists them."""
GPUGUARD_SOURCE = "gpuguard"
"""``limits.sources``' name for gpuguard's own annotation (its ``source`` is ``annotation``)."""


class RefusalReason(enum.StrEnum):
    """Why a violation (or a process's memory) was not acted on. Stable metric label values."""

    USAGE_UNKNOWN = "usage_unknown"
    """NVML reported N/A for the process's memory."""
    NOT_A_POD = "not_a_pod"
    """The process's cgroup is not a kubelet pod cgroup (host process, conmon, system service)."""
    GHOST = "ghost"
    """NVML lists a PID that is not in ``/proc``."""
    EXEMPT = "exempt"
    """The pod's namespace is exempt by admin config, or it is gpuguard's own pod."""
    EXEMPTION_UNKNOWN = "exemption_unknown"
    """Whether the pod is exempt cannot be told: the admin exempts namespaces by a label
    (``limits.exempt_namespace_label``) and the namespaces carrying it are not known now (not
    listed yet, or not heard from within the staleness bound). Not knowing is never "not
    exempt": no signal until the labels are known again."""
    DATA_STALE = "data_stale"
    """The GPU sample is older than the staleness bound."""
    POD_CACHE_UNSYNCED = "pod_cache_unsynced"
    """The pod directory has not completed its first list."""
    POD_CACHE_STALE = "pod_cache_stale"
    """The pod directory has not heard from the API server within the staleness bound."""
    POD_UNKNOWN = "pod_unknown"
    """The cgroup names a pod UID the (synced) directory does not know on this node."""
    IDENTITY_CHANGED = "identity_changed"
    """The PID now belongs to another process than the one NVML's listing started with."""
    AUDIT_MODE = "audit_mode"
    """A stop would have been sent, but the pod's effective mode is audit."""
    MPS = "mps"
    """The pod's processes on the GPU include an MPS client, and the admin declared MPS on that
    GPU (``enforcement.mps_gpus``): killing a client can corrupt the other clients."""
    NO_CONTAINER = "no_container"
    """The offending processes could not be tied to a container cgroup."""
    PERMISSION_DENIED = "permission_denied"
    """The kernel refused the signal (EPERM/EACCES)."""
    KILL_INEFFECTIVE = "kill_ineffective"
    """SIGKILL was sent but the pod is still over its limit (D state, or memory held elsewhere)."""
    SIGNAL_FAILED = "signal_failed"
    """The kernel rejected the signal for another reason (EINVAL: wrong PID namespace; EMFILE)."""
    NOT_HOST_PID_NAMESPACE = "not_host_pid_namespace"
    """The enforcer could not verify it runs in the host PID namespace (docs/design.md, Safety
    invariants, host-PID self-check): no signal is ever sent; every violation that would be acted on
    is refused with this."""
    CANNOT_SIGNAL = "cannot_signal"
    """The enforcer lacks ``CAP_KILL`` in its effective capability set (start-up privilege
    self-check): the kernel would refuse every signal to another user's process, so
    none is sent; every violation that would be acted on is refused with this."""
    LOCK_HELD = "lock_held"
    """Another enforcer on this node holds the node lock (``enforcement.lock_file``): this one
    stands by, acting on, posting and counting nothing until the lock is free (reliability R3)."""
    DEVICE_UNAVAILABLE = "device_unavailable"
    """NVML could not read this GPU this cycle (lost, not supported, timed out)."""
    UNASSIGNED_DEVICE = "unassigned_device"
    """The pod holds memory on a GPU other than the one its scheduler pinned it to (gpushare's
    ``ALIYUN_COM_GPU_MEM_IDX``, HAMi's ``hami.io/vgpu-devices-allocated``): that scheduler's
    declaration is refused as a grant there, once per pod and GPU. Not a refusal to act: the
    memory is held to the next applicable limit, and stopped over it."""


class EventReason(enum.StrEnum):
    """Kubernetes Event reasons posted on pods (docs/design.md, Events)."""

    LIMIT_EXCEEDED = "GPUMemoryLimitExceeded"
    PROCESS_KILLED = "GPUProcessKilled"
    INVALID_LIMIT = "InvalidGPUMemoryLimit"
    UNASSIGNED_DEVICE = "GPUMemoryOnUnassignedDevice"
    """The pod holds memory on a GPU its scheduler did not assign it: reported once
    per pod and GPU, with the limit that holds it there."""
    UNALLOCATED = "GPUUsedWithoutAllocation"
    """A pod's process on a GPU (or MIG instance) that none of the pod's allocations names:
    reported once per pod and device, and again before it is stopped where the admin has such
    use stopped (``enforcement.unallocated``)."""
    SHARE_EXCEEDED = "GPUMemoryShareExceeded"
    """The pods holding one DRA share together (a claim reserved for all of them) use more
    than it on its GPU: posted on each pod stopped for it, before acting (``core.dra_shares``)."""


# ---------------------------------------------------------------------------------------------
# GPUs


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceKey:
    """The unit limits apply to: a whole GPU, or one MIG GPU instance on it."""

    uuid: GpuUuid
    gpu_instance_id: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuDevice:
    """One enforcement unit: a full GPU, or a MIG instance (then ``gpu_instance_id`` is set)."""

    index: int
    """Physical GPU index (DCGM label ``gpu``)."""
    uuid: GpuUuid
    """Physical GPU UUID (DCGM label ``UUID``)."""
    name: str
    total_bytes: int
    """Memory of this unit: the GPU's, or the MIG instance's."""
    gpu_instance_id: int | None = None
    """MIG GPU instance id (DCGM label ``GPU_I_ID``); ``None`` for a full GPU."""
    compute_instance_id: int | None = None
    mig_uuid: str | None = None
    mig_placement: tuple[int, int] | None = None
    """A MIG instance's GPU instance profile ID and placement start (``nvmlGpuInstanceInfo_t``);
    ``None`` for a full GPU, or where NVML did not say. What a DRA share of a dynamic MIG device
    names it by (``DraShare.is_on``)."""
    mps: bool = False
    """NVML lists MPS clients on it (or an MPS daemon was detected serving it). A fact, not a
    licence: a pod's MPS clients are spared signals only where the admin declared MPS on this
    GPU (``EnforcementPolicy.mps_declared``); a tenant can start a daemon of its own."""

    @property
    def key(self) -> DeviceKey:
        return DeviceKey(uuid=self.uuid, gpu_instance_id=self.gpu_instance_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProcess:
    """One NVML process entry, deduplicated by PID per device."""

    pid: int
    device: DeviceKey
    used_bytes: int | None
    """``None`` when NVML reports N/A (e.g. on MIG without privileges): unknown, never 0."""
    mps_client: bool = False
    """NVML listed it as an MPS client (``nvmlDeviceGetMPSComputeRunningProcesses``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSkip:
    """A device NVML could not read this cycle, and why."""

    uuid: GpuUuid | None
    index: int | None
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleIssue:
    """A value NVML returned that gpuguard refused to trust (docs/reliability.md N7); the
    process's memory is reported as unknown instead, never guessed."""

    uuid: GpuUuid
    gpu_instance_id: int | None
    pid: int | None
    reason: str
    """Stable code: ``memory_above_total``, ``memory_sum_above_total``, ``invalid_pid``,
    ``list_grew`` (the process list changed between NVML's count and fetch; retried once)."""
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Listing:
    """When one enforcement unit's processes were listed. A sample is as fresh as the listing
    it was built on, never fresher: a device whose listing was skipped keeps its old one."""

    seq: int
    """The sample seq of the gather that listed the unit (strictly increasing per source)."""
    taken_at: float
    """Monotonic seconds when that gather finished."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """One read of an enforcement unit's memory (``nvmlDeviceGetMemoryInfo``: ~8 µs on an
    H200 whatever runs on it, where a process listing costs ~11 µs per process)."""

    total_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ListingDue:
    """When a device with a violation in progress needs its next process listing
    (``Decision.urgent``, read by change-driven sampling): listing it earlier moves nothing on,
    listing it later delays the violation's next step."""

    at: float
    """Monotonic seconds from which a listing can move the violation on (its grace period or
    termination timeout has run out, or it waits for its second listing): the device is listed
    at every fast read from then on."""
    free_below_bytes: float = 0.0
    """Also listed at every fast read while its free memory is below this (device pressure
    confirms a violation without its grace period); 0 never."""

    def now_due(self, now: float, memory: DeviceMemory | None) -> bool:
        """Whether a fast read at ``now`` that read ``memory`` should list the device."""
        return now >= self.at or (memory is not None and memory.free_bytes < self.free_below_bytes)

    def merged(self, other: ListingDue) -> ListingDue:
        """Two violations on one device: the earlier time, the wider pressure watch."""
        return ListingDue(
            at=min(self.at, other.at),
            free_below_bytes=max(self.free_below_bytes, other.free_below_bytes),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSample:
    """Everything one NVML gather returned."""

    seq: int
    """Strictly increasing per source; two samples with the same seq are the same sample."""
    taken_at: float
    """Monotonic seconds when the gather finished."""
    devices: tuple[GpuDevice, ...]
    processes: tuple[GpuProcess, ...]
    skipped: tuple[DeviceSkip, ...] = ()
    issues: tuple[SampleIssue, ...] = ()
    """Values refused as untrustworthy in the listings this sample carries."""
    listings: Mapping[DeviceKey, Listing] = field(default_factory=dict)
    """Per device, the listing its processes come from; a device absent here was listed by
    this gather (``seq``, ``taken_at``). Change-driven sampling re-lists only the devices whose
    memory moved, and carries the others' last listing over."""
    memory: Mapping[DeviceKey, DeviceMemory] = field(default_factory=dict)
    """The latest memory read per device (device pressure); empty when not read."""

    def listing(self, key: DeviceKey) -> Listing:
        """The listing ``key``'s processes come from."""
        found = self.listings.get(key)
        return found if found is not None else Listing(seq=self.seq, taken_at=self.taken_at)

    @property
    def oldest_listing_at(self) -> float:
        """When the oldest listing this sample carries was taken: its data is that old."""
        return min((self.listing(d.key).taken_at for d in self.devices), default=self.taken_at)


# ---------------------------------------------------------------------------------------------
# Processes and attribution


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessIdentity:
    """A process, not just a number: ``(pid, starttime)`` survives PID reuse."""

    pid: int
    start_ticks: int
    """``/proc/<pid>/stat`` field 22, clock ticks after boot."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerCgroup:
    """Where a container's processes live, as read from ``/proc/<pid>/cgroup``."""

    version: int
    """1 or 2."""
    hierarchy: str
    """v1: the controller list of the line used (``pids``, ``name=systemd``); v2: ``""``."""
    path: str
    """The container's cgroup (the scope, not a subgroup below it), relative to the hierarchy
    root as the reader's cgroup namespace shows it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    """Host PID → pod, or the reason it is not a pod process."""

    pid: int
    identity: ProcessIdentity | None
    """``None``: the PID is not in ``/proc`` (a ghost)."""
    pod_uid: PodUid | None
    container_id: ContainerId | None
    runtime: Runtime | None
    cgroup: ContainerCgroup | None
    """The container's cgroup when ``container_id`` is known."""
    cgroup_version: int | None
    reason: str | None
    """Why this is not a pod process (``pod_uid is None``); ``None`` otherwise."""
    holds_gpu: bool | None = None
    """Whether the process has a ``/dev/nvidia<N>`` file open (``/proc/<pid>/fd`` links);
    ``None`` when unreadable (another user's, without CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE,
    which the chart does not grant). ``True`` proves the occupant can own the memory NVML
    lists for its PID at once. ``False`` proves nothing either way: the owner may
    have died and the PID been reused, or a live owner may have closed its device files and
    kept its memory (measured on an H200). ``core.policy`` charges such an occupant only once
    NVML has kept listing its PID, with it behind it, for longer than the driver takes to drop
    a dead process's entry (``EnforcementPolicy.owner_settle_seconds``)."""
    started_at: float | None = None
    """When the process started, on the enforcer's monotonic clock (``/proc/<pid>/stat``
    ``starttime`` converted through ``CLOCK_BOOTTIME``); ``None`` when unknown. A process that
    started after the first listing of its PID cannot own what that listing showed."""

    @property
    def is_pod(self) -> bool:
        return self.pod_uid is not None

    @classmethod
    def unknown(cls, pid: int, reason: str) -> Attribution:
        """No identity could be read (not in ``/proc``, unreadable): a ghost to the core."""
        return cls(
            pid=pid,
            identity=None,
            pod_uid=None,
            container_id=None,
            runtime=None,
            cgroup=None,
            cgroup_version=None,
            reason=reason,
        )


# ---------------------------------------------------------------------------------------------
# Pods

LIMIT_ANNOTATION = "gpuguard.io/gpu-memory-limit"
CONFIG_HASH_ANNOTATION = "kubernetes.io/config.hash"
CONFIG_MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
"""Set by the kubelet on the mirror pod it creates for a static pod, to the static pod's hash
(which is also the static pod's UID, the one its cgroups carry)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Pod:
    """What gpuguard needs to know of a pod on its node."""

    uid: PodUid
    namespace: str
    name: str
    annotations: Mapping[str, str] = field(default_factory=dict)
    config_hash: str | None = None
    """The static pod's hash (its cgroups carry it) when this is the kubelet's mirror pod of a
    static pod: ``kubernetes.io/config.mirror`` and ``kubernetes.io/config.hash`` both set to the
    same 32-hex value. ``None`` for every other pod, whatever annotations it carries."""
    containers: Mapping[ContainerId, str] = field(default_factory=dict)
    """Bare container ID → container name, from ``status.containerStatuses``."""
    annotation_limit: LimitValue | None = None
    """``gpuguard.io/gpu-memory-limit`` parsed by ``kubemodel.quantity.parse_limit``."""
    annotation_error: str | None = None
    """Why the annotation was rejected (then ``annotation_limit`` is ``None``)."""
    declared: Mapping[LimitSource, Declaration] = field(default_factory=dict)
    """Other schedulers' declarations found on the pod (read whatever ``limits.sources`` says;
    ``core.limits`` uses only the listed ones)."""


def index_pods(pods: Iterable[Pod]) -> Mapping[PodUid, Pod]:
    """Pods by ``metadata.uid`` and, for static pods, by the hash their cgroups carry.

    A tenant can put any annotation on its own pod, the kubelet's included, and the API server
    lists by namespace/name: a "first pod with this hash wins" index let ``default/evil`` claim a
    ``kube-system`` static pod's processes. So a hash is indexed only for a mirror pod
    (``config_hash`` is set by the translation only then), never over a real UID, and only when
    exactly one pod claims it: a hash two pods claim belongs to neither, and its processes stay
    unattributed (reported, never charged, never signalled) rather than charged to a guess.
    """
    by_uid: dict[PodUid, Pod] = {pod.uid: pod for pod in pods}
    claims: dict[PodUid, list[Pod]] = {}
    for pod in by_uid.values():
        if pod.config_hash is not None:
            claims.setdefault(PodUid(pod.config_hash), []).append(pod)
    view = dict(by_uid)
    for key, claimants in claims.items():
        if len(claimants) == 1 and key not in by_uid:
            view[key] = claimants[0]
    return MappingProxyType(view)


def ambiguous_config_hashes(pods: Iterable[Pod]) -> tuple[str, ...]:
    """Static-pod hashes claimed by more than one pod (``index_pods`` leaves them out)."""
    seen: dict[str, int] = {}
    for pod in pods:
        if pod.config_hash is not None:
            seen[pod.config_hash] = seen.get(pod.config_hash, 0) + 1
    return tuple(sorted(h for h, n in seen.items() if n > 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class PodSnapshot:
    """The pod directory as the runtime sees it at one instant."""

    synced: bool
    """The first full list completed."""
    last_contact_at: float | None
    """Monotonic time of the last successful contact with the API server."""
    pods: Mapping[PodUid, Pod]
    """Indexed by ``metadata.uid`` and, for static pods, also by config hash."""
    labelled_namespaces: frozenset[str] | None = None
    """The namespaces that carry the admin's exempt label (``LimitPolicy.exempt_label``), as
    last listed; ``None`` while not known (no such label configured, or not listed yet). Only
    the names are kept, never the Namespace objects."""
    namespaces_contact_at: float | None = None
    """Monotonic time of the last answer about those namespaces (their own watch): the policy
    treats them as unknown once it is older than the staleness bound."""

    def lookup(self, uid: PodUid) -> Pod | None:
        return self.pods.get(uid)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeFacts:
    """Facts about this node the decisions depend on."""

    name: str
    replicas: int | None = None
    """``nvidia.com/gpu.replicas`` of the node (time-slicing), when known."""
    mig_config_state: str | None = None
    """``nvidia.com/mig.config.state`` (mig-manager: ``pending``, ``rebooting``, ``success``,
    ``failed``), when known."""
    seen: bool = True
    """The Node object was read at least once (a pods file has no Node: always true there)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLockState:
    """The node lock as last tried (``ports.NodeLock``): only its holder enforces (R3)."""

    held: bool
    path: str
    """The lock file."""
    holder_pid: int | None = None
    """When another process holds it: the PID it wrote into the file (its host PID; ``None``
    when unreadable)."""
    problem: str | None = None
    """Why the lock could not be tried at all (the file cannot be created or opened)."""

    @property
    def detail(self) -> str:
        """Why this enforcer stands by, for logs, ``/readyz`` and the refusal."""
        if self.held:
            return f"{self.path} is held by this enforcer"
        if self.problem is not None:
            return f"{self.path}: {self.problem}"
        holder = "another process" if self.holder_pid is None else f"PID {self.holder_pid}"
        return f"{self.path} is held by {holder}"


# ---------------------------------------------------------------------------------------------
# Limits


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitValue:
    """A parsed limit: absolute bytes, a percentage of the device's total memory, or (another
    scheduler's containers that declared each) the sum of both."""

    limit_bytes: int | None = None
    percent: float | None = None

    def resolve(self, device_total_bytes: int | None) -> int | None:
        """Bytes on a device of the given size; ``None`` when a percentage meets an unknown size."""
        if self.percent is None:
            return self.limit_bytes
        if device_total_bytes is None:
            return None
        share = int(device_total_bytes * self.percent / 100)
        return share if self.limit_bytes is None else self.limit_bytes + share


@dataclass(frozen=True, slots=True, kw_only=True)
class DraShare:
    """One device allocation result of a ResourceClaim that a pod's containers use: the unit in
    which the scheduler accounts GPU memory (docs/dra.md). Written by the scheduler, never by the
    tenant: ``status.allocation`` cannot be changed once set."""

    claim_namespace: str
    claim_name: str
    request: str
    """The result's ``request`` (``gpu``, ``gpu/sub``, ``container-0-request-0``)."""
    driver: str
    pool: str
    device: str
    share_id: str | None
    """``shareID``: set for a device that allows multiple allocations."""
    memory_bytes: int | None
    """``consumedCapacity.memory``; ``None`` when the result consumed no memory capacity, or
    all the memory the slice advertises for the device (a device allocated whole): the share is
    then the whole device, its real memory (``kubemodel.dra._whole``)."""
    uuid: GpuUuid | None
    """The device's NVML UUID, from the ``uuid`` attribute of this node's ResourceSlices;
    ``None`` when no slice names the device (the share cannot be placed: never a guess)."""
    pods_sharing: int = 1
    """How many pods the claim is reserved for (``status.reservedFor``): a claim shared by
    several pods is one share the scheduler counted once. Each of them is held to it, and those
    on this node together to it on its device (``core.dra_shares.share_groups``)."""
    mig_uuid: str | None = None
    """A share of a static MIG device: that device's own ``uuid`` (``MIG-…``, NVML's UUID of the
    MIG instance); ``uuid`` is then its GPU's (``parentUUID``)."""
    mig_placement: tuple[int, int] | None = None
    """A share of a dynamic MIG device (no ``uuid`` until the driver makes it): the GPU instance
    profile ID and placement start its name carries; ``uuid`` is then its GPU's."""

    def is_on(self, device: GpuDevice) -> bool:
        """Whether the share's device is ``device`` (an NVML unit). A full GPU's share is on that
        GPU; a MIG device's only on that one MIG instance, by its own UUID (static) or by its
        GPU, profile and placement (dynamic): never by its GPU's UUID alone, or one share would
        cap every instance of the GPU."""
        if self.uuid is None or self.uuid != device.uuid:
            return False
        if self.mig_uuid is not None:
            return device.mig_uuid == self.mig_uuid
        if self.mig_placement is not None:
            return device.gpu_instance_id is not None and device.mig_placement == (
                self.mig_placement
            )
        return True

    def may_be_on(self, device: GpuDevice) -> bool:
        """A dynamic MIG device's share and a MIG instance of its GPU whose profile and placement
        NVML did not give: whether the share is on it cannot be told (never a guess)."""
        return (
            self.mig_placement is not None
            and self.uuid == device.uuid
            and device.gpu_instance_id is not None
            and device.mig_placement is None
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerDeclaration:
    """One container's own declared GPU memory per device (KAI-Scheduler's
    ``nvidia.com/container.<c>.gpu-memory.limit`` / ``.request``): a cap on that container's
    processes on each device, and a cap on the pod there too (``core.limits``)."""

    container: str
    """The container's name as the pod spec has it (for a key naming no container of the pod:
    the name the key carries, shortened; then ``error`` is set)."""
    limit_bytes: int = 0
    """Bytes on each device the container uses (0 when ``error`` is set)."""
    where: str = ""
    """The annotation that binds (``annotation nvidia.com/container.main.gpu-memory.limit``)."""
    error: str | None = None
    """Why it is rejected: then it caps nothing, and is reported like an invalid annotation."""
    pinned: frozenset[str] = frozenset()
    """The devices the scheduler's binder placed the container on (GPU UUIDs, ``index:N``:
    ``nvidia.com/container.<c>.gpus.devices``); empty: not pinned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Declaration:
    """What another scheduler declared for a pod's GPU memory, summed over its containers, in
    the units it was declared in: ``core.limits`` turns it into bytes per device."""

    amount: int = 0
    """In the source's unit: MiB (kai, hami, volcano) or gpushare's (GiB, or MiB by config)."""
    percent: float = 0.0
    """Of the device's memory (kai's ``gpu-fraction`` × 100, hami's and volcano's
    percentages)."""
    where: str = ""
    """Which fields declared it (``annotation gpu-memory``, ``limits nvidia.com/gpumem of
    container main``), for messages."""
    error: str | None = None
    """Why the declaration was rejected: then it is never a limit (the next source or the
    admin default applies), as for an invalid gpuguard annotation."""
    warnings: tuple[str, ...] = ()
    pinned: frozenset[str] = frozenset()
    """Devices the scheduler placed the pod on (GPU UUIDs, or ``index:N``); empty: not pinned."""
    whole_pod: bool = True
    """``amount`` / ``percent`` are a declaration about the whole pod. ``False`` for a ``kai``
    declaration made only of per-container keys (``containers``): nothing pod-wide to weigh."""
    containers: tuple[ContainerDeclaration, ...] = ()
    """``kai`` only: the per-container declarations, one per container that carries keys
    (valid or not), and one rejected entry per container name the pod does not have."""
    shares: tuple[DraShare, ...] = ()
    """``dra`` only: every distinct allocation result the pod's containers use. The limit on a
    device is the sum of the shares allocated there."""
    unresolved: str | None = None
    """``dra`` only: why the shares cannot be known yet (a claim the pod names was not read, or
    could not be, or is past the node's claim budget): the pod is then held like one that
    declares nothing (``core.limits``), never to a guess of its shares."""
    read_at: float | None = None
    """``dra`` only: when (monotonic seconds) the GET of the least recently read claim behind
    the shares was sent (for a claim past the node's claim budget: when it was last found past
    it); ``None`` while one was never read, or this node's slices are not listed yet. A
    violation of a DRA limit, or of a default standing in for unresolved shares, is acted on
    only after its claims were read again since it was confirmed (``core.policy``): a claim
    deleted or deallocated during the grace period, which no pod change announces, is seen
    before any signal."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespacePolicy:
    """Admin policy for one namespace."""

    default_limit: LimitValue | None = None
    max_limit: LimitValue | None = None
    mode: Mode | None = None
    """Overrides the global mode for this namespace (e.g. ``audit`` while onboarding)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitPolicy:
    """Admin limit policy: defaults, maximums and exemptions. Never from pod annotations."""

    cluster_default: LimitValue | None = None
    namespaces: Mapping[str, NamespacePolicy] = field(default_factory=dict)
    replicas_default: bool = False
    replicas_reserve_bytes: int = 0
    exempt_namespaces: frozenset[str] = frozenset({"kube-system"})
    """Namespaces exempt by name (``limits.exempt_namespaces``): names only an admin can create
    (``kube-system``); a name a tenant may create exempts that tenant."""
    exempt_label: tuple[str, str] | None = None
    """``(key, value)`` of the namespace label that exempts a namespace
    (``limits.exempt_namespace_label``), which only an admin may set; ``None``: none."""
    sources: tuple[str, ...] = (GPUGUARD_SOURCE,)
    """``limits.sources``: ``gpuguard`` (the annotation) and the other schedulers' names
    (``LimitSource`` values) whose declarations apply. Every applicable one is a cap and the
    smallest binds, so the order only picks which name ``source`` shows on a tie."""
    gpushare_unit_bytes: int = 1 << 30
    """What one unit of ``aliyun.com/gpu-mem`` is: GiB, or MiB (``limits.gpushare_unit``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclaredLimit:
    """One valid declaration ``core.limits`` weighed for a pod on one device: gpuguard's
    annotation or a listed scheduler's (docs/design.md, Limit sources: each is a cap, the smallest
    binds)."""

    source: LimitSource
    """``annotation`` for gpuguard's own, else the scheduler's name."""
    what: str
    """Which fields declared it (``kai declaration (annotation gpu-fraction)``), for messages."""
    value: str
    """As declared, for people (``10%``, ``2000Mi``, ``3000Mi + 10%``)."""
    limit_bytes: int | None
    """On this device; ``None`` when a percentage meets a device of unknown size."""
    pinned: tuple[str, ...] = ()
    """The devices its scheduler placed the pod on (GPU UUIDs, ``index:N``); empty: not pinned."""
    assigned: bool = True
    """``False``: pinned to other devices than this one. It then grants the pod nothing here
    (the next applicable limit holds it) but still caps it: a pin is pod metadata a tenant can
    write, and it never lifts what the pod declared. A DRA allocation elsewhere does not cap:
    the scheduler wrote it, and it says nothing about this device."""
    unresolved: str | None = None
    """Why ``limit_bytes`` cannot be known, when not for the device's size (a DRA claim not
    read yet, a device no ResourceSlice names)."""
    shares: tuple[DraShare, ...] = ()
    """``dra``: the allocation results behind the limit on this device."""
    read_at: float | None = None
    """``dra``: ``Declaration.read_at`` of the shares behind the limit."""
    container: str | None = None
    """Set for one container's own declaration (``ContainerDeclaration``): it caps that
    container on the device, and the pod there as every declaration does."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerLimit:
    """One container's own limit on a device: the smallest of its own declarations there and
    the pod's limit (``core.limits``). A container over it is stopped alone when what the pod's
    other containers use fits the pod's limit (``core.policy``)."""

    container: str
    limit_bytes: int
    what: str
    """The declaration that binds (``kai declaration (annotation nvidia.com/container.main.
    gpu-memory.limit)``, or ``the pod's limit`` where that is smaller)."""
    value: str
    """As declared, for people (``2Gi``)."""
    source: LimitSource | None = None
    """The scheduler whose per-container declaration binds it; ``None``: the pod's limit."""


class InPodCap(enum.StrEnum):
    """A scheduler's own in-pod enforcement that should have held a pod to the declaration that
    binds it (docs/schedulers.md, Where each scheduler enforces by itself): a violation of that
    declaration means it is missing or was bypassed, reported as ``enforcement_bypassed``."""

    HAMI_CORE = "hami-core"
    """HAMi's interception library in every HAMi pod, holding each container to its
    ``nvidia.com/gpumem`` / ``-percentage``."""
    KAI_NVFRACTIONS = "kai-nvfractions"
    """KAI-Scheduler's NvFractions runtime (the gpu-sharing operator's CUDA memory limit of the
    container), holding each container to its ``nvidia.com/container.<c>.gpu-memory.*``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedLimit:
    """A pod's effective limit on one device, with its source and any problems found."""

    limit_bytes: int | None
    source: LimitSource | None
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    declarations: tuple[DeclaredLimit, ...] = ()
    """Every valid declaration seen, in ``limits.sources`` order (invalid ones are in
    ``errors``): what ``check-pod``, ``explain`` and ``inspect`` show beside the one that bound
    (``source``)."""
    containers: tuple[ContainerLimit, ...] = ()
    """Each container's own limit on the device, where it declared one (sorted by name)."""
    namespace_max: bool = False
    """The namespace maximum binds: it capped a larger limit (``source`` stays the one it
    capped), or it is the limit because nothing else applies (``source`` ``namespace-default``).
    ``BoundBy.NAMESPACE_MAX``."""
    awaits_dra: bool = False
    """The limit is an admin default standing in for DRA shares not known yet (``core.limits``:
    an unresolved pod is held like one that declares nothing). The shares may turn out larger,
    so a violation of it is acted on only once the pod's claims were read since it was due
    (``core.policy``); a limit that bounds the shares anyway (the namespace maximum, another
    declaration) is not."""

    @property
    def unassigned(self) -> tuple[LimitSource, ...]:
        """The schedulers whose declaration pins the pod to other devices than this one: its
        memory here is on a device they did not assign it (reported once per pod and GPU)."""
        here = {d.source for d in self.declarations if d.assigned}
        return tuple(
            dict.fromkeys(
                d.source for d in self.declarations if not d.assigned and d.source not in here
            )
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EnforcementPolicy:
    """Everything ``decide()`` needs from the admin's config."""

    mode: Mode = Mode.AUDIT
    grace_seconds: float = 10.0
    termination_timeout_seconds: float = 10.0
    staleness_seconds: float = 30.0
    pressure_free_fraction: float = 0.05
    """A device whose free memory is below this fraction of its total is under pressure: a pod
    over its limit there is stopped without the grace period. 0 turns pressure off."""
    owner_settle_seconds: float = 5.0
    """A PID NVML keeps listing, with the same live process behind it, for this long is that
    process's memory even when it holds no GPU device file open (it may have closed them and
    kept its memory). Must exceed the time the driver takes to drop a dead process's entry,
    so that a reused PID is never charged for its dead predecessor's memory. On an H200 a dead
    process's entry was gone before ``waitpid`` returned (14 of 14), and a dead parent whose
    forked child holds its context stayed listed for as long as the child lived
    (docs/gpu-e2e.md); 5 s leaves a wide margin over a slow driver. A process
    that has a GPU file open is charged at once."""
    mps_gpus: frozenset[str] = frozenset()
    """GPU UUIDs (or ``all``) on which the admin declared MPS (``enforcement.mps_gpus``)."""
    unallocated: Unallocated = Unallocated.REPORT
    """``enforcement.unallocated``: report GPU use no allocation names, or stop it too."""
    limits: LimitPolicy = field(default_factory=LimitPolicy)
    self_pod_uid: PodUid | None = None
    """gpuguard's own pod: never acted on."""

    def mps_declared(self, uuid: GpuUuid) -> bool:
        """The admin runs MPS on this GPU: its MPS clients are never signalled. Nothing a
        tenant starts or lists makes this true."""
        return "all" in self.mps_gpus or uuid in self.mps_gpus


# ---------------------------------------------------------------------------------------------
# Actions and their outcomes


@dataclass(frozen=True, slots=True, kw_only=True)
class PodRef:
    """Enough of a pod to name it in logs, metrics and Events."""

    uid: PodUid
    namespace: str
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedBudget:
    """DRA shares several pods on one device hold together (a claim reserved for all of them,
    which the scheduler counted once): their memory there is a budget for the pods' sum
    (``core.dra_shares``), as a stop for it was decided."""

    claims: tuple[str, ...]
    """``namespace/name`` of the claims the pods share, sorted."""
    pods: tuple[PodRef, ...]
    """Every pod holding them on the device (the group), the largest user first."""
    budget_bytes: int
    """The memory of every distinct share the pods hold on the device, summed."""
    used_bytes: int
    """The pods' known usage on the device, summed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KillTarget:
    """One offending container: every member of its cgroup is signalled, each re-verified."""

    pod: PodRef
    container_id: ContainerId
    container_name: str | None
    cgroup: ContainerCgroup
    device: DeviceKey
    gpu_index: int
    used_bytes: int
    limit_bytes: int
    dra_shares: tuple[DraShare, ...] = ()
    """The DRA shares allocated the pod on this device (``core.dra_shares``), whether or not
    one of them bound: the kill series names the first in dcgm-exporter's ``dra_*`` labels."""
    unallocated: str | None = None
    """Set when the stop is for GPU use that none of the pod's allocations names
    (``enforcement.unallocated = "stop"``): what the pod was allocated; ``limit_bytes`` is 0."""
    shared: SharedBudget | None = None
    """Set when the stop is for a share several pods hold together, not for the pod's own
    limit: ``used_bytes`` and ``limit_bytes`` are then the group's (``SharedBudget``), and
    ``dra_shares`` the shared ones."""
    own_limit: ContainerLimit | None = None
    """Set when the container is stopped alone for its own limit (``ResolvedLimit.containers``),
    the pod's other containers fitting the pod's limit: ``used_bytes`` and ``limit_bytes`` are
    then the container's own, and ``own_limit.what`` the declaration that binds."""
    bypassed: InPodCap | None = None
    """The scheduler's in-pod cap that should have held what this stop is for
    (``core.limits.in_pod_cap``): it is missing or was bypassed (``enforcement_bypassed``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalRefusal:
    """A member of the target cgroup that was not signalled, and why."""

    pid: int
    reason: RefusalReason
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalReport:
    """What one ``signal_container`` call did, member by member."""

    signal: StopSignal
    delivered: tuple[ProcessIdentity, ...] = ()
    """Re-verified after ``pidfd_open`` and signalled."""
    already_gone: tuple[int, ...] = ()
    """ESRCH, or vanished before its pidfd could be opened."""
    refused: tuple[SignalRefusal, ...] = ()
    survivors: tuple[ProcessIdentity, ...] = ()
    """Still alive after the wait (SIGKILL in D state): reported, not spun on."""
    stops: tuple[MemberStop, ...] = ()
    """Delivered members whose SIGTERM would be lost (``MemberStop``): the signal each got and
    why. Every other delivered member got ``signal``."""

    def signal_of(self, pid: int) -> StopSignal:
        """The signal the delivered member ``pid`` got."""
        for stop in self.stops:
            if stop.pid == pid:
                return stop.signal
        return self.signal


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberStop:
    """One member at the SIGTERM step on which SIGTERM would be lost (its PID namespace's init
    without a handler, or a process that ignores it): what it got instead or anyway, and why
    (``core.stopping.plan_stop``)."""

    pid: int
    signal: StopSignal
    """SIGKILL at once when no member of the container can use the termination timeout;
    else SIGTERM (lost), and SIGKILL after the timeout like the rest."""
    fate: SigtermFate
    detail: str
    """Why, in words, for the ``GPUProcessKilled`` Event and the ``container_signalled`` log."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodEvent:
    """A Kubernetes Event to record on a pod."""

    pod: PodRef
    reason: EventReason
    message: str
    type: str = "Warning"
