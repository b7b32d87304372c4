"""Wiring: the one place that builds concrete adapters and hands them to the runtime.

Owns ``run_enforce`` (the DaemonSet's main container) and the adapter construction the commands use
(``inspect``, ``explain``, ``demo``, ``check-sharing --kubeconfig``): a command reaches an adapter
only through a builder here (import-linter holds it). ``enforce`` and ``agent`` hold what they
open through ``startup.Startup``, as ``inspect`` and ``explain`` do. Reads settings through
``gpuguard.config`` and nothing else from the environment. Must not contain decisions (core) or
loop logic (runtime).

Size: over 600 lines, on purpose: the composition root: every command's adapters wired to the
runtime in one place, so what runs in production is read top to bottom here; each part it wires
lives elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry

from gpuguard import logs
from gpuguard.adapters.allocguard import GUARD_OBJECT
from gpuguard.adapters.allocguard import attach as attach_alloc_guard
from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.killer import PidfdKiller
from gpuguard.adapters.metrics import (
    AsyncioTasksCollector,
    MetricsRegistry,
    MetricsServer,
    PrometheusAgentRecorder,
    PrometheusGuardRecorder,
    PrometheusHealthRecorder,
    PrometheusRecorder,
    SnapshotCollector,
)
from gpuguard.adapters.nodelock import FlockNodeLock
from gpuguard.adapters.nvml import NullGpuSource, NvmlGpuSource
from gpuguard.adapters.podresources import build_allocation_source
from gpuguard.adapters.procfs import ProcfsProcessResolver, read_cgroup_text, read_process_name
from gpuguard.adapters.selfcheck import (
    SIGNAL_FIX,
    PrivilegeCheck,
    check_host_pid_namespace,
    check_privileges,
    check_proc_readable,
)
from gpuguard.config import (
    ListenAddress,
    LogFormat,
    Settings,
    load_settings,
    parse_listen_address,
)
from gpuguard.core.limits import enforces_anywhere
from gpuguard.core.model import (
    EnforcementPolicy,
    LimitSource,
    NodeLockState,
    PodEvent,
    PodUid,
    ProcessIdentity,
    RefusalReason,
)
from gpuguard.core.policy import Refusal
from gpuguard.errors import ConfigError, GpuguardError, PermanentError
from gpuguard.ports import (
    AllocationSource,
    Clock,
    FastGpuSource,
    FenceProbe,
    GuardRecorder,
    HealthRecorder,
    KubeWriteRecorder,
    Lifecycle,
    LiveEventSink,
    LiveNodeConditionWriter,
    LiveNodeDirectory,
    LiveNodeEventSink,
    LiveSharingSource,
    NodeLock,
    ProcessResolver,
    QuietGate,
    ReleasableGpuSource,
    Resumer,
    SharingSource,
)
from gpuguard.runtime.agent import Agent, AgentOptions
from gpuguard.runtime.allocations import AllocationReads, read_interval
from gpuguard.runtime.allocguard import GuardService
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.runtime.fence import FenceGate
from gpuguard.runtime.mig import follow_mig_state
from gpuguard.runtime.sampling import ChangeDrivenSampler
from gpuguard.runtime.supervise import fail_on_start_problems
from gpuguard.runtime.tasks import run_all
from gpuguard.startup import Startup

if TYPE_CHECKING:
    from gpuguard.adapters.kube.configmaps import ConfigMapState
    from gpuguard.core.sharing import NodeLabels

log = structlog.get_logger(__name__)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from defaults < ``--config`` file < ``GPUGUARD_*`` env < command-line flags."""
    metrics_key = "agent.metrics_address" if args.command == "agent" else "metrics.address"
    flags = {
        "enforcement.mode": getattr(args, "mode", None),
        "node.name": getattr(args, "node_name", None),
        "node.proc_root": getattr(args, "proc_root", None),
        metrics_key: getattr(args, "metrics_address", None),
        "agent.allow_eviction": getattr(args, "allow_eviction", None),
        "kube.kubeconfig": getattr(args, "kubeconfig", None),
        "logging.level": getattr(args, "log_level", None),
        "logging.format": getattr(args, "log_format", None),
    }
    return load_settings(
        config_path=Path(args.config) if getattr(args, "config", None) else None,
        overrides={k: v for k, v in flags.items() if v is not None},
        uses_api_server=not getattr(args, "pods_file", None),
    )


