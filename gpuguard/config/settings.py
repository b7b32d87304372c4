"""The settings tree: one frozen ``Settings`` of sections, each field with its unit, default, why
and parser.

Owns every tunable's name, type and default (``config.example.toml`` mirrors this file one to
one) and the translation into the core's ``EnforcementPolicy``. Must not read any source:
``loader`` fills the tree from the file, the environment and the flags.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gpuguard.config.limit_fields import (
    GPUSHARE_UNITS,
    gpushare_unit_name,
    limit,
    limit_sources,
    size_bytes,
)
from gpuguard.config.parsers import (
    Choice,
    Number,
    absolute_path,
    boolean,
    gpu_list,
    label_pair,
    listen_address,
    namespace_label,
    namespace_list,
    namespace_name,
    node_name,
    object_name,
    optional_path,
    parsed_by,
)
from gpuguard.core.model import (
    GPUGUARD_SOURCE,
    EnforcementPolicy,
    LimitPolicy,
    LimitValue,
    Mode,
    NamespacePolicy,
    PodUid,
    Unallocated,
)


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(enum.StrEnum):
    AUTO = "auto"
    """JSON when stdout is not a terminal (a pod's log), console otherwise."""
    JSON = "json"
    CONSOLE = "console"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSettings:
    """This node and where its kernel interfaces are mounted."""

    name: str | None = field(default=None, metadata=parsed_by(node_name))
    """This node's name. Default: unset, then ``$NODE_NAME`` (the downward API's spec.nodeName).
    Required by ``enforce`` (its pod watch selects ``spec.nodeName``); not by ``check-pod``."""
    proc_root: Path = field(default=Path("/proc"), metadata=parsed_by(absolute_path))
    """The host's /proc as seen by gpuguard. Default ``/proc``: the enforcer runs with hostPID.
    Set ``/host/proc`` when the host's /proc is mounted there instead."""
    cgroup_root: Path = field(default=Path("/sys/fs/cgroup"), metadata=parsed_by(absolute_path))
    """The host's cgroup mount (v1 controllers below it, or the v2 unified tree). Default
    ``/sys/fs/cgroup``: where the kubelet's cgroups live on every supported distribution."""
    pod_resources_socket: Path | None = field(
        default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        metadata=parsed_by(optional_path),
    )
    """The kubelet's pod-resources socket (gRPC ``v1.PodResourcesLister``): what the device
    plugin and DRA allocated each container, for GPU use without an allocation. Default
    ``/var/lib/kubelet/pod-resources/kubelet.sock`` (the chart mounts its directory
    read-only); with ``--pods-file`` (no cluster) off unless set. ``""`` turns the reads off:
    every allocation is then unknown, and nothing is reported or stopped for it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EnforcementSettings:
    """The poll loop and the graduated stop (docs/design.md, Enforcement cycle)."""

    mode: Mode = field(default=Mode.AUDIT, metadata=parsed_by(Choice(Mode)))
    """``enforce`` or ``audit``. Default ``audit``: a first install decides and logs would-be
    stops without sending a signal, so admins see what it would do before it does it."""
    poll_interval_seconds: float = field(
        default=1.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """Every GPU's processes are listed at least this often. Default 1: with the fast path
    (``fast_interval_seconds``) a listing follows any move of a GPU's memory within 50 ms, so
    this bounds only what a memory read cannot see (one process freeing what another takes
    within one fast read), and a violation in progress is listed at every fast read once its
    next step is due (its grace period or termination timeout ran out, or its GPU is under
    pressure). With
    the fast path off, this is the poll: set 0.25 for detection within 250 ms."""
    grace_seconds: float = field(
        default=10.0, metadata=parsed_by(Number(minimum=0, inclusive=True))
    )
    """Seconds a pod must stay over its limit, after the warning Event, before SIGTERM.
    Default 10: long enough to ride out a transient peak (allocator caching, cuDNN autotune),
    short enough that neighbours are not starved for long. 0 stops at the second sample."""
    termination_timeout_seconds: float = field(
        default=10.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """Seconds from SIGTERM to SIGKILL if the pod is still over its limit. Default 10: time to
    checkpoint or free memory, well below Kubernetes' 30 s termination grace."""
    fast_interval_seconds: float = field(
        default=0.05, metadata=parsed_by(Number(minimum=0, inclusive=True))
    )
    """Seconds between fast reads of each GPU's used memory (~8 µs each); a device's processes
    are listed only when its memory moved by more than ``fast_step_bytes`` since its last
    listing, or at the latest every ``poll_interval_seconds``. Default 0.05: a one-step
    allocation is seen within 50 ms at a fraction of the cost of listing every poll. 0 turns
    the fast path off (every device listed every poll interval). At most the poll interval."""
    fast_step_bytes: int = field(default=64 * 2**20, metadata=parsed_by(size_bytes))
    """A move of a device's used memory by more than this since its last listing lists its
    processes again: 0 or a quantity ("64Mi"). Default 64Mi: below any CUDA context (~500 MiB)
    and above allocator noise."""
    pressure_free_fraction: float = field(
        default=0.05,
        metadata=parsed_by(Number(minimum=0, inclusive=True, maximum=1, unit="a fraction")),
    )
    """A device whose free memory is below this fraction of its total is under pressure: a pod
    over its limit there is what makes its neighbours fail next, so the grace period is skipped
    (two fresh listings are still required), as the kubelet's hard eviction thresholds do.
    Default 0.05. 0 turns it off."""
    staleness_seconds: float = field(
        default=30.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """Data older than this (GPU sample, pod directory's last API server contact) is never acted
    on. Default 30: must exceed 2 poll intervals, the NVML call timeout and the kube watch
    timeout (every re-watch is a contact), else healthy data would look stale."""
    use_cgroup_kill: bool = field(default=False, metadata=parsed_by(boolean))
    """Send SIGKILL through cgroup v2 ``cgroup.kill`` instead of per-process pidfds. Default
    false: cgroup.kill cannot re-verify each member's identity before the signal, which the
    no-wrong-kill invariant asks for; enable only where a container's processes fork faster
    than pidfds can follow."""
    lock_file: Path = field(
        default=Path("/run/gpuguard/enforcer.lock"), metadata=parsed_by(absolute_path)
    )
    """The node lock: only the enforcer that holds an ``flock`` on this file acts; another one
    on the same node stands by (serves metrics, not ready, acts on nothing) until it is free.
    Default ``/run/gpuguard/enforcer.lock``: the chart mounts the host's ``/run/gpuguard``
    there, so every enforcer on a node (two releases, one started by hand) shares it. Its
    directory is created when missing; a file that cannot be opened stops ``enforce`` at start."""
    mps_gpus: frozenset[str] = field(default=frozenset(), metadata=parsed_by(gpu_list))
    """GPUs (UUIDs as ``nvidia-smi -L`` prints them, or ``["all"]``) on which the admin runs
    MPS: NVIDIA's device plugin with MPS sharing, or an MPS service of the node. There, a pod
    whose processes on the GPU include an MPS client is not signalled (killing a client can
    corrupt the other clients of its server); its violation is refused ``mps``. Default none:
    MPS is something an admin declares, not something a tenant can claim for a GPU by starting
    a daemon of its own (NVIDIA's container toolkit puts ``nvidia-cuda-mps-control`` into GPU
    containers), so elsewhere an MPS client is an ordinary process of its pod, its server is
    charged to the pod that runs it, and no other pod's violation is ever refused for it
    (docs/safety.md, Tenant-controlled inputs)."""
    unallocated: Unallocated = field(
        default=Unallocated.REPORT, metadata=parsed_by(Choice(Unallocated))
    )
    """What to do about a pod's process on a GPU (or MIG instance) that none of the pod's
    allocations names (the device plugin's devices, its DRA shares, a listed scheduler's pin),
    a pod that requested no GPU at all included: ``report`` (a Warning Event
    ``GPUUsedWithoutAllocation``, the counter ``gpuguard_unallocated_gpu_use_total``,
    ``inspect``) or ``stop`` (reported, then its containers on the device stopped through the
    graduated stop, with every safety rule of a limit stop). Default ``report``. Where the
    allocation is unknown (no pod-resources socket, a read failed) nothing is stopped for it."""
    alloc_guard: bool = field(default=False, metadata=parsed_by(boolean))
    """Attach the eBPF allocation guard (docs/design.md, Allocation guard): uprobes on the
    host's libcuda freeze (SIGSTOP) a caller whose allocation would take its pod past the
    headroom of the last listing, the device is listed at once, and the caller is resumed or
    stopped by the usual rules before the memory is taken. Default false: it needs CAP_BPF,
    CAP_PERFMON and kernel BTF, which the chart grants only when this is on. When it cannot
    attach, that is logged once (``gpuguard_alloc_guard_active 0``) and the polling loop
    stays the guard."""
    alloc_guard_library: Path = field(
        default=Path("/host/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        metadata=parsed_by(absolute_path),
    )
    """The libcuda file the guard's uprobes attach to: the host's file, as the chart mounts it
    (the NVIDIA container toolkit bind-mounts that same file, one inode, into every GPU
    container). Default ``/host/usr/lib/x86_64-linux-gnu/libcuda.so.1``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceSettings:
    """``[limits.namespaces.<namespace>]``: admin policy for one namespace."""

    default: LimitValue | None = field(default=None, metadata=parsed_by(limit))
    """Limit for pods of this namespace without an annotation (quantity or %). Default none."""
    max: LimitValue | None = field(default=None, metadata=parsed_by(limit))
    """Cap on every limit in this namespace, annotations included (tenants can only tighten).
    Default none."""
    mode: Mode | None = field(default=None, metadata=parsed_by(Choice(Mode)))
    """Overrides ``enforcement.mode`` here (``audit`` while a team onboards). Default: global."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsSettings:
    """Admin limit policy (docs/design.md, Limit sources): defaults, maximums and exemptions, never
    from pods."""

    default: LimitValue | None = field(default=None, metadata=parsed_by(limit))
    """Cluster default for pods without an annotation: a quantity (``"16Gi"``) or a percentage
    of each device (``"25%"``). Default none: only annotated pods are limited."""
    replicas_default: bool = field(default=False, metadata=parsed_by(boolean))
    """Give unannotated pods on a time-sliced GPU (``nvidia.com/gpu.replicas`` ≥ 2)
    ``(device memory − replicas_reserve_bytes) / replicas``, when no default above applies.
    Default false: an implicit limit can surprise existing workloads; opt in."""
    replicas_reserve_bytes: int = field(default=0, metadata=parsed_by(size_bytes))
    """Memory kept out of the replicas split (a quantity, e.g. ``"2Gi"``, or 0), for CUDA
    contexts and the driver. Default 0."""
    exempt_namespaces: frozenset[str] = field(
        default=frozenset({"kube-system"}), metadata=parsed_by(namespace_list)
    )
    """Namespaces never acted on (reported only), by name. Replaces, not extends, the default.
    Default ``["kube-system"]`` alone: an exemption must rest on something only an admin can
    create, and a name is that only while it exists. Wherever tenants may create namespaces
    (OpenShift's ``oc new-project``, Capsule, Rancher projects, HNC) a tenant who creates a
    listed name that does not exist yet (``nvidia-device-plugin`` on a cluster that runs the
    GPU operator) is exempt, so NVIDIA's namespaces are no longer listed by default: exempt
    them with ``exempt_namespace_label``. ``gpuguard enforce`` warns at start about every
    listed name that does not exist (``exempt_namespaces_missing``)."""
    exempt_namespace_label: str = field(default="", metadata=parsed_by(namespace_label))
    """A namespace label, ``key=value`` (e.g. ``"gpuguard.io/exempt=true"``), that exempts
    every namespace carrying it: label NVIDIA's GPU operator's or device plugin's namespace
    with it (stopping the device plugin, DCGM or the validator would take the GPU away from
    everyone). Only the admin may be able to set it: keep tenants from labelling their
    namespaces with it (Capsule's ``forbiddenLabels``; OpenShift's project admins cannot label
    their namespace; plain RBAC: no ``update``/``patch`` of ``namespaces`` for tenants). The
    enforcer watches the namespaces that carry it (``get``/``list``/``watch`` of
    ``namespaces``, granted by the chart); while they are not known, or not heard from within
    ``enforcement.staleness_seconds``, a violation of a pod not exempt by name is refused
    ``exemption_unknown``, never acted on. Default ``""``: no label exempts."""
    sources: tuple[str, ...] = field(default=(GPUGUARD_SOURCE,), metadata=parsed_by(limit_sources))
    """Where pod limits come from: ``gpuguard`` (the annotation) and the other schedulers whose
    declarations gpuguard should enforce: ``kai``, ``hami``, ``gpushare``, ``volcano``
    (docs/design.md, Limit sources). Every listed declaration on a pod caps its limit and the
    smallest binds (a pod's own annotation never raises what a scheduler declared); the order only
    breaks ties. Default ``["gpuguard"]``: nothing else is read unless an admin opts in."""
    gpushare_unit: str = field(default="GiB", metadata=parsed_by(gpushare_unit_name))
    """The unit of gpushare's ``aliyun.com/gpu-mem``: ``"GiB"`` (its default) or ``"MiB"``
    (its ``--memory-unit=MiB`` deployments). Read only with ``gpushare`` in ``sources``."""
    namespaces: Mapping[str, NamespaceSettings] = field(default_factory=dict)
    """``[limits.namespaces.<namespace>]`` tables (file only). Default none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSettings:
    """The sharing agent (``gpuguard agent``, docs/design.md, Sharing config): where its config
    lives, how often it re-decides and writes its Node, and what it may do to drain one for a MIG
    change."""

    sharing_namespace: str = field(default="gpuguard", metadata=parsed_by(namespace_name))
    """Namespace of the sharing ConfigMap. Default ``gpuguard``: where the chart and
    ``manifests/rbac.yaml`` install gpuguard and grant the agent read access to it."""
    sharing_name: str = field(default="gpuguard-sharing", metadata=parsed_by(object_name))
    """Name of the sharing ConfigMap (key ``sharing.yaml``). Default ``gpuguard-sharing``: the
    one ConfigMap ``manifests/rbac.yaml`` lets the agent read in its namespace."""
    allow_eviction: bool = field(default=False, metadata=parsed_by(boolean))
    """Let ``migChangePolicy: Drain`` evict the node's GPU pods through the Eviction API
    (PodDisruptionBudgets honoured). Default false: evicting tenants' pods is opt-in; without it
    Drain cordons and waits for the GPU pods to finish, and says so. The Helm value
    ``agent.allowEviction`` sets it and grants ``pods/eviction create`` (without Helm, apply
    ``manifests/agent-eviction-rbac.yaml`` too)."""
    keep_cordon_on_failure: bool = field(default=False, metadata=parsed_by(boolean))
    """When mig-manager reports ``failed``, leave the agent's own cordon in place for the admin
    to inspect. Default false: uncordon, so a failed MIG change does not take the node's GPUs
    out of service; the failure is reported either way (Event ``MigChangeFailed``)."""
    metrics_address: str = field(default="0.0.0.0:9411", metadata=parsed_by(listen_address))
    """``host:port`` for the agent's ``/metrics``, ``/healthz`` and ``/readyz``. Default
    ``0.0.0.0:9411``: the enforcer listens on ``metrics.address`` (9410) in the same pod, and
    the two containers share its network namespace."""
    interval_seconds: float = field(
        default=1.0,
        metadata=parsed_by(Number(minimum=0.05, inclusive=True, maximum=60)),
    )
    """Seconds between the agent's decisions (watches feed it in between). Default 1: a new
    config or a finished MIG change is acted on within a second at negligible CPU. From 0.05
    to 60."""
    min_write_interval_seconds: float = field(
        default=1.0, metadata=parsed_by(Number(minimum=0, inclusive=True, maximum=60))
    )
    """At most one write to the Node (label patch, cordon) per this many seconds, so a fight
    with another writer cannot flood the API server. Default 1. From 0 (no limit) to 60."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSettings:
    """The HTTP endpoint for ``/metrics``, ``/healthz`` and ``/readyz``."""

    address: str = field(default="0.0.0.0:9410", metadata=parsed_by(listen_address))
    """``host:port`` to listen on. Default ``0.0.0.0:9410``: all interfaces so Prometheus can
    scrape the pod, and a port beside dcgm-exporter's 9400, not on it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeSettings:
    """The API server connection (pod directory, Events, node labels)."""

    kubeconfig: Path | None = field(default=None, metadata=parsed_by(optional_path))
    """A kubeconfig file. Default none: the in-cluster service account (the DaemonSet's)."""
    connect_timeout_seconds: float = field(
        default=5.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """Seconds to establish a connection to the API server. Default 5."""
    request_timeout_seconds: float = field(
        default=10.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """Seconds for one non-watch request (list, Event, label patch). Default 10: a slow API
    server delays an Event, never the poll loop (requests run off the event loop)."""
    watch_timeout_seconds: float = field(
        default=20.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """Server-side length of one pod watch; each re-watch counts as contact. Default 20: must
    stay below ``enforcement.staleness_seconds`` so a quiet node's cache does not look stale."""
    inactivity_seconds: float = field(
        default=15.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """A watch silent this long past its timeout is dropped and restarted (half-open TCP).
    Default 15."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmlSettings:
    """The NVIDIA Management Library."""

    library_path: Path | None = field(default=None, metadata=parsed_by(optional_path))
    """An explicit ``libnvidia-ml.so.1``. Default none: the dynamic loader's search (the NVIDIA
    container toolkit mounts it); set e.g. ``/host/usr/lib64/libnvidia-ml.so.1`` otherwise."""
    fail_on_init_error: bool = field(default=True, metadata=parsed_by(boolean))
    """Exit when NVML cannot be initialised at start. Default true (like GFD): a node agent that
    silently enforces nothing is worse than a crash-looping one. false: run, report, retry."""
    call_timeout_seconds: float = field(
        default=5.0, metadata=parsed_by(Number(minimum=0, inclusive=False))
    )
    """Seconds one NVML gather may take before the cycle gives up on it (NVML can hang on a
    failing GPU). Default 5: must stay below ``enforcement.staleness_seconds``."""
    graphics_processes: bool = field(default=True, metadata=parsed_by(boolean))
    """Also list graphics processes (and charge their memory). Default true: a pod rendering
    with Vulkan/EGL holds GPU memory too. Each list costs ~1 ms of driver CPU per GPU at 100
    processes (docs/performance.md); turn off on compute-only nodes to halve the poll cost."""
    mps_processes: bool = field(default=True, metadata=parsed_by(boolean))
    """Also list MPS client processes: each is charged to its pod like any process, and where
    the admin declared MPS (``enforcement.mps_gpus``) a pod with an MPS client there is not
    signalled. Default true; turned off, MPS clients are invisible (their memory is
    unattributed), so turn it off only where MPS is never used."""
    native_gate: bool = field(default=True, metadata=parsed_by(boolean))
    """Between fast reads, read memory in gpuguard's native quiet gate, which wakes Python only
    when a read could list something (docs/design.md, Fast path). Default true: an idle
    enforcer costs a fraction of the CPU. false (or the gate not built): every fast read in
    Python, as before; ``enforcer_started`` logs ``fast_reads`` (native, python or off)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggingSettings:
    """structlog output."""

    level: LogLevel = field(default=LogLevel.INFO, metadata=parsed_by(Choice(LogLevel)))
    """``debug`` (one ``poll_finished`` line per cycle), ``info``, ``warning`` or ``error``.
    Default ``info``: violations, stops and problems, without a line per poll."""
    format: LogFormat = field(default=LogFormat.AUTO, metadata=parsed_by(Choice(LogFormat)))
    """``auto``, ``json`` or ``console``. Default ``auto``: JSON in a pod, console on a
    terminal."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every setting of gpuguard, grouped as in the TOML file."""

    node: NodeSettings = field(default_factory=NodeSettings)
    enforcement: EnforcementSettings = field(default_factory=EnforcementSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    kube: KubeSettings = field(default_factory=KubeSettings)
    nvml: NvmlSettings = field(default_factory=NvmlSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)

    def limit_policy(self) -> LimitPolicy:
        """The admin limit policy ``core.limits`` resolves against."""
        limits = self.limits
        return LimitPolicy(
            cluster_default=limits.default,
            namespaces={
                name: NamespacePolicy(default_limit=ns.default, max_limit=ns.max, mode=ns.mode)
                for name, ns in limits.namespaces.items()
            },
            replicas_default=limits.replicas_default,
            replicas_reserve_bytes=limits.replicas_reserve_bytes,
            exempt_namespaces=limits.exempt_namespaces,
            exempt_label=label_pair(limits.exempt_namespace_label),
            sources=limits.sources,
            gpushare_unit_bytes=GPUSHARE_UNITS[limits.gpushare_unit],
        )

    def enforcement_policy(self, self_pod_uid: PodUid | None = None) -> EnforcementPolicy:
        """Everything ``decide()`` needs; ``self_pod_uid`` (downward API) is never acted on."""
        enforcement = self.enforcement
        return EnforcementPolicy(
            mode=enforcement.mode,
            grace_seconds=enforcement.grace_seconds,
            termination_timeout_seconds=enforcement.termination_timeout_seconds,
            staleness_seconds=enforcement.staleness_seconds,
            pressure_free_fraction=enforcement.pressure_free_fraction,
            mps_gpus=enforcement.mps_gpus,
            unallocated=enforcement.unallocated,
            limits=self.limit_policy(),
            self_pod_uid=self_pod_uid,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, for the one ``config_loaded`` log line at start."""
        return {
            section: {
                f.name: plain(getattr(getattr(self, section), f.name))
                for f in dataclasses.fields(cls)
            }
            for section, cls in SECTIONS.items()
        }


Key = tuple[str, str]
"""``(section, key)``: one setting."""

SECTIONS: Final[Mapping[str, type[Any]]] = {
    "node": NodeSettings,
    "enforcement": EnforcementSettings,
    "limits": LimitsSettings,
    "agent": AgentSettings,
    "metrics": MetricsSettings,
    "kube": KubeSettings,
    "nvml": NvmlSettings,
    "logging": LoggingSettings,
}
"""TOML section → its dataclass, in file order."""

_FILE_ONLY: Final = {("limits", "namespaces")}
"""Keys only the file sets (tables per namespace)."""


def settable_keys() -> list[Key]:
    """Every ``(section, key)`` settable by file, env or flag (namespaces: file only)."""
    return [
        (section, f.name)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if (section, f.name) not in _FILE_ONLY
    ]


def plain(value: object) -> object:
    """A settings value as TOML/JSON would hold it: tables recursively, then leaves."""
    if isinstance(value, NamespaceSettings):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return _plain_leaf(value)


def _plain_leaf(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, LimitValue):
        return f"{value.percent:g}%" if value.percent is not None else value.limit_bytes
    return value
