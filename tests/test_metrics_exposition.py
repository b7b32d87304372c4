"""The ``/metrics`` exposition (``gpuguard.adapters.metrics.collectors.Exposition``): rendered once
per change, and exact for everything recorded before a scrape began; the per-pod series of a pod
with a DRA share on the GPU carry dcgm-exporter's DRA labels. No sockets: the HTTP server is
tests/test_metrics_server.py's.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gpuguard.adapters.metrics import (
    EXPOSITION_MAX_AGE_SECONDS,
    Exposition,
    MetricsRegistry,
    PrometheusAgentRecorder,
    PrometheusHealthRecorder,
    PrometheusRecorder,
    SnapshotCollector,
)
from gpuguard.core.model import (
    Attribution,
    Declaration,
    DraShare,
    EnforcementPolicy,
    GpuDevice,
    GpuProcess,
    LimitPolicy,
    LimitSource,
    Mode,
    NodeFacts,
    Pod,
    PodRef,
    PodUid,
    RefusalReason,
    Trigger,
)
from gpuguard.core.policy import Decision, EnforcerState, UnallocatedUse, decide
from gpuguard.core.reconcile import ReconcileError, WaitReason
from tests import fakes
from tests.fakes import GiB, attr, gpu, pod, proc, sample, snapshot
from tests.promtools import tool


class _CountingCollector(Collector):
    """Counts how often the registry is rendered (each rendering collects every collector)."""

    def __init__(self) -> None:
        self.renders = 0

    def collect(self) -> Iterable[Metric]:
        self.renders += 1
        yield GaugeMetricFamily("test_renders", "renderings so far", value=float(self.renders))


def _telemetry() -> tuple[MetricsRegistry, SnapshotCollector, PrometheusRecorder]:
    registry = MetricsRegistry()
    collector = SnapshotCollector(hostname="n", changed=registry.changed)
    registry.register(collector)
    return registry, collector, PrometheusRecorder(registry, hostname="n")


def test_scrapes_with_no_change_between_them_share_one_rendering() -> None:
    registry, _, _ = _telemetry()
    counting = _CountingCollector()
    registry.register(counting)
    exposition = Exposition(registry)
    bodies = {exposition.body() for _ in range(200)}
    assert len(bodies) == 1
    assert counting.renders == 1


def test_a_rendering_older_than_the_bound_is_rendered_again_for_values_no_recorder_notes() -> None:
    registry, _, _ = _telemetry()
    counting = _CountingCollector()
    registry.register(counting)
    now = [100.0]
    exposition = Exposition(registry, clock=lambda: now[0])
    exposition.body()
    now[0] += EXPOSITION_MAX_AGE_SECONDS - 0.01
    exposition.body()
    assert counting.renders == 1
    now[0] += 0.02
    assert b"test_renders 2.0" in exposition.body()


def _agent_recorder(registry: MetricsRegistry) -> PrometheusAgentRecorder:
    found = [c for c in registry._collector_to_names if isinstance(c, PrometheusAgentRecorder)]
    return found[0] if found else PrometheusAgentRecorder(registry, node="n")


CHANGES: dict[str, Callable[[MetricsRegistry, SnapshotCollector, PrometheusRecorder], None]] = {
    "observe_poll": lambda r, c, rec: rec.observe_poll(0.003),
    "count_violation": lambda r, c, rec: rec.count_violation(Trigger.GRACE),
    "count_kill": lambda r, c, rec: rec.count_kill(fakes.kill_target(1, fakes.gpu()), wall_time=5),
    "count_refusal": lambda r, c, rec: rec.count_refusal(RefusalReason.EXEMPT),
    "count_unallocated": lambda r, c, rec: rec.count_unallocated(
        UnallocatedUse(
            pod=PodRef(uid=PodUid("u"), namespace="ns", name="p"),
            device=fakes.gpu(),
            containers=("main",),
            used_bytes=1,
            allocated="no GPU",
        )
    ),
    "count_event_dropped": lambda r, c, rec: rec.count_event_dropped("rate_limit"),
    "count_watch_restart": lambda r, c, rec: rec.count_watch_restart("pods", "expired"),
    "count_nvml_error": lambda r, c, rec: rec.count_nvml_error("nvmlDeviceGetMemoryInfo"),
    "count_kube_write_error": lambda r, c, rec: rec.count_kube_write_error("nodes/status"),
    "publish": lambda r, c, rec: c.publish(
        Decision(state=EnforcerState()), wall_time=7.0, ready=True, reason="ok"
    ),
    "show_labels": lambda r, c, rec: _agent_recorder(r).show_labels(
        rule="a", device_plugin_config="b", mig_config=None
    ),
    "count_reconcile_error": lambda r, c, rec: _agent_recorder(r).count_reconcile_error(
        ReconcileError.CONFIG_INVALID
    ),
    "set_waiting": lambda r, c, rec: _agent_recorder(r).set_waiting(WaitReason.GPU_PODS),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_recorded_change_is_in_the_very_next_scrape(change: str) -> None:
    """The class of defect: a recorder method that changes a value without noting it would serve
    the rendering from before the change. Every method of every recorder is listed here."""
    registry, collector, recorder = _telemetry()
    _agent_recorder(registry)
    exposition = Exposition(registry)
    before = exposition.body()
    assert exposition.body() == before  # served from the rendering
    CHANGES[change](registry, collector, recorder)
    assert exposition.body() != before


def test_the_changes_table_covers_every_recording_method() -> None:
    recording = {
        name
        for cls in (PrometheusRecorder, PrometheusAgentRecorder, SnapshotCollector)
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("_") and name not in ("collect", "describe")
    } | {name for name in vars(PrometheusHealthRecorder) if name.startswith("count_")}
    assert recording == set(CHANGES)


def test_concurrent_scrapes_never_see_less_than_was_recorded_before_they_began() -> None:
    registry, _, recorder = _telemetry()
    exposition = Exposition(registry)
    failures: list[str] = []
    done = threading.Event()

    def writer() -> None:
        while not done.is_set():
            recorder.count_refusal(RefusalReason.EXEMPT)

    def reader() -> None:
        for _ in range(300):
            floor = registry.get_sample_value("gpuguard_refusals_total", {"reason": "exempt"})
            seen = next(
                s.value
                for f in text_string_to_metric_families(exposition.body().decode())
                for s in f.samples
                if s.name == "gpuguard_refusals_total" and s.labels == {"reason": "exempt"}
            )
            if floor is None or seen < floor:
                failures.append(f"scrape saw {seen}, {floor} were recorded before it began")

    threads = [threading.Thread(target=writer) for _ in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads[2:]:
        t.join()
    done.set()
    for t in threads[:2]:
        t.join()
    assert failures == []


def test_a_plain_registry_is_rendered_at_every_scrape() -> None:
    registry = CollectorRegistry()
    counting = _CountingCollector()
    registry.register(counting)
    exposition = Exposition(registry)
    for _ in range(3):
        exposition.body()
    assert counting.renders == 3


# -- dcgm-exporter's DRA labels on the per-pod series ---------------------------------------------

DRA_LABELS = (
    "dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name",
)  # fmt: skip
NO_DRA = dict.fromkeys(DRA_LABELS, "")


def _dra_share(
    claim: str, request: str = "gpu", *, on: GpuDevice, memory: int = 4 * GiB, share: str = "s1"
) -> DraShare:
    """A result of ResourceClaim ``team/claim`` as NVIDIA's driver allocates a memory share."""
    return DraShare(
        claim_namespace="team",
        claim_name=claim,
        request=request,
        driver="gpu.nvidia.com",
        pool="node-1",
        device=f"gpu-{on.index}",
        share_id=share,
        memory_bytes=memory,
        uuid=on.uuid,
    )


