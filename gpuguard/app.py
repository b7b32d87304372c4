"""Wiring: the one place that builds concrete adapters and hands them to the runtime.

Owns ``run_enforce`` (the DaemonSet's main container) and the adapter construction the
``inspect`` and ``explain`` commands share. Reads settings through ``gpuguard.config`` and
nothing else from the environment. Must not contain decisions (core) or loop logic (runtime).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from gpuguard import logs
from gpuguard.adapters.metrics import MetricsServer, PrometheusRecorder, SnapshotCollector
from gpuguard.adapters.nvml import NullGpuSource, NvmlGpuSource
from gpuguard.adapters.procfs import ProcfsProcessResolver
from gpuguard.adapters.signals import PidfdKiller, check_host_pid_namespace
from gpuguard.config import LogFormat, Settings, load_settings, parse_listen_address
from gpuguard.core.model import PodEvent, PodUid, RefusalReason
from gpuguard.core.policy import Refusal
from gpuguard.errors import ConfigError, GpuguardError, PermanentError
from gpuguard.ports import EventSink, HealthRecorder, NodeDirectory, ReleasableGpuSource
from gpuguard.runtime.clock import SystemClock
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.runtime.tasks import run_all

log = structlog.get_logger(__name__)

MIG_PAUSE_STATES = frozenset({"pending", "rebooting"})
"""``nvidia.com/mig.config.state`` values during which NVML is released (DESIGN §2)."""


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from defaults < ``--config`` file < ``GPUGUARD_*`` env < command-line flags."""
    flags = {
        "enforcement.mode": getattr(args, "mode", None),
        "node.name": getattr(args, "node_name", None),
        "node.proc_root": getattr(args, "proc_root", None),
        "metrics.address": getattr(args, "metrics_address", None),
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
        health=health,
    )
    gpu = nvml if settings.nvml.fail_on_init_error else NullGpuSource(nvml, clock=clock.monotonic)
    gpu.acquire()
    return gpu


def build_resolver(settings: Settings) -> ProcfsProcessResolver:
    return ProcfsProcessResolver(settings.node.proc_root, check_gpu_fds=True)


def build_pod_directory(
    settings: Settings, *, pods_file: str | None, clock: SystemClock
) -> tuple[NodeDirectory, EventSink, Callable[[], None], Callable[[], GpuguardError | None]]:
    """The pod directory and Event sink, with their stop function and problem probe."""
    node_name = settings.node.name
    if not node_name:
        raise ConfigError(
            [
                "node.name is not set: pass --node-name, set GPUGUARD_NODE_NAME, or NODE_NAME "
                "from the downward API (spec.nodeName)"
            ]
        )
    if pods_file:
        from gpuguard.adapters.podfile import FilePodDirectory

        directory = FilePodDirectory(Path(pods_file), node_name=node_name, clock=clock)
        return directory, _LogEventSink(), lambda: None, lambda: None
    from gpuguard.adapters.kube import KubeEventSink, KubePodDirectory, load_api_client

    kubeconfig = settings.kube.kubeconfig
    api = load_api_client(str(kubeconfig) if kubeconfig else None)
    kube_dir = KubePodDirectory(
        api,
        node_name=node_name,
        clock=clock,
        watch_timeout_seconds=settings.kube.watch_timeout_seconds,
        connect_timeout_seconds=settings.kube.connect_timeout_seconds,
        inactivity_seconds=settings.kube.inactivity_seconds,
    )
    sink = KubeEventSink(
        api,
        node_name=node_name,
        clock=clock,
        request_timeout_seconds=settings.kube.request_timeout_seconds,
    )
    kube_dir.start()
    sink.start()

    def stop() -> None:
        sink.stop()
        kube_dir.stop()

    def problem() -> GpuguardError | None:
        return kube_dir.problem() or sink.problem()

    return kube_dir, sink, stop, problem


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


@dataclass(slots=True)
class _Pause:
    reason: str | None = None