def configure_logging(settings: Settings) -> None:
    fmt = settings.logging.format
    logs.configure(
        level=settings.logging.level.value,
        json=None if fmt is LogFormat.AUTO else fmt is LogFormat.JSON,
    )


def build_gpu_source(
    settings: Settings, clock: SystemClock, *, health: HealthRecorder | None = None
) -> NvmlGpuSource | NullGpuSource:
    """NVML per settings, initialised; failed and timed-out NVML calls counted into ``health``.
    Raises ``GpuSourceUnavailable`` when it cannot start and ``nvml.fail_on_init_error`` is
    true; when false, a ``NullGpuSource`` samples nothing, says why and keeps retrying."""
    nvml = NvmlGpuSource(
        clock=clock.monotonic,
        library_path=settings.nvml.library_path,
        deadline_seconds=settings.nvml.call_timeout_seconds,
        graphics_processes=settings.nvml.graphics_processes,
        mps_processes=settings.nvml.mps_processes,
        native_gate=settings.nvml.native_gate,
        health=health,
    )
    gpu = nvml if settings.nvml.fail_on_init_error else NullGpuSource(nvml, clock=clock.monotonic)
    gpu.acquire()
    return gpu


def build_sampler(
    settings: Settings, gpu: FastGpuSource, clock: SystemClock, gate: QuietGate | None = None
) -> ChangeDrivenSampler:
    """Change-driven sampling per ``[enforcement]``: a fast read every
    ``fast_interval_seconds``, each device listed when its memory moved or at the latest every
    ``poll_interval_seconds``; with ``fast_interval_seconds = 0``, every device every poll.
    ``gate``: the native quiet gate between fast reads (only with a fast interval)."""
    enforcement = settings.enforcement
    poll = enforcement.poll_interval_seconds
    fast = enforcement.fast_interval_seconds
    if not fast:
        return ChangeDrivenSampler.polling(gpu, clock=clock.monotonic, poll_seconds=poll)
    return ChangeDrivenSampler(
        gpu,
        clock=clock.monotonic,
        step_bytes=enforcement.fast_step_bytes,
        max_age_seconds=poll,
        tick_seconds=fast,
        gate=gate,
    )


def build_resolver(settings: Settings, *, pin_processes: bool = False) -> ProcfsProcessResolver:
    """``pin_processes``: the enforcer's (it asks for the same PIDs every second); a one-shot
    command reads each PID once."""
    return ProcfsProcessResolver(
        settings.node.proc_root, check_gpu_fds=True, pin_processes=pin_processes
    )


def build_clock() -> SystemClock:
    """The real clock, for a command that builds adapters here."""
    return SystemClock()


def build_process_names(settings: Settings) -> Callable[[ProcessIdentity], str | None]:
    """``inspect``'s process names: each process's own, read from ``node.proc_root``."""
    return partial(read_process_name, settings.node.proc_root)


def build_pid_reads(
    proc_root: Path,
) -> tuple[ProcfsProcessResolver, Callable[[int], str | None]]:
    """``explain``'s reads of one PID under ``proc_root``: the resolver (one PID kept, GPU files
    checked) and the PID's cgroup text (``None``: gone; ``OSError``: unreadable)."""
    resolver = ProcfsProcessResolver(proc_root, cache_size=1, check_gpu_fds=True)
    return resolver, partial(read_cgroup_text, proc_root)


def node_name_of(settings: Settings) -> str:
    """This node's name, or a ``ConfigError`` saying how to set it."""
    if not settings.node.name:
        raise ConfigError(
            [
                "node.name is not set: pass --node-name, set GPUGUARD_NODE_NAME, or NODE_NAME "
                "from the downward API (spec.nodeName)"
            ]
        )
    return settings.node.name