DRA_POLICY = EnforcementPolicy(
    mode=Mode.ENFORCE, grace_seconds=2.0, limits=LimitPolicy(sources=("gpuguard", "dra"))
)


@dataclass
class _Node:
    """``decide()`` one listing a second, its state carried, as the enforcer calls it."""

    devices: list[GpuDevice]
    pods: list[Pod]
    attributions: dict[int, Attribution]
    state: EnforcerState = field(default_factory=EnforcerState)
    now: float = 100.0
    decisions: list[Decision] = field(default_factory=list)

    def step(self, procs: list[GpuProcess]) -> Decision:
        self.now += 1.0
        decision = decide(
            sample=sample(len(self.decisions) + 1, self.now, self.devices, procs),
            attributions=self.attributions,
            pods=snapshot(self.pods, contact=self.now),
            node=NodeFacts(name="node-1"),
            policy=DRA_POLICY,
            state=self.state,
            now=self.now,
        )
        self.state = decision.state
        self.decisions.append(decision)
        return decision


def _dra_pod(n: int, *shares: DraShare, read_at: float | None = 0.0) -> Pod:
    declared = Declaration(where="resourceClaims", shares=shares, read_at=read_at)
    return replace(pod(n), declared={LimitSource.DRA: declared})


def _per_pod_series(body: bytes, family: str) -> dict[str, dict[str, str]]:
    """``family``'s series in a scraped body, by pod name: each one's labels."""
    found: dict[str, dict[str, str]] = {}
    for parsed in text_string_to_metric_families(body.decode()):
        for s in parsed.samples:
            if s.name == family:
                assert s.labels["pod"] not in found, f"two {family} series for {s.labels['pod']}"
                found[s.labels["pod"]] = s.labels
    return found