def run_enforce(args: argparse.Namespace) -> int:
    """``gpuguard enforce``: returns the exit code."""
    settings = settings_from_args(args)
    configure_logging(settings)
    log.info("config_loaded", **settings.to_dict())
    pid_check = check_host_pid_namespace()
    if not pid_check.ok:
        # Still run (metrics, inspect-ability), but never signal: DESIGN §4 host-PID self-check.
        log.error("enforcement_refused", reason=pid_check.reason, detail=pid_check.detail)
    self_uid = os.environ.get("POD_UID")
    policy = settings.enforcement_policy(self_pod_uid=PodUid(self_uid) if self_uid else None)
    clock = SystemClock()
    gpu = build_gpu_source(settings, clock)
    directory, events, stop_directory, problem = build_pod_directory(
        settings, pods_file=getattr(args, "pods_file", None), clock=clock
    )
    registry = CollectorRegistry()
    collector = SnapshotCollector(hostname=settings.node.name or socket.gethostname())
    registry.register(collector)
    recorder = PrometheusRecorder(registry)
    address = parse_listen_address(settings.metrics.address)  # validated: cannot raise
    try:
        server = MetricsServer(
            registry=registry,
            collector=collector,
            host=address.host or "0.0.0.0",  # noqa: S104 — Prometheus scrapes the pod IP
            port=address.port,
        )
    except OSError as exc:
        stop_directory()
        raise PermanentError(
            f"metrics.address {settings.metrics.address}: cannot listen ({exc.strerror}); "
            "choose a free port with --metrics-address"
        ) from exc
    enforcer = Enforcer(
        gpu=gpu,
        resolver=build_resolver(settings),
        pods=directory,
        killer=PidfdKiller(
            cgroup_root=settings.node.cgroup_root,
            proc_root=settings.node.proc_root,
            use_cgroup_kill=settings.enforcement.use_cgroup_kill,
        ),
        events=events,
        recorder=recorder,
        publisher=collector,
        clock=clock,
        policy=policy,
        poll_interval_seconds=settings.enforcement.poll_interval_seconds,
        gpu_timeout_seconds=settings.nvml.call_timeout_seconds,
        blocked=None
        if pid_check.ok
        else Refusal(reason=RefusalReason.NOT_HOST_PID_NAMESPACE, detail=pid_check.detail),
    )
    server.start()
    log.info(
        "enforcer_started",
        node=settings.node.name,
        mode=policy.mode.value,
        metrics=f"http://{settings.metrics.address}/metrics",
        pid_namespace_ok=pid_check.ok,
    )
    try:
        return asyncio.run(_serve(enforcer, directory, gpu, problem))
    finally:
        server.stop()
        stop_directory()
        gpu.close()
        log.info("enforcer_stopped")


async def _serve(
    enforcer: Enforcer,
    directory: NodeDirectory,
    gpu: ReleasableGpuSource,
    problem: Callable[[], GpuguardError | None],
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    failure: list[GpuguardError] = []

    async def watch_problems() -> None:
        """A permanent problem (RBAC denied) before the first full sync stops the process with
        one clear message: the permission is missing from the start. After that a 403 is a
        passing state (an API server restarting with a cold RBAC cache, a binding being
        replaced): the directory keeps retrying, its cache goes stale and ``decide()`` pauses
        enforcement, so exiting would only lose the enforcer's state."""
        healthy_checks = 0  # started: synced with no problem at two checks in a row, so a
        started = False  # list allowed but a watch denied right after it still exits
        while not stop.is_set():
            p = problem()
            if not started:
                if isinstance(p, PermanentError):
                    failure.append(p)
                    stop.set()
                    return
                healthy_checks = healthy_checks + 1 if _directory_synced(directory) else 0
                started = healthy_checks >= 2
            await _sleep_or_stop(stop, 1.0)

    async def watch_mig() -> None:
        """Release NVML while mig-manager reconfigures (it needs every GPU handle closed)."""
        labels_of: Any = getattr(directory, "node_labels", None)
        if labels_of is None:  # a pods file has no Node to watch
            await stop.wait()
            return
        while not stop.is_set():
            labels = labels_of()
            state = getattr(labels, "mig_config_state", None)
            try:
                if state in MIG_PAUSE_STATES and not gpu.released:
                    log.warning("mig_reconfiguration_pause", state=state)
                    await asyncio.to_thread(gpu.release)
                elif state not in MIG_PAUSE_STATES and gpu.released:
                    log.info("mig_reconfiguration_resume", state=state)
                    await asyncio.to_thread(gpu.acquire)
            except GpuguardError as exc:  # a stuck sample or a failed re-init: next loop
                log.warning("mig_pause_toggle_failed", state=state, error=str(exc))
            await _sleep_or_stop(stop, 1.0)

    await run_all(
        {"enforce": lambda: enforcer.run(stop), "problems": watch_problems, "mig": watch_mig},
        stop,
    )
    if failure:
        log.error("enforcer_failed", error=str(failure[0]))
        raise failure[0]
    return 0


def _directory_synced(directory: NodeDirectory) -> bool:
    """The first pod list and, where there is one, the first Node list completed."""
    if not directory.snapshot().synced:
        return False
    labels_of: Any = getattr(directory, "node_labels", None)
    return labels_of is None or labels_of() is not None


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