def build_pod_directory(
    settings: Settings,
    *,
    pods_file: str | None,
    clock: SystemClock,
    health: HealthRecorder | None = None,
    api: Any = None,
    check_exempt_names: bool = False,
) -> LiveNodeDirectory:
    """The node's pods and Node, started (its first read under way; ``wait_synced`` waits for
    it). Read-only: no Event sink, so ``inspect`` and ``explain`` post nothing. A pods file that
    cannot be read raises ``ConfigError`` naming it. ``api``: a client to share with the sink.
    ``check_exempt_names``: log at start the names of ``limits.exempt_namespaces`` that no
    Namespace has (``enforce``; not with a pods file)."""
    node_name = node_name_of(settings)
    exempt_label = settings.limit_policy().exempt_label
    directory: LiveNodeDirectory
    if pods_file:
        from gpuguard.adapters.podfile import FilePodDirectory

        directory = FilePodDirectory(
            Path(pods_file), node_name=node_name, clock=clock, exempt_label=exempt_label
        )
    else:
        from gpuguard.adapters.kube import KubePodDirectory

        directory = KubePodDirectory(
            api if api is not None else kube_api(settings),
            node_name=node_name,
            clock=clock,
            health=health,
            watch_timeout_seconds=settings.kube.watch_timeout_seconds,
            connect_timeout_seconds=settings.kube.connect_timeout_seconds,
            inactivity_seconds=settings.kube.inactivity_seconds,
            dra=LimitSource.DRA in settings.limits.sources,
            exempt_label=exempt_label,
            check_exempt_names=settings.limits.exempt_namespaces if check_exempt_names else (),
        )
    directory.start()
    return directory


def build_event_sink(
    settings: Settings,
    *,
    pods_file: str | None,
    clock: SystemClock,
    health: HealthRecorder | None,
    api: Any = None,
) -> LiveEventSink:
    """Where ``enforce`` posts Events, started: the API server, or log lines with a pods file."""
    if pods_file:
        return _LogEventSink()
    from gpuguard.adapters.kube import KubeEventSink

    sink = KubeEventSink(
        api if api is not None else kube_api(settings),
        node_name=node_name_of(settings),
        clock=clock,
        health=health,
        request_timeout_seconds=settings.kube.request_timeout_seconds,
    )
    sink.start()
    return sink


def kube_api(settings: Settings) -> Any:
    """A Kubernetes API client per ``kube.kubeconfig`` (in-cluster when unset)."""
    from gpuguard.adapters.kube import load_api_client

    kubeconfig = settings.kube.kubeconfig
    return load_api_client(str(kubeconfig) if kubeconfig else None)


class ClusterReads:
    """``check-sharing --kubeconfig``'s one-shot reads of a cluster (``adapters.kube.reads``),
    over one client: the ConfigMaps a sharing config names and every Node's labels. Building it
    loads the Kubernetes client (a ``ConfigError`` for a kubeconfig it cannot use)."""

    def __init__(self, kubeconfig: str) -> None:
        from gpuguard.adapters.kube import load_api_client

        self._api = load_api_client(kubeconfig)

    def config_map(self, *, namespace: str, name: str) -> ConfigMapState:
        from gpuguard.adapters.kube.reads import read_config_map

        return read_config_map(self._api, namespace=namespace, name=name)

    def node_labels(self, *, most: int) -> list[NodeLabels]:
        from gpuguard.adapters.kube.reads import list_node_labels

        return list_node_labels(self._api, most=most)

    def close(self) -> None:
        self._api.close()  # type: ignore[no-untyped-call]


class _LogEventSink:
    """EventSink for runs without an API server: Events become log lines."""

    def post(self, event: PodEvent) -> None:
        log.warning(
            "pod_event",
            reason=event.reason.value,
            type=event.type,
            namespace=event.pod.namespace,
            pod=event.pod.name,
            message=event.message,
        )

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def wait_synced(self, timeout_seconds: float) -> bool:
        return True

    def problem(self) -> GpuguardError | None:
        return None