def _dra_of(labels: dict[str, str]) -> dict[str, str]:
    return {name: labels[name] for name in DRA_LABELS}


def test_per_pod_series_carry_the_claim_and_device_of_the_dra_share_on_their_gpu() -> None:
    """Pods judged by the real ``decide()`` on a DRA node, scraped from the real registry:
    pod-1 has one 4Gi share of gpu-0; pod-2 only gpuguard's annotation; pod-3 three shares of
    gpu-0 met in no order (the series names the first by claim namespace, name, request);
    pod-4 a share of gpu-1 only, and runs on gpu-0 (its series there name no claim); pod-5 a
    share of gpu-1 and one of a device no ResourceSlice names (its limit is unresolved
    everywhere; its series on gpu-0 name neither: one is elsewhere, the other unknown)."""
    g0, g1 = gpu(0), gpu(1)
    pods = [
        _dra_pod(1, replace(_dra_share("gpu-abc", on=g0), pool="node-7")),
        pod(2, limit=8 * GiB),
        _dra_pod(
            3,
            _dra_share("beta", on=g0, memory=GiB),
            _dra_share("alpha", "gpu-2", on=g0, memory=GiB, share="s2"),
            _dra_share("alpha", "gpu-1", on=g0, memory=GiB, share="s3"),
        ),
        _dra_pod(4, _dra_share("elsewhere", on=g1)),
        _dra_pod(
            5,
            _dra_share("elsewhere", on=g1),
            replace(_dra_share("unnamed", on=g0), device="gpu-9", uuid=None),
        ),
    ]
    t = _Node(
        devices=[g0, g1],
        pods=pods,
        attributions={100 + n: attr(100 + n, pod_n=n) for n in range(1, 6)},
    )
    decision = t.step([proc(100 + n, g0, GiB) for n in range(1, 6)])
    registry, collector, _ = _telemetry()
    collector.publish(decision, wall_time=7.0, ready=True, reason="ok")
    body = Exposition(registry).body()

    used = _per_pod_series(body, "gpuguard_pod_gpu_memory_used_bytes")
    limit = _per_pod_series(body, "gpuguard_pod_gpu_memory_limit_bytes")
    assert set(used) == {"pod-1", "pod-2", "pod-3", "pod-4", "pod-5"}
    assert set(limit) == {"pod-1", "pod-2", "pod-3"}, "pod-4 and pod-5 have none on gpu-0"
    assert _dra_of(used["pod-1"]) == {
        "dra_claim_name": "gpu-abc",
        "dra_claim_namespace": "team",
        "dra_driver_name": "gpu.nvidia.com",
        "dra_pool_name": "node-7",
        "dra_device_name": "gpu-0",
    }
    assert limit["pod-1"] == used["pod-1"], "used and limit join one to one"
    assert (used["pod-1"]["UUID"], used["pod-1"]["pod"]) == (g0.uuid, "pod-1")
    assert _dra_of(used["pod-2"]) == NO_DRA
    assert limit["pod-2"] == used["pod-2"]
    assert (used["pod-3"]["dra_claim_name"], limit["pod-3"]["dra_claim_name"]) == ("alpha",) * 2
    assert decision.usages[2].limit.limit_bytes == 3 * GiB, "all three shares are its limit"
    assert _dra_of(used["pod-4"]) == NO_DRA
    assert decision.usages[4].limit.errors, "pod-5's limit is unresolved"
    assert _dra_of(used["pod-5"]) == NO_DRA