def run_enforce(args: argparse.Namespace) -> int:
    """``gpuguard enforce``: returns the exit code."""
    # From here to the event loop's own handler, the kubelet's SIGTERM ends start-up through the
    # closes (the node lock, the metrics server, NVML, the guard), not the default's abrupt end.
    _close_on_sigterm()
    settings = settings_from_args(args)
    configure_logging(settings)
    log.info("config_loaded", **settings.to_dict())
    self_uid = os.environ.get("POD_UID")
    policy = settings.enforcement_policy(self_pod_uid=PodUid(self_uid) if self_uid else None)
    checks = _self_checks(settings, policy)
    clock = SystemClock()
    node_name_of(settings)  # a missing node name is a config error before anything starts
    telemetry = build_telemetry(hostname=settings.node.name or socket.gethostname())
    recorder = telemetry.recorder
    address = parse_listen_address(settings.metrics.address)  # validated: cannot raise
    pods_file = getattr(args, "pods_file", None)
    with Startup() as startup:
        server = _metrics_server(settings, telemetry, address)
        startup.opened("metrics_server", server.stop)
        gpu = build_gpu_source(settings, clock, health=recorder)
        startup.opened("gpu", gpu.close)
        # Logged once all opened from here on is closed; NVML and the server, closed after it,
        # log nothing: it stays the last line.
        startup.on_exit(lambda: log.info("enforcer_stopped"))
        try:
            lock = FlockNodeLock(settings.enforcement.lock_file)
            startup.opened("node_lock", lock.release)
            first = take_node_lock(lock)
            api = None if pods_file else kube_api(settings)
            directory = build_pod_directory(
                settings, pods_file=pods_file, clock=clock, health=recorder, api=api,
                check_exempt_names=True,
            )  # fmt: skip
            startup.opened("pod_directory", directory.stop)
            events = build_event_sink(
                settings, pods_file=pods_file, clock=clock, health=recorder, api=api
            )
            startup.opened("event_sink", events.stop)
            allocations = build_allocation_reads(settings, clock)
            if allocations is not None:
                startup.opened("pod_resources", allocations.stop)
            enforcer = _enforcer(
                settings, startup, gpu=gpu, directory=directory, events=events,
                telemetry=telemetry, clock=clock, policy=policy, lock=lock,
                blocked=checks.blocked, allocations=allocations, api=api,
            )  # fmt: skip
            server.start()
            metrics = metrics_url(address.host or "0.0.0.0", server.port)  # noqa: S104 — as bound
            _log_started(
                settings, policy=policy, checks=checks, metrics=metrics, lock=first, gpu=gpu
            )
            return asyncio.run(
                _serve(
                    enforcer, directory, events, gpu, telemetry.registry,
                    follow_mig=pods_file is None,
                )
            )  # fmt: skip
        except PermanentError as exc:
            log.error("enforcer_failed", error=str(exc))
            raise


def _log_started(
    settings: Settings,
    *,
    policy: EnforcementPolicy,
    checks: _SelfChecks,
    metrics: str,
    lock: NodeLockState,
    gpu: NvmlGpuSource | NullGpuSource,
) -> None:
    """``enforcer_started``: what runs, and how (the self-checks, the lock, the fast reads)."""
    log.info(
        "enforcer_started",
        node=settings.node.name,
        mode=policy.mode.value,
        metrics=metrics,
        pid_namespace_ok=checks.pid_namespace_ok,
        can_signal=checks.can_signal,
        lock_file=lock.path,
        lock_held=lock.held,
        fast_reads=_fast_reads(settings, gpu),
    )


@dataclass(frozen=True, slots=True)
class _SelfChecks:
    blocked: Refusal | None
    """What refuses every signal (``Enforcer(blocked=...)``), or ``None``."""
    pid_namespace_ok: bool
    can_signal: bool


def _self_checks(settings: Settings, policy: EnforcementPolicy) -> _SelfChecks:
    """The host-PID-namespace and privilege self-checks at start, each finding logged once.
    Outside the host PID namespace, or without the privileges enforce mode needs, the enforcer
    still runs (metrics, inspect-ability) and never signals: docs/design.md, Safety invariants."""
    pid_check = check_host_pid_namespace()
    if not pid_check.ok:
        log.error("enforcement_refused", reason=pid_check.reason, detail=pid_check.detail)
    privileges = check_privileges()
    cannot_signal = refuse_without_privileges(privileges, policy, settings.node.proc_root)
    blocked = (
        cannot_signal
        if pid_check.ok
        else Refusal(reason=RefusalReason.NOT_HOST_PID_NAMESPACE, detail=pid_check.detail)
    )
    return _SelfChecks(blocked, pid_check.ok, privileges.can_signal)


def _metrics_server(
    settings: Settings, telemetry: Telemetry, address: ListenAddress
) -> MetricsServer:
    """The enforcer's metrics server, bound (not yet serving); a port it cannot take is a
    permanent error that names the setting and the flag."""
    try:
        # Prometheus scrapes the pod IP: all interfaces unless the admin says otherwise.
        return telemetry.server(host=address.host or "0.0.0.0", port=address.port)  # noqa: S104
    except OSError as exc:
        raise PermanentError(
            f"metrics.address {settings.metrics.address}: cannot listen ({exc.strerror}); "
            "choose a free port with --metrics-address"
        ) from exc


def _fast_reads(settings: Settings, gpu: NvmlGpuSource | NullGpuSource) -> str:
    """How the fast path reads memory, for ``enforcer_started``: ``native`` (the source has the
    quiet gate), ``python`` (not built, or ``nvml.native_gate`` is false) or ``off``."""
    if not settings.enforcement.fast_interval_seconds:
        return "off"
    return "native" if gpu.quiet_gate() is not None else "python"


def _enforcer(
    settings: Settings,
    startup: Startup,
    *,
    gpu: NvmlGpuSource | NullGpuSource,
    directory: LiveNodeDirectory,
    events: LiveEventSink,
    telemetry: Telemetry,
    clock: SystemClock,
    policy: EnforcementPolicy,
    lock: FlockNodeLock,
    blocked: Refusal | None,
    allocations: AllocationReads | None,
    api: Any = None,
) -> Enforcer:
    """The runtime enforcer on the real adapters (the killer, the resolver, the sampler); with
    ``api``, the writer of its Node condition. The writer and the killer are closed by
    ``startup`` (the writer's last word, "enforcer stopped", on the way out)."""
    condition = None if api is None else _condition_writer(settings, api, clock, telemetry.recorder)
    if condition is not None:
        startup.opened("node_condition", condition.stop)
    killer = PidfdKiller(
        cgroup_root=settings.node.cgroup_root,
        proc_root=settings.node.proc_root,
        use_cgroup_kill=settings.enforcement.use_cgroup_kill,
    )
    startup.opened("killer", killer.close)
    resolver = build_resolver(settings, pin_processes=True)
    guard = build_guard(
        settings,
        resolver=resolver,
        resumer=killer,
        recorder=PrometheusGuardRecorder(telemetry.registry),
        clock=clock,
        policy=policy,
    )
    if guard is not None:
        # Closed on every way out of ``enforce`` but SIGKILL: the thawer resumes every stop
        # before this process exits. Left to the thawer's own notice of our exit, a stop could
        # outlive the container, whose runtime kills what is left in it once its main process
        # is gone (docs/install.md, Allocation guard). ``Enforcer.run`` closes it too (idempotent).
        startup.opened("alloc_guard", guard.close)
    return Enforcer(
        sampler=build_sampler(settings, gpu, clock, gpu.quiet_gate()),
        resolver=resolver,
        pods=directory,
        killer=killer,
        events=events,
        recorder=telemetry.recorder,
        publisher=telemetry.collector,
        clock=clock,
        policy=policy,
        poll_interval_seconds=settings.enforcement.poll_interval_seconds,
        gpu_timeout_seconds=settings.nvml.call_timeout_seconds,
        lock=lock,
        blocked=blocked,
        allocations=allocations,
        condition=condition,
        guard=guard,
    )


def _close_on_sigterm() -> None:
    """SIGTERM raises ``SystemExit(0)`` until the event loop takes the signal over (``_serve``):
    Python's default for it ends the process with nothing closed, and the kubelet's SIGTERM can
    come while start-up is still running (``enforcer_started`` is logged just before the loop
    starts), the node lock held and the allocation guard attached."""

    def leave(_signum: int, _frame: object) -> None:
        # Nothing logged here: a handler writing to the log the main thread may be writing
        # to raises "reentrant call". ``enforcer_stopped`` follows the closes.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)


def build_guard(
    settings: Settings,
    *,
    resolver: ProcessResolver,
    resumer: Resumer,
    recorder: GuardRecorder,
    clock: Clock,
    policy: EnforcementPolicy,
) -> GuardService | None:
    """The allocation guard when ``enforcement.alloc_guard`` is on and it attaches; when it
    cannot, why is logged once and shown by ``gpuguard_alloc_guard_active 0`` (the polling
    loop stays the guard: never a reason to stop)."""
    if not settings.enforcement.alloc_guard:
        return None
    attached = attach_alloc_guard(
        object_path=GUARD_OBJECT,
        library_path=settings.enforcement.alloc_guard_library,
        cgroup_root=settings.node.cgroup_root,
    )
    if isinstance(attached, str):
        log.warning("alloc_guard_unavailable", reason=attached)
        recorder.set_guard_active(active=False, reason=attached.split(":", 1)[0])
        return None
    log.info("alloc_guard_attached", library=str(settings.enforcement.alloc_guard_library))
    recorder.set_guard_active(active=True, reason="")
    return GuardService(
        guard=attached,
        resolver=resolver,
        resumer=resumer,
        recorder=recorder,
        clock=clock,
        policy=policy,
    )