def test_the_sorted_first_share_is_named_whatever_order_the_claims_were_read_in() -> None:
    g0 = gpu(0)
    shares = [
        _dra_share("beta", on=g0),
        _dra_share("alpha", "gpu-2", on=g0, share="s2"),
        _dra_share("alpha", "gpu-1", on=g0, share="s3"),
    ]
    named = set()
    for order in ((0, 1, 2), (2, 1, 0), (1, 2, 0)):
        t = _Node(
            devices=[g0],
            pods=[_dra_pod(1, *(shares[i] for i in order))],
            attributions={101: attr(101, pod_n=1)},
        )
        registry, collector, _ = _telemetry()
        collector.publish(t.step([proc(101, g0, GiB)]), wall_time=7.0, ready=True, reason="ok")
        labels = _per_pod_series(Exposition(registry).body(), "gpuguard_pod_gpu_memory_used_bytes")
        named.add((labels["pod-1"]["dra_claim_name"], labels["pod-1"]["dra_device_name"]))
    assert named == {("alpha", "gpu-0")}


def test_the_kill_series_of_a_stop_over_a_dra_share_names_the_share() -> None:
    """The stop ``decide()`` orders carries the share to ``count_kill``: the kill alert's series
    joins dcgm-exporter's on the claim as the pod's usage series do."""
    g0 = gpu(0)
    p = _dra_pod(1, _dra_share("gpu-abc", on=g0), read_at=None)
    t = _Node(
        devices=[g0],
        pods=[p],
        attributions={101: attr(101, pod_n=1), 102: attr(102, pod_n=2)},
    )
    t.pods.append(pod(2, limit=GiB))  # over its annotation: stopped too, with no claim
    for _ in range(3):  # two listings and the grace period: due; the claims are read again
        t.step([proc(101, g0, 6 * GiB), proc(102, g0, 2 * GiB)])
    t.pods[0] = replace(
        p, declared={LimitSource.DRA: replace(p.declared[LimitSource.DRA], read_at=t.now)}
    )
    t.step([proc(101, g0, 6 * GiB), proc(102, g0, 2 * GiB)])
    stops = [a.target for d in t.decisions for a in d.signals]
    assert sorted(target.pod.name for target in stops) == ["pod-1", "pod-2"]

    registry, _, recorder = _telemetry()
    for target in stops:
        recorder.count_kill(target, wall_time=time.time())
    kills = _per_pod_series(Exposition(registry).body(), "gpuguard_pod_last_kill_timestamp_seconds")
    assert _dra_of(kills["pod-1"]) == {
        "dra_claim_name": "gpu-abc",
        "dra_claim_namespace": "team",
        "dra_driver_name": "gpu.nvidia.com",
        "dra_pool_name": "node-1",
        "dra_device_name": "gpu-0",
    }
    assert _dra_of(kills["pod-2"]) == NO_DRA


REPO = Path(__file__).resolve().parents[1]