def build_allocation_reads(settings: Settings, clock: Clock) -> AllocationReads | None:
    """The kubelet's pod resources read off the loop (started); ``None`` when
    ``node.pod_resources_socket`` is off."""
    source = build_allocation_source(settings.node.pod_resources_socket, clock=clock)
    if source is None:
        return None
    reads = AllocationReads(source, interval=read_interval(settings.enforcement.staleness_seconds))
    reads.start()
    return reads


def build_allocation_source_for(settings: Settings, clock: Clock) -> AllocationSource | None:
    """The pod-resources reader ``inspect`` and ``explain`` read once (``None``: off)."""
    return build_allocation_source(settings.node.pod_resources_socket, clock=clock)


def _condition_writer(
    settings: Settings, api: Any, clock: SystemClock, health: KubeWriteRecorder
) -> LiveNodeConditionWriter:
    """The writer of the Node's ``GPUMemoryEnforced`` condition, started (docs/design.md, Node
    condition); its ``stop()`` writes "enforcer stopped"."""
    from gpuguard.adapters.kube.node_condition import KubeNodeConditionWriter

    writer = KubeNodeConditionWriter(
        api,
        node_name=node_name_of(settings),
        clock=clock,
        health=health,
        request_timeout_seconds=settings.kube.request_timeout_seconds,
    )
    writer.start()
    return writer


def refuse_without_privileges(
    privileges: PrivilegeCheck, policy: EnforcementPolicy, proc_root: Path
) -> Refusal | None:
    """The privilege self-check as what blocks every signal, each finding logged
    once at start. Without ``CAP_KILL`` the enforcer still runs (metrics, ``inspect``), but in
    enforce mode (global, or any namespace's) every violation is refused ``cannot_signal`` and
    it is not ready: the kernel would refuse each signal anyway. Audit mode signals nothing, so
    it is not blocked; the log says that enforce mode would be."""
    refusal = None
    if not privileges.can_signal:
        facts = {"reason": privileges.reason, "detail": privileges.detail, "fix": SIGNAL_FIX}
        if enforces_anywhere(policy.limits, policy.mode):
            log.error("enforcement_refused", **facts)
            refusal = Refusal(reason=RefusalReason.CANNOT_SIGNAL, detail=privileges.detail)
        else:
            log.warning("enforcement_would_be_refused", mode=policy.mode.value, **facts)
    if not privileges.reads_gpu_files:
        # Expected with the chart's KILL-only securityContext: not a fault, a known degradation.
        log.info(
            "gpu_files_unreadable",
            detail=(
                "without CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH, other users' /proc/<pid>/fd "
                "cannot be read: whether a GPU process holds a GPU device file is unknown, and "
                "its listed memory is charged to it at once, as if it held one (docs/safety.md, "
                "'Who owns what NVML lists')"
            ),
        )
    problem = check_proc_readable(proc_root)
    if problem is not None:
        log.warning(
            "proc_unreadable",
            detail=problem,
            consequence="GPU processes cannot be attributed to pods: their memory is reported "
            "unattributed and never enforced",
            fix="run the enforcer in the host PID namespace with the host's /proc, mounted "
            "without hidepid (node.proc_root)",
        )
    return refusal


def take_node_lock(lock: NodeLock) -> NodeLockState:
    """The node lock's first try: held, or held by another enforcer (the runtime stands by and
    tries again). Raises ``PermanentError`` when its file cannot be opened: running unlocked
    would let two enforcers on one node both act (reliability R3)."""
    state = lock.hold()
    if state.problem is not None:
        raise PermanentError(
            f"enforcement.lock_file {state.detail}: the enforcer takes this node lock before it "
            "acts, so that two on one node never both do. Make its directory writable (the "
            "chart mounts the host's /run/gpuguard there), or point enforcement.lock_file "
            "(env GPUGUARD_ENFORCEMENT_LOCK_FILE) at a file in a host directory every enforcer "
            "on this node shares"
        )
    return state


AGENT_EVENT_BURST = 20
"""Node Events the agent may post at once: a MIG change is several steps (labels applied,
waiting for the cordon, for the pods, for mig-manager, the outcome), each reported once, and
the outcome must not be the one the rate limit drops."""
AGENT_EVENT_REFILL_SECONDS = 3.0


@dataclass(frozen=True, slots=True)
class AgentParts:
    """The agent and the two background sources it reads and reports through (not started)."""

    agent: Agent
    source: LiveSharingSource
    events: LiveNodeEventSink


def build_agent(
    api: Any,
    *,
    node_name: str,
    sharing_namespace: str,
    sharing_name: str,
    options: AgentOptions,
    clock: Clock,
    registry: CollectorRegistry,
    watch_timeout_seconds: float = 60.0,
    connect_timeout_seconds: float = 5.0,
    inactivity_seconds: float = 15.0,
) -> AgentParts:
    """The sharing agent over the API server, its metrics on ``registry`` (the agent's own and
    the health counters): what ``gpuguard agent`` runs and its tests drive."""
    from gpuguard.adapters.kube.agent import KubeNodeWriter, KubeSharingSource
    from gpuguard.adapters.kube.events import KubeEventSink

    health = PrometheusHealthRecorder(registry)
    source = KubeSharingSource(
        api,
        node_name=node_name,
        sharing_namespace=sharing_namespace,
        sharing_name=sharing_name,
        health=health,
        watch_timeout_seconds=watch_timeout_seconds,
        connect_timeout_seconds=connect_timeout_seconds,
        inactivity_seconds=inactivity_seconds,
    )
    events = KubeEventSink(
        api,
        node_name=node_name,
        clock=clock,
        health=health,
        per_pod_burst=AGENT_EVENT_BURST,
        per_pod_refill_seconds=AGENT_EVENT_REFILL_SECONDS,
    )
    agent = Agent(
        source=source,
        writer=KubeNodeWriter(api, node_name=node_name),
        events=events,
        recorder=PrometheusAgentRecorder(registry, node=node_name),
        clock=clock,
        options=options,
    )
    return AgentParts(agent=agent, source=source, events=events)


def run_agent(args: argparse.Namespace) -> int:
    """``gpuguard agent``: returns the exit code."""
    settings = settings_from_args(args)
    configure_logging(settings)
    log.info("config_loaded", **settings.to_dict())
    node_name = node_name_of(settings)
    registry = MetricsRegistry()
    api = kube_api(settings)
    parts = build_agent(
        api,
        node_name=node_name,
        sharing_namespace=settings.agent.sharing_namespace,
        sharing_name=settings.agent.sharing_name,
        options=AgentOptions(
            allow_eviction=settings.agent.allow_eviction,
            keep_cordon_on_failure=settings.agent.keep_cordon_on_failure,
            interval_seconds=settings.agent.interval_seconds,
            min_write_interval_seconds=settings.agent.min_write_interval_seconds,
        ),
        clock=SystemClock(),
        registry=registry,
        watch_timeout_seconds=settings.kube.watch_timeout_seconds,
        connect_timeout_seconds=settings.kube.connect_timeout_seconds,
        inactivity_seconds=settings.kube.inactivity_seconds,
    )
    agent, source, events = parts.agent, parts.source, parts.events
    fence = FenceGate(build_fence_probe(api, node_name=node_name))
    address = parse_listen_address(settings.agent.metrics_address)
    with Startup() as startup:
        try:
            server = MetricsServer(
                registry=registry,
                ready=lambda: agent.ready() if fence.passed else fence.ready(),
                host=address.host or "0.0.0.0",  # noqa: S104 - Prometheus scrapes the pod IP
                port=address.port,
            )
        except OSError as exc:
            raise PermanentError(
                f"agent.metrics_address {settings.agent.metrics_address}: cannot listen "
                f"({exc.strerror}); choose a free port with --metrics-address"
            ) from exc
        # Logged once all is closed: registered before anything it follows.
        startup.on_exit(lambda: log.info("agent_stopped"))
        startup.opened("metrics_server", server.stop)
        source.start()
        startup.opened("sharing_source", source.stop)
        events.start()
        startup.opened("event_sink", events.stop)
        server.start()
        log.info(
            "agent_started",
            node=node_name,
            sharing=f"{settings.agent.sharing_namespace}/{settings.agent.sharing_name}",
            allow_eviction=settings.agent.allow_eviction,
            metrics=metrics_url(address.host or "0.0.0.0", server.port),  # noqa: S104 — as bound
        )
        return asyncio.run(_serve_agent(agent, fence, source, events, registry))