def _series_line(name: str, labels: dict[str, str]) -> str:
    """A promtool series of a scraped sample, as Prometheus stores it: an empty label is no
    label, and the target adds ``job`` and ``instance``."""
    kept = {"job": "gpuguard", "instance": "10.0.0.5:9410"} | {
        k: v for k, v in labels.items() if v != ""
    }
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(kept.items())) + "}"


@pytest.mark.tools
def test_the_near_limit_alert_fires_for_a_dra_pod_and_its_series_join_dcgm_exporters(
    tmp_path: Path,
) -> None:
    """On Prometheus 3.16's ``promtool test rules``: the series of a real scrape (pod-1 at 95 %
    of its 4Gi DRA share, pod-2 at 1Gi of its annotation's 8Gi) fire the shipped
    ``GPUGuardPodNearGPUMemoryLimit`` for pod-1 only, the alert carrying the claim; and pod-1's
    limit joins on the claim and device the series dcgm-exporter writes for that claim (the
    shape of the Kubernetes docs' ``KubeletPodResourcesDynamicResources`` example), not those of
    another claim on the same GPU."""
    promtool = tool("promtool")
    g0 = gpu(0)
    t = _Node(
        devices=[g0],
        pods=[_dra_pod(1, _dra_share("gpu-abc", on=g0)), pod(2, limit=8 * GiB)],
        attributions={101: attr(101, pod_n=1), 102: attr(102, pod_n=2)},
    )
    decision = t.step([proc(101, g0, 4 * GiB * 95 // 100), proc(102, g0, GiB)])
    registry, collector, _ = _telemetry()
    collector.publish(decision, wall_time=7.0, ready=True, reason="ok")
    series = [
        {"series": _series_line(s.name, s.labels), "values": f"{s.value:.0f}x20"}
        for family in text_string_to_metric_families(Exposition(registry).body().decode())
        for s in family.samples
        if s.name.startswith("gpuguard_pod_gpu_memory_")
    ]
    assert len(series) == 4
    dcgm = 'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="{uuid}",device="nvidia0",Hostname="node-1",container="c0",dra_claim_name="{claim}",dra_claim_namespace="team",dra_device_name="gpu-0",dra_driver_name="gpu.nvidia.com",dra_pool_name="node-1",namespace="team",pod="{pod}"}}'  # noqa: E501
    series += [
        {"series": dcgm.format(uuid=g0.uuid, claim="gpu-abc", pod="pod-1"), "values": "3891x20"},
        {"series": dcgm.format(uuid=g0.uuid, claim="gpu-zzz", pod="other"), "values": "100x20"},
    ]
    dra = {
        "dra_claim_name": "gpu-abc",
        "dra_claim_namespace": "team",
        "dra_driver_name": "gpu.nvidia.com",
        "dra_pool_name": "node-1",
        "dra_device_name": "gpu-0",
    }
    pod_1 = {
        "job": "gpuguard",
        "instance": "10.0.0.5:9410",
        "namespace": "team",
        "pod": "pod-1",
        "pod_uid": str(decision.usages[0].pod.uid),
        "container": "c0",
        "gpu": "0",
        "UUID": g0.uuid,
        "hostname": "n",
        **dra,
    }
    unit = {
        "rule_files": [str(REPO / "helm" / "gpuguard" / "files" / "alerts.yaml")],
        "evaluation_interval": "30s",
        "tests": [
            {
                "interval": "30s",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": 'ALERTS{alertname="GPUGuardPodNearGPUMemoryLimit",'
                        'alertstate="firing"}',
                        "eval_time": "6m",
                        "exp_samples": [
                            {
                                "labels": _series_line(
                                    "ALERTS",
                                    pod_1
                                    | {
                                        "alertname": "GPUGuardPodNearGPUMemoryLimit",
                                        "alertstate": "firing",
                                        "severity": "info",
                                    },
                                ),
                                "value": 1,
                            }
                        ],
                    },
                    {
                        "expr": "gpuguard_pod_gpu_memory_limit_bytes and on (UUID, "
                        + ", ".join(DRA_LABELS)
                        + ") DCGM_FI_DEV_FB_USED",
                        "eval_time": "1m",
                        "exp_samples": [
                            {
                                "labels": _series_line(
                                    "gpuguard_pod_gpu_memory_limit_bytes", pod_1
                                ),
                                "value": 4 * GiB,
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "dra.test.yaml"
    path.write_text(yaml.safe_dump(unit, width=1000))
    done = subprocess.run(
        [str(promtool), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _bound_series(body: bytes) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """``gpuguard_gpu_memory_bound_bytes`` by (UUID, bound_by) and ``gpuguard_pods_unbounded``
    by UUID in a scraped body; every series' labels checked against the contract's."""
    bound: dict[tuple[str, str], float] = {}
    unbounded: dict[str, float] = {}
    for parsed in text_string_to_metric_families(body.decode()):
        for s in parsed.samples:
            if s.name == "gpuguard_gpu_memory_bound_bytes":
                assert set(s.labels) == {"gpu", "UUID", "GPU_I_ID", "hostname", "bound_by"}
                assert s.labels["hostname"] == "n"
                bound[(s.labels["UUID"], s.labels["bound_by"])] = s.value
            elif s.name == "gpuguard_pods_unbounded":
                assert set(s.labels) == {"gpu", "UUID", "GPU_I_ID", "hostname"}
                unbounded[s.labels["UUID"]] = s.value
    return bound, unbounded


BOUND_BY_VALUES = (
    "annotation", "default", "namespace_max", "kai", "hami", "gpushare", "volcano", "dra",
    "replicas", "none", "unattributed",
)  # fmt: skip
"""docs/design.md's list, spelled out: a renamed value breaks every alert on it."""


def test_each_gpus_memory_is_scraped_by_what_bounds_it_every_value_present_at_zero() -> None:
    """Pods judged by the real ``decide()``, scraped from the real registry: gpu-0 holds
    pod-1 (8Gi annotation), pod-2 (a DRA share), pod-3 (no limit), a host process; gpu-1 is
    idle. Each GPU's values sum to its attributed and unattributed memory; pod-3 is unbounded.
    Next cycle pod-3 is gone: its memory and its count leave the scrape with it."""
    g0, g1 = gpu(0), gpu(1)
    pods = [pod(1, limit=8 * GiB), _dra_pod(2, _dra_share("c", on=g0)), pod(3)]
    t = _Node(
        devices=[g0, g1],
        pods=pods,
        attributions={pid: attr(pid, pod_n=n) for pid, n in ((101, 1), (102, 2), (103, 3))}
        | {200: attr(200, pod_n=None)},
    )
    host = proc(200, g0, 3 * GiB)
    registry, collector, _ = _telemetry()
    collector.publish(
        t.step([proc(101, g0, 2 * GiB), proc(102, g0, 1 * GiB), proc(103, g0, 5 * GiB), host]),
        wall_time=7.0,
        ready=True,
        reason="ok",
    )
    bound, unbounded = _bound_series(Exposition(registry).body())

    assert set(bound) == {(g.uuid, v) for g in (g0, g1) for v in BOUND_BY_VALUES}
    on_g0 = {v: bound[(g0.uuid, v)] for v in BOUND_BY_VALUES if bound[(g0.uuid, v)]}
    assert on_g0 == {
        "annotation": 2 * GiB,
        "dra": 1 * GiB,
        "none": 5 * GiB,
        "unattributed": 3 * GiB,
    }
    assert sum(on_g0.values()) == 11 * GiB, "the GPU's attributed and unattributed memory"
    assert not any(bound[(g1.uuid, v)] for v in BOUND_BY_VALUES)
    assert unbounded == {g0.uuid: 1.0, g1.uuid: 0.0}

    collector.publish(
        t.step([proc(101, g0, 2 * GiB), proc(102, g0, 1 * GiB), host]),
        wall_time=8.0,
        ready=True,
        reason="ok",
    )
    bound, unbounded = _bound_series(Exposition(registry).body())
    assert (bound[(g0.uuid, "none")], unbounded[g0.uuid]) == (0.0, 0.0)
    assert bound[(g0.uuid, "annotation")] == 2 * GiB