def build_fence_probe(api: Any, *, node_name: str) -> FenceProbe:
    """The agent's start-up check of its admission fence (a dry-run patch of its Node)."""
    from gpuguard.adapters.kube.fence import KubeFenceProbe

    return KubeFenceProbe(api, node_name=node_name)


async def _agent_behind_fence(agent: Agent, fence: FenceGate, stop: asyncio.Event) -> None:
    """The agent's turns, once its admission fence is in force (nothing written before)."""
    if await fence.wait(stop):
        await agent.run(stop)


async def _serve_agent(
    agent: Agent,
    fence: FenceGate,
    source: SharingSource,
    events: Lifecycle,
    registry: CollectorRegistry,
) -> int:
    """The agent's tasks until SIGTERM/SIGINT; a task's ``PermanentError`` ends it. The agent
    turns only once its admission fence is in force (``FenceGate``)."""
    return await _until_signalled(
        lambda stop: {
            "agent": lambda: _agent_behind_fence(agent, fence, stop),
            "problems": lambda: fail_on_start_problems(
                lambda: source.inputs().synced, (source, events), stop
            ),
        },
        registry,
    )


async def _until_signalled(
    tasks: Callable[[asyncio.Event], Mapping[str, Callable[[], Awaitable[None]]]],
    registry: CollectorRegistry,
) -> int:
    """Run ``tasks(stop)`` (``run_all``) until SIGTERM or SIGINT sets ``stop``; 0 then. The
    loop's task count is served on ``registry`` (``gpuguard_asyncio_tasks``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    registry.register(AsyncioTasksCollector(loop))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run_all(tasks(stop), stop)
    return 0


def metrics_url(host: str, port: int) -> str:
    """The metrics URL as bound (port 0 resolved, IPv6 in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/metrics"


@dataclass(frozen=True, slots=True)
class Telemetry:
    """Metrics for one process: the registry, the snapshot collector (``ports.Publisher``) and
    the recorder (``ports.MetricsRecorder`` and ``ports.HealthRecorder``)."""

    registry: CollectorRegistry
    collector: SnapshotCollector
    recorder: PrometheusRecorder

    def server(self, *, host: str, port: int) -> MetricsServer:
        """``/metrics``, ``/healthz``, ``/readyz`` on ``host:port``, not yet started. Raises
        ``OSError`` when the address cannot be bound."""
        return MetricsServer(registry=self.registry, collector=self.collector, host=host, port=port)

    def agent_recorder(self, *, node: str) -> PrometheusAgentRecorder:
        """The sharing agent's metrics for ``node`` (``ports.AgentRecorder``), on this registry."""
        return PrometheusAgentRecorder(self.registry, node=node)


def build_telemetry(*, hostname: str) -> Telemetry:
    registry = MetricsRegistry()
    collector = SnapshotCollector(hostname=hostname, changed=registry.changed)
    registry.register(collector)
    recorder = PrometheusRecorder(registry, hostname=hostname)
    return Telemetry(registry=registry, collector=collector, recorder=recorder)


async def _serve(
    enforcer: Enforcer,
    directory: LiveNodeDirectory,
    events: LiveEventSink,
    gpu: ReleasableGpuSource,
    registry: CollectorRegistry,
    *,
    follow_mig: bool,
) -> int:
    """The enforcer's tasks until SIGTERM/SIGINT; a task's ``PermanentError`` ends it.
    ``follow_mig``: follow the Node's MIG config state (a pods file has no Node, so no state
    to follow: its look once a second was a wake-up of an idle enforcer for nothing)."""

    def tasks(stop: asyncio.Event) -> dict[str, Callable[[], Awaitable[None]]]:
        running: dict[str, Callable[[], Awaitable[None]]] = {
            "enforce": lambda: enforcer.run(stop),
            "problems": lambda: fail_on_start_problems(
                lambda: directory.snapshot().synced and directory.node().seen,
                (directory, events),
                stop,
            ),
        }
        if follow_mig:
            running["mig"] = lambda: follow_mig_state(directory, gpu, stop)
        return running

    return await _until_signalled(tasks, registry)
