"""gpuguard at cluster scale: what gpuguard's DaemonSet on 1000 nodes costs a
real control plane, and how fast a sharing-config change reaches the nodes. Not run in CI;
figures and the 5000-node plan in docs/scale.md.

What is real: etcd, kube-apiserver, kube-controller-manager (without the node lifecycle controller:
``BenchPlane``), kube-scheduler (rigs/controlplane.py, scripts/ensure-controlplane.sh), kwok playing
the kubelet of ``--nodes`` GPU nodes, the chart installed with ``helm install`` (default values plus
a ``sharing`` document, so the agents have something to apply) and its two DaemonSets (the
enforcer's and the agent's) rolled out by the real DaemonSet controller onto every node (kwok marks
the pods Running and Ready). Then, per simulated node, gpuguard's own watch and write code,
unchanged: the enforcer's ``KubePodDirectory`` (pods by ``spec.nodeName``, its Node) and the agent's
``app.build_agent`` parts (``KubeSharingSource``: its Node, its pods, the sharing ConfigMap and
NVIDIA's two; ``KubeNodeWriter``; ``KubeEventSink``; the runtime ``Agent`` with ``core.reconcile``),
each with its own API client authenticated by a TokenRequest token of its own ServiceAccount bound
to its pod on that node (the enforcer's, the agent's: so the agent's carries the node-name claim the
admission fence checks), with the settings' defaults (20 s watch windows, 1 s agent turns).

What is simulated: where that code runs. Instead of two pods per node, ``--workers``
Python processes each host a share of the node identities: every reflector keeps its own daemon
thread, as in the real containers (about nine threads a node), and the agents of one process
share an asyncio loop. ``--simulate N`` runs the watchers of every k-th node only (the DaemonSet
still covers all): 1000 nodes' ~9000 threads did not fit on a 2-vCPU machine next to the control
plane. No NVML, no GPU processes: the enforcer's API traffic does not depend on them (Events are
posted only on a violation). The simulators share the machine's CPUs with the control plane.

Phases, on one cluster, back to back:

1. ``--nodes`` kwok nodes Ready; settle; **without gpuguard**: a ``--window`` of steady state.
2. ``helm install``; the two DaemonSets' rollout timed to ``numberReady == --nodes``.
3. The watchers start (``--start-rate`` nodes a second, as the DaemonSet's pods would come up;
   0: all at once, like after an API server restart), sync, label every node (the initial
   config); settle; **with gpuguard**: a ``--window`` of steady state.
4. The sharing ConfigMap is edited so that every node's label must change; an admin watch of the
   Nodes times when each node's label changed (p50/p100 over nodes) and the writes it caused.

With ``--dra-pods-per-node K`` (DRA mode): the controller-manager also runs the ResourceClaim
controller (``rigs.controlplane.DRAControlPlane``); before the first window every node gets the
ResourceSlice NVIDIA's driver publishes with consumable memory (8 GPUs, ``rigs/dra_objects.py``)
and K pods pinned to it (``nodeSelector``), each with a claim from one ResourceClaimTemplate
asking for a memory share; the real scheduler allocates them, kwok runs them, and the first
window starts once all are Running with their claims allocated (so both windows carry the DRA
pods). The enforcer's ``KubePodDirectory`` then runs with ``dra=True`` (its node's
ResourceSlices watched, its pods' claims read by name), and the watchers count as synced once
every simulated node has read its K claims. The simulators count each request their API
clients send, by verb and resource (``request_kind``): the API server's counters cannot tell
gpuguard's requests from the controllers' (which list and watch claims themselves); a LIST or
WATCH of resourceclaims by gpuguard fails the run.

In each window: the API server's request counts (``apiserver_request_total`` by verb, resource
and subresource, delta), its watches (``apiserver_longrunning_requests{verb="WATCH"}``), APF's
rejections and dispatches, etcd's proposals, CPU seconds and RSS of kube-apiserver, etcd and
every other process it started (``/proc``), the machine's busy fraction and the load average.
Prints a table and writes ``--json`` (after each phase, so a failed run keeps what it measured).
Every process it starts is stopped by PID; its temporary directory is removed.

    .venv/bin/python -m benchmarks.scale --nodes 1000 --simulate 250 --workers 10 \
        --window 180 --json /tmp/scale.json
    .venv/bin/python -m benchmarks.scale --nodes 1000 --simulate 250 --dra-pods-per-node 8 \
        --json /tmp/scale-dra.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rigs import dra_objects
from rigs.controlplane import (
    ControlPlane,
    DRAControlPlane,
    KubeCluster,
    die_with_parent,
    ensure_controlplane_binaries,
    find_binaries,
    put_config_map,
    testbin_dir,
)
from rigs.processes import cpu_seconds, parse_metrics, rss_bytes
from rigs.provenance import header, header_lines

REPO = Path(__file__).resolve().parents[1]

CHART = REPO / "helm" / "gpuguard"
RELEASE = NAMESPACE = SERVICE_ACCOUNT = "gpuguard"
AGENT = "gpuguard-agent"
"""The agent's DaemonSet and ServiceAccount (the chart's ``<fullname>-agent``)."""
POD_SELECTORS = {
    SERVICE_ACCOUNT: "app.kubernetes.io/name=gpuguard,app.kubernetes.io/instance=gpuguard",
    AGENT: "app.kubernetes.io/name=gpuguard-agent,app.kubernetes.io/instance=gpuguard",
}
SHARING_NAME = "gpuguard-sharing"
NV_NS, DP_NAME, MIG_NAME = "gpu-operator", "nvidia-time-slicing-config", "nvidia-mig-config"
DP_LABEL = "nvidia.com/device-plugin.config"
PRODUCT_LABEL = "nvidia.com/gpu.product"
PRODUCTS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB", "NVIDIA-L4")
FIRST_PROFILE, CHANGED_PROFILE = "slice-4", "slice-8"
MUTATING = ("POST", "PUT", "PATCH", "DELETE", "APPLY")
NODES_PER_WORKER = 25
DRA_NAMESPACE, DRA_TEMPLATE = "dra-bench", "gpu-share"
DRA_SHARE = "10Gi"
"""Each DRA pod's memory share: 8 pods a node fit on any one of its 8 GPUs."""
DRA_GPUS_PER_NODE = 8
DRA_GPU_MEMORY = dra_objects.memory_quantity(80 << 30)
DRA_RESOURCES = ("resourceclaims", "resourceslices")
"""About 225 threads a simulator process: at ~1100 (250 nodes) the GIL convoy starved every
read past its timeout on a 2-vCPU machine (docs/scale.md)."""


# ---------------------------------------------------------------------------------------------
# The cluster's side: objects


def gpu_node_labels(index: int) -> dict[str, str]:
    """What GPU feature discovery puts on a GPU node (a subset); three products in turn."""
    product = PRODUCTS[index % len(PRODUCTS)]
    return {
        "nvidia.com/gpu.present": "true",
        PRODUCT_LABEL: product,
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.deploy.device-plugin": "true",
        "nvidia.com/mig.capable": "false",
    }


def device_plugin_config() -> dict[str, str]:
    return {
        name: yaml.safe_dump(
            {
                "version": "v1",
                "sharing": {
                    "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}
                },
            }
        )
        for name, replicas in (("slice-2", 2), ("slice-4", 4), ("slice-8", 8))
    }


def mig_config() -> dict[str, str]:
    doc = {
        "version": "v1",
        "mig-configs": {
            "all-disabled": [{"devices": "all", "mig-enabled": False}],
            "all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
        },
    }
    return {"config.yaml": yaml.safe_dump(doc)}


def sharing_document(profile: str) -> dict[str, Any]:
    """One rule per GPU product, every one time-slicing ``profile``: changing ``profile``
    changes the label of every node."""
    return {
        "version": "v1",
        "devicePluginConfig": {"namespace": NV_NS, "name": DP_NAME},
        "migConfig": {"namespace": NV_NS, "name": MIG_NAME, "key": "config.yaml"},
        "migChangePolicy": "WhenIdle",
        "rules": [
            {
                "name": f"shared-{i}",
                "nodeSelector": {"matchLabels": {PRODUCT_LABEL: product}},
                "timeSlicing": profile,
            }
            for i, product in enumerate(PRODUCTS)
        ],
    }


class BenchPlane(ControlPlane):
    """``ControlPlane`` without the node lifecycle controller.

    kwok cannot renew 1000 nodes' heartbeats in time on a loaded 2-vCPU machine: the node
    lifecycle controller then saw nodes go ``Unknown``, tainted them unreachable and marked
    their pods NotReady, and the DaemonSet never finished rolling out (first 1000-node run).
    That is the simulator failing, not the cluster: without the controller, nodes stay as kwok
    set them (``untaint_ready_nodes`` does its one other job here, once). Every other
    controller and flag is ``ControlPlane``'s.
    """

    def _spawn(
        self, name: str, args: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        if name == "kube-controller-manager":
            args = [_without_node_lifecycle(a) for a in args]
        super()._spawn(name, args, env=env)


class DRABenchPlane(BenchPlane, DRAControlPlane):
    """``BenchPlane`` with ``DRAControlPlane``'s controllers (the ResourceClaim controller
    makes each pod's claim from its template): DRA mode."""


def _without_node_lifecycle(arg: str) -> str:
    if not arg.startswith("--controllers="):
        return arg
    kept = [c for c in arg.removeprefix("--controllers=").split(",") if c != "nodelifecycle"]
    return "--controllers=" + ",".join(kept)


def untaint_ready_nodes(cluster: KubeCluster) -> int:
    """Remove the ``node.kubernetes.io/not-ready`` taint (the TaintNodesByCondition admission
    plugin adds it at registration) from every Ready node: the node lifecycle controller's job,
    once. Returns how many nodes were patched."""
    patched = 0
    for n in list_all(cluster, "/api/v1/nodes"):
        taints = (n.get("spec") or {}).get("taints") or []
        kept = [t for t in taints if t.get("key") != "node.kubernetes.io/not-ready"]
        if len(kept) != len(taints):
            cluster.admin_request(
                "PATCH",
                f"/api/v1/nodes/{n['metadata']['name']}",
                {"spec": {"taints": kept or None}},
                content_type="application/merge-patch+json",
            )
            patched += 1
    return patched


def gpuguard_flow_schema(cluster: KubeCluster, shares: int, queue_length: int) -> None:
    """docs/scale.md's plan, item 1: gpuguard's ServiceAccounts in a priority level of their own
    (instead of the bootstrap ``service-accounts`` → ``workload-low``), with one long queue:
    every gpuguard request is one flow (one user), so more queues would not spread it."""
    cluster.admin_request(
        "POST",
        "/apis/flowcontrol.apiserver.k8s.io/v1/prioritylevelconfigurations",
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": "gpuguard"},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": shares,
                    "lendablePercent": 50,
                    "limitResponse": {
                        "type": "Queue",
                        "queuing": {
                            "queues": 1,
                            "handSize": 1,
                            "queueLengthLimit": queue_length,
                        },
                    },
                },
            },
        },
    )
    cluster.admin_request(
        "POST",
        "/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas",
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": "gpuguard"},
            "spec": {
                "priorityLevelConfiguration": {"name": "gpuguard"},
                "matchingPrecedence": 8000,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [
                            {
                                "kind": "ServiceAccount",
                                "serviceAccount": {"name": account, "namespace": NAMESPACE},
                            }
                            for account in (SERVICE_ACCOUNT, AGENT)
                        ],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "clusterScope": True,
                                "namespaces": ["*"],
                            }
                        ],
                    }
                ],
            },
        },
    )


def prepare(cluster: KubeCluster) -> None:
    """What the GPU operator would have made: its namespace and ConfigMaps, RuntimeClass
    ``nvidia``; gpuguard's namespace."""
    for ns in (NAMESPACE, NV_NS):
        cluster.admin_request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                           "metadata": {"name": ns}}
        )  # fmt: skip
    cluster.admin_request(
        "POST",
        "/apis/node.k8s.io/v1/runtimeclasses",
        {
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": "nvidia"},
            "handler": "nvidia",
        },
    )
    put_config_map(cluster, NV_NS, DP_NAME, device_plugin_config())
    put_config_map(cluster, NV_NS, MIG_NAME, mig_config())


def node_name(i: int) -> str:
    return f"gpu-{i:05d}"


def create_nodes(plane: ControlPlane, count: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: plane.create_fake_node(node_name(i), labels=gpu_node_labels(i)),
                range(count),
            )
        )


def list_all(cluster: KubeCluster, path: str) -> Iterator[dict[str, Any]]:
    """Every item of a collection, in pages of 500."""
    cont = ""
    sep = "&" if "?" in path else "?"
    while True:
        page = cluster.admin_request("GET", f"{path}{sep}limit=500&continue={cont}")
        yield from page.get("items") or ()
        cont = (page.get("metadata") or {}).get("continue") or ""
        if not cont:
            return


def ready_nodes(cluster: KubeCluster) -> int:
    return sum(
        1
        for n in list_all(cluster, "/api/v1/nodes")
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (n.get("status") or {}).get("conditions") or ()
        )
    )


def wait_for(
    what: str, predicate: Callable[[], bool], *, timeout: float, interval: float = 1.0
) -> float:
    """Seconds until ``predicate()``; raises ``TimeoutError`` naming ``what``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(interval)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# DRA mode: NVIDIA's ResourceSlices, a claim template, pods the real scheduler allocates


def node_gpu_uuids(index: int) -> list[str]:
    """Node ``index``'s GPUs' UUIDs: unique over the cluster, as NVML's are."""
    return [f"GPU-{index:08x}-0000-4000-8000-{gpu:012x}" for gpu in range(DRA_GPUS_PER_NODE)]


def dra_pod_name(node: str, k: int) -> str:
    return f"{node}-dra-{k}"


def publish_dra(cluster: KubeCluster, nodes: int, pods_per_node: int) -> dict[str, float]:
    """The DeviceClass; every node's ResourceSlice (owned by its Node, as the driver's); a
    namespace with one ResourceClaimTemplate asking for ``DRA_SHARE``; ``pods_per_node`` pods
    on each node using it. Returns the seconds each step took."""
    t0 = time.monotonic()
    cluster.admin_request(
        "POST", f"{dra_objects.RESOURCE_API}/deviceclasses", dra_objects.device_class()
    )
    by_name = {n["metadata"]["name"]: n for n in list_all(cluster, "/api/v1/nodes")}

    def publish(i: int) -> None:
        body = dra_objects.nvidia_slice(by_name[node_name(i)], node_gpu_uuids(i), DRA_GPU_MEMORY)
        cluster.admin_request("POST", f"{dra_objects.RESOURCE_API}/resourceslices", body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(publish, range(nodes)))
    t1 = time.monotonic()
    cluster.admin_request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DRA_NAMESPACE}},
    )
    cluster.admin_request(
        "POST",
        f"{dra_objects.RESOURCE_API}/namespaces/{DRA_NAMESPACE}/resourceclaimtemplates",
        dra_objects.claim_template(DRA_NAMESPACE, DRA_TEMPLATE, DRA_SHARE),
    )

    def create(pod: tuple[int, int]) -> None:
        node = node_name(pod[0])
        body = dra_objects.claim_pod(
            DRA_NAMESPACE, dra_pod_name(node, pod[1]), node=node, template=DRA_TEMPLATE
        )
        cluster.admin_request("POST", f"/api/v1/namespaces/{DRA_NAMESPACE}/pods", body)

    pods = [(i, k) for k in range(pods_per_node) for i in range(nodes)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(create, pods))
    return {"slices_seconds": round(t1 - t0, 1), "pods_created_seconds": round(
        time.monotonic() - t1, 1)}  # fmt: skip


def dra_state(cluster: KubeCluster) -> dict[str, int]:
    """How many DRA pods run, and how many of their claims are allocated and reserved."""
    running = sum(
        1
        for p in list_all(cluster, f"/api/v1/namespaces/{DRA_NAMESPACE}/pods")
        if (p.get("status") or {}).get("phase") == "Running"
    )
    allocated = sum(
        1
        for c in list_all(
            cluster, f"{dra_objects.RESOURCE_API}/namespaces/{DRA_NAMESPACE}/resourceclaims"
        )
        if (c.get("status") or {}).get("allocation") and (c.get("status") or {}).get("reservedFor")
    )
    return {"pods_running": running, "claims_allocated": allocated}


def wait_dra(cluster: KubeCluster, expected: int, timeout: float) -> dict[str, Any]:
    """Seconds until ``expected`` DRA pods run with their claims allocated; progress on
    stderr."""
    t0 = time.monotonic()
    state: dict[str, int] = {}

    def done() -> bool:
        nonlocal state
        state = dra_state(cluster)
        say(f"DRA pods: {state['pods_running']}/{expected} Running, "
            f"{state['claims_allocated']} claims allocated")  # fmt: skip
        return min(state.values()) >= expected

    wait_for(f"{expected} DRA pods Running, claims allocated", done, timeout=timeout, interval=15)
    return {"running_seconds": round(time.monotonic() - t0, 1), **state}


# ---------------------------------------------------------------------------------------------
# Counting the simulators' own requests (DRA mode's attribution)


def request_kind(method: str, url: str) -> str:
    """``VERB resource`` as the API server's ``apiserver_request_total`` names a request:
    GET of a collection is LIST, with ``watch`` WATCH; a subresource is ``resource/sub``."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    path = [p for p in parts.path.split("/") if p]
    if path[:1] == ["api"]:
        rest = path[2:]
    elif path[:1] == ["apis"]:
        rest = path[3:]
    else:
        return f"{method.upper()} {parts.path}"
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    resource, named, sub = rest[0] if rest else "", len(rest) >= 2, rest[2:3]
    if sub:
        resource = f"{resource}/{sub[0]}"
    verb = method.upper()
    if verb == "GET" and query.get("watch", [""])[0].lower() in ("1", "true"):
        verb = "WATCH"
    elif verb == "GET" and not named:
        verb = "LIST"
    return f"{verb} {resource}"


CLIENT_REQUESTS: Counter[str] = Counter()
"""In a simulator process: every request its API clients sent, by ``request_kind``."""


def count_client_requests() -> None:
    """Count every request of the kubernetes client in this process (``CLIENT_REQUESTS``)."""
    from kubernetes.client import rest

    send: Callable[..., Any] = rest.RESTClientObject.request
    lock = threading.Lock()

    def counted(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        with lock:
            CLIENT_REQUESTS[request_kind(method, url)] += 1
        return send(self, method, url, *args, **kwargs)

    rest.RESTClientObject.request = counted  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
# Measuring: the API server's and etcd's metrics, /proc, the load average


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from ``/proc/stat``."""
    cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = cpu[3] + cpu[4]
    return float(sum(cpu) - idle), float(sum(cpu))


@dataclass(slots=True, kw_only=True)
class Snapshot:
    """One moment: counters to subtract, gauges to report."""

    at: float
    requests: dict[tuple[str, str, str], float]
    """(verb, resource, code) → apiserver_request_total."""
    watches: dict[str, float]
    """resource → apiserver_longrunning_requests{verb="WATCH"}."""
    registered_watchers: float | None
    apf_rejected: float
    apf_dispatched: dict[str, float]
    """priority level → apiserver_flowcontrol_dispatched_requests_total."""
    apf_seats: dict[str, float]
    """priority level → apiserver_flowcontrol_nominal_limit_seats."""
    etcd_proposals: float
    cpu: dict[str, float]
    rss: dict[str, int]
    busy: tuple[float, float]
    load: tuple[float, float, float]
    client: dict[str, float] = field(default_factory=dict)
    """``request_kind`` → requests the simulators' clients sent (DRA mode's attribution)."""


class Meter:
    """Scrapes kube-apiserver and etcd, reads ``/proc`` of the processes it is given."""

    def __init__(
        self,
        cluster: KubeCluster,
        processes: Callable[[], Mapping[str, int]],
        client_requests: Callable[[], Mapping[str, float]] = dict,
    ) -> None:
        self.cluster = cluster
        self._processes = processes
        self._client_requests = client_requests
        self._ctx: ssl.SSLContext = cluster.ssl_context()

    def _get(self, url: str, ctx: ssl.SSLContext | None) -> str:
        with urllib.request.urlopen(url, context=ctx, timeout=30) as r:
            text: str = r.read().decode()
            return text

    def snapshot(self) -> Snapshot:
        api = parse_metrics(self._get(f"{self.cluster.server}/metrics", self._ctx))
        etcd = parse_metrics(self._get(f"{self.cluster.etcd_url}/metrics", None))
        requests: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        watches: defaultdict[str, float] = defaultdict(float)
        dispatched: defaultdict[str, float] = defaultdict(float)
        seats: dict[str, float] = {}
        registered: float | None = None
        rejected = 0.0
        for name, labels, value in api:
            if name == "apiserver_request_total":
                res = labels.get("resource", "")
                if res and labels.get("subresource"):
                    res = f"{res}/{labels['subresource']}"
                key = (labels.get("verb", ""), res, labels.get("code", ""))
                requests[key] += value
            elif name == "apiserver_longrunning_requests" and labels.get("verb") == "WATCH":
                watches[labels.get("resource", "")] += value
            elif name == "apiserver_registered_watchers":
                registered = (registered or 0.0) + value
            elif name == "apiserver_flowcontrol_rejected_requests_total":
                rejected += value
            elif name == "apiserver_flowcontrol_dispatched_requests_total":
                dispatched[labels.get("priority_level", "")] += value
            elif name == "apiserver_flowcontrol_nominal_limit_seats":
                seats[labels.get("priority_level", "")] = value
        proposals = sum(v for n, _, v in etcd if n == "etcd_server_proposals_committed_total")
        procs = self._processes()
        cpu = {name: c for name, pid in procs.items() if (c := cpu_seconds(pid)) is not None}
        rss = {name: r for name, pid in procs.items() if (r := rss_bytes(pid)) is not None}
        return Snapshot(
            at=time.monotonic(),
            requests=dict(requests),
            watches=dict(watches),
            registered_watchers=registered,
            apf_rejected=rejected,
            apf_dispatched=dict(dispatched),
            apf_seats=seats,
            etcd_proposals=proposals,
            cpu=cpu,
            rss=rss,
            busy=machine_busy(),
            load=os.getloadavg(),
            client=dict(self._client_requests()),
        )


def _grouped(requests: Mapping[tuple[str, str, str], float], seconds: float) -> dict[str, float]:
    """Requests a second by ``VERB resource`` (only resource requests; ``/metrics`` and other
    non-resource URLs are left out), largest first."""
    by: defaultdict[str, float] = defaultdict(float)
    for (verb, res, _code), n in requests.items():
        if res and n:
            by[f"{verb} {res}"] += n
    ranked = sorted(by.items(), key=lambda kv: -kv[1])
    return {k: round(v / seconds, 3) for k, v in ranked if v}


def window_result(a: Snapshot, b: Snapshot, loads: Sequence[float]) -> dict[str, Any]:
    """What happened between two snapshots."""
    seconds = b.at - a.at
    delta = {k: v - a.requests.get(k, 0.0) for k, v in b.requests.items()}
    resource_requests = {k: v for k, v in delta.items() if k[1]}
    total = sum(resource_requests.values())
    mutating = sum(v for (verb, _, _), v in resource_requests.items() if verb in MUTATING)
    codes: defaultdict[str, float] = defaultdict(float)
    for (_, _, code), v in resource_requests.items():
        if v:
            codes[code] += v
    busy = (b.busy[0] - a.busy[0]) / max(1.0, b.busy[1] - a.busy[1])
    cpu = {name: round((b.cpu[name] - a.cpu[name]) / seconds, 4) for name in b.cpu if name in a.cpu}
    client = {k: v - a.client.get(k, 0.0) for k, v in b.client.items()}
    return {
        "seconds": round(seconds, 1),
        "simulator_requests_by_verb_resource": {
            k: int(v) for k, v in sorted(client.items(), key=lambda kv: -kv[1]) if v
        },
        "requests_by_verb_resource": {
            k: int(v) for k, v in _grouped(resource_requests, 1.0).items()
        },
        "requests_per_second": round(total / seconds, 2),
        "mutating_per_second": round(mutating / seconds, 2),
        "requests_by_code": {k: int(v) for k, v in sorted(codes.items(), key=lambda kv: -kv[1])},
        "requests_per_second_by_verb_resource": _grouped(resource_requests, seconds),
        "watches_open": {k: int(v) for k, v in sorted(b.watches.items()) if v},
        "watches_open_total": int(sum(b.watches.values())),
        "registered_watchers": b.registered_watchers,
        "apf_rejected": int(b.apf_rejected - a.apf_rejected),
        "apf_nominal_limit_seats": {k: int(v) for k, v in sorted(b.apf_seats.items())},
        "apf_dispatched_per_second": {
            k: round((v - a.apf_dispatched.get(k, 0.0)) / seconds, 2)
            for k, v in sorted(b.apf_dispatched.items())
            if v - a.apf_dispatched.get(k, 0.0)
        },
        "etcd_proposals_per_second": round((b.etcd_proposals - a.etcd_proposals) / seconds, 2),
        "cpu_cores": cpu,
        "rss_mib": {name: round(v / 2**20, 1) for name, v in b.rss.items()},
        "machine_busy_fraction": round(busy, 3),
        "load_average": {
            "start_1m": round(a.load[0], 2),
            "end_1m": round(b.load[0], 2),
            "mean_1m": round(statistics.fmean(loads), 2) if loads else None,
        },
    }


def measure_window(meter: Meter, seconds: float, label: str) -> dict[str, Any]:
    say(f"{label}: measuring {seconds:.0f}s of steady state")
    a = meter.snapshot()
    loads: list[float] = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(10.0, left))
        loads.append(os.getloadavg()[0])
    result = window_result(a, meter.snapshot(), loads)
    result["nodes_ready_at_end"] = ready_nodes(meter.cluster)
    return result


# ---------------------------------------------------------------------------------------------
# The DaemonSet


def helm_env(home: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def helm_install(cluster: KubeCluster, workdir: Path) -> tuple[list[str], float]:
    """``helm install`` (no ``--wait``): the chart's defaults plus a sharing document. Returns
    the command and its seconds."""
    values = workdir / "scale-values.yaml"
    values.write_text(yaml.safe_dump({"sharing": sharing_document(FIRST_PROFILE)}))
    cmd = [
        str(testbin_dir() / "helm"),
        "install",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "-f",
        str(values),
        f"--kubeconfig={cluster.admin_kubeconfig}",
    ]
    t0 = time.monotonic()
    done = subprocess.run(
        cmd,
        env=helm_env(workdir / "helm-home"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"helm install failed:\n{done.stdout}\n{done.stderr}")
    return cmd, time.monotonic() - t0


def daemonset_status(cluster: KubeCluster, name: str = RELEASE) -> dict[str, Any]:
    ds = cluster.admin_request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{name}")
    status: dict[str, Any] = ds.get("status") or {}
    return status


def roll_out(cluster: KubeCluster, nodes: int, timeout: float) -> dict[str, Any]:
    """Seconds from now (the install returned) to ``numberReady == nodes`` in both DaemonSets
    (the enforcer's and the agent's; a node counts once both its pods are), with milestones."""
    t0 = time.monotonic()
    milestones: dict[str, float] = {}
    marks = sorted({1, nodes // 4, nodes // 2, (3 * nodes) // 4, nodes} - {0})
    while True:
        statuses = [daemonset_status(cluster, name) for name in (RELEASE, AGENT)]
        ready = min(int(s.get("numberReady") or 0) for s in statuses)
        desired = {int(s.get("desiredNumberScheduled") or 0) for s in statuses}
        elapsed = time.monotonic() - t0
        for m in marks:
            if ready >= m and str(m) not in milestones:
                milestones[str(m)] = round(elapsed, 1)
        if ready >= nodes and desired == {nodes}:
            return {"ready_seconds": round(elapsed, 1), "milestones_ready": milestones}
        if elapsed > timeout:
            raise TimeoutError(f"DaemonSet rollout: {ready}/{nodes} Ready after {timeout:.0f}s")
        time.sleep(1.0)


def pod_tokens(cluster: KubeCluster, nodes: int, account: str) -> dict[str, str]:
    """Per node, a token for ``account`` (the enforcer's ServiceAccount or the agent's) bound to
    its DaemonSet's pod on that node: what the kubelet projects into the pod (it carries the
    node-name claim)."""
    selector = POD_SELECTORS[account]
    pods = [
        p
        for p in list_all(cluster, f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")
        if not (p.get("metadata") or {}).get("deletionTimestamp")
    ]
    by_node = {p["spec"]["nodeName"]: p for p in pods}
    if len(by_node) != nodes:
        raise RuntimeError(f"{len(by_node)} nodes have a gpuguard pod, expected {nodes}")

    def token(pod: Mapping[str, Any]) -> tuple[str, str]:
        r = cluster.admin_request(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": 7200,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": pod["metadata"]["name"],
                        "uid": pod["metadata"]["uid"],
                    },
                },
            },
        )
        return pod["spec"]["nodeName"], str(r["status"]["token"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(pool.map(token, by_node.values()))


# ---------------------------------------------------------------------------------------------
# The simulated DaemonSet pods: worker processes (``_worker``), driven from here


@dataclass(slots=True)
class Worker:
    """One simulator process and the latest status line it printed."""

    proc: subprocess.Popen[str]
    nodes: int
    status: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    started_at: float | None = None
    """When it said every node's watchers were started (its imports and clients built)."""
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if msg.get("event") == "final":
                    self.final = msg
                elif msg.get("event") == "started":
                    self.started_at = time.monotonic()
                else:
                    self.status = msg


def start_workers(
    cluster: KubeCluster,
    tokens: Mapping[str, tuple[str, str]],
    workdir: Path,
    count: int,
    rate: float,
    *,
    dra: bool = False,
) -> list[Worker]:
    """``count`` processes, the nodes dealt round-robin; each node's two kubeconfigs (enforcer,
    agent: two clients, as the two pods have) carry that node's two pod-bound tokens (the
    enforcer's ServiceAccount's, the agent's). The nodes' watchers start ``rate`` nodes a second
    in all (0: all at once)."""
    interval = count / rate if rate > 0 else 0.0
    kc_dir = workdir / "kubeconfigs"
    kc_dir.mkdir(exist_ok=True)
    names = sorted(tokens)
    workers: list[Worker] = []
    for w in range(count):
        mine = names[w::count]
        if not mine:
            continue
        spec = []
        for n in mine:
            enforcer_token, agent_token = tokens[n]
            path = cluster.kubeconfig_for_token(enforcer_token, name=f"kubeconfigs/{n}")
            agent = cluster.kubeconfig_for_token(agent_token, name=f"kubeconfigs/{n}-agent")
            spec.append({"node": n, "kubeconfig": str(path), "agent_kubeconfig": str(agent)})
        spec_file = workdir / f"worker-{w}.json"
        spec_file.write_text(
            json.dumps({"nodes": spec, "start_interval_seconds": interval, "dra": dra})
        )
        log = (workdir / f"worker-{w}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "_worker", str(spec_file)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - one prctl(2), no locks
            cwd=str(REPO),
        )
        log.close()
        worker = Worker(proc=proc, nodes=len(mine))
        worker.reader = threading.Thread(target=worker.read, daemon=True)
        worker.reader.start()
        workers.append(worker)
    return workers


def stop_workers(workers: Iterable[Worker], timeout: float = 60.0) -> None:
    """SIGTERM each worker we started (by its Popen), SIGKILL after ``timeout``."""
    workers = list(workers)
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        if w.reader is not None:
            w.reader.join(5)


def synced_count(workers: Sequence[Worker]) -> int:
    for w in workers:
        if w.proc.poll() is not None:
            raise RuntimeError(f"simulator worker {w.proc.pid} exited {w.proc.returncode}")
    return sum(int(w.status.get("synced", 0)) for w in workers)


def claims_read(workers: Sequence[Worker]) -> int:
    """ResourceClaims the simulated enforcers have read (DRA mode)."""
    return sum(int(w.status.get("claims", 0)) for w in workers)


def client_requests(workers: Sequence[Worker]) -> dict[str, float]:
    """Every request the simulators' clients sent so far, by ``request_kind``."""
    total: Counter[str] = Counter()
    for w in workers:
        total.update(w.status.get("requests") or {})
    return {k: float(v) for k, v in total.items()}


# ---------------------------------------------------------------------------------------------
# Label propagation: an admin watch of every Node


class LabelWatch:
    """Watches all Nodes (as admin) from ``resourceVersion``; records, per node, the first time
    (``time.monotonic``) its ``DP_LABEL`` had ``value``."""

    def __init__(self, cluster: KubeCluster, value: str) -> None:
        self._cluster = cluster
        self.value = value
        self.seen: dict[str, float] = {}
        self.already = {
            n["metadata"]["name"]
            for n in list_all(cluster, "/api/v1/nodes")
            if (n["metadata"].get("labels") or {}).get(DP_LABEL) == value
        }
        head = cluster.admin_request("GET", "/api/v1/nodes?limit=1")
        self._rv = head["metadata"]["resourceVersion"]
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._connected = threading.Event()

    def start(self) -> None:
        self._thread.start()
        if not self._connected.wait(30):
            raise TimeoutError("admin Node watch did not connect")

    def _run(self) -> None:
        while not self._stop.is_set():
            url = (
                f"{self._cluster.server}/api/v1/nodes?watch=1&resourceVersion={self._rv}"
                "&allowWatchBookmarks=true&timeoutSeconds=600"
            )
            try:
                with urllib.request.urlopen(
                    url, context=self._cluster.ssl_context(), timeout=620
                ) as resp:
                    self._resp = resp
                    self._connected.set()
                    for line in resp:
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        meta = obj.get("metadata") or {}
                        if meta.get("resourceVersion"):
                            self._rv = meta["resourceVersion"]
                        if event.get("type") not in ("ADDED", "MODIFIED"):
                            continue
                        name = meta.get("name")
                        labels = meta.get("labels") or {}
                        if isinstance(name, str) and labels.get(DP_LABEL) == self.value:
                            self.seen.setdefault(name, time.monotonic())
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self._resp.fp.raw._sock.shutdown(2)  # unblock the read now
        self._thread.join(5)


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def config_change(
    cluster: KubeCluster, meter: Meter, nodes: int, timeout: float, tail: float
) -> dict[str, Any]:
    """Edit the sharing ConfigMap so every node's label must change; time each node's label
    (admin watch) and count the writes the change caused."""
    watch = LabelWatch(cluster, CHANGED_PROFILE)
    watch.start()
    time.sleep(1.0)
    before = meter.snapshot()
    t0 = time.monotonic()
    cluster.admin_request(
        "PUT",
        f"/api/v1/namespaces/{NAMESPACE}/configmaps/{SHARING_NAME}",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": SHARING_NAME},
            "data": {"sharing.yaml": yaml.safe_dump(sharing_document(CHANGED_PROFILE))},
        },
    )
    try:
        wait_for(
            "every node's label to change",
            lambda: len(watch.seen) >= nodes,
            timeout=timeout,
            interval=0.2,
        )
    finally:
        watch.stop()
    latencies = [t - t0 for t in watch.seen.values()]
    done_at = max(watch.seen.values())
    time.sleep(tail)  # the agents' SharingLabelsApplied Events follow the patches
    after = meter.snapshot()
    delta = {k: v - before.requests.get(k, 0.0) for k, v in after.requests.items()}
    writes = {
        f"{verb} {res}": int(v)
        for (verb, res, _), v in sorted(delta.items())
        if verb in MUTATING and res and v
    }
    propagation = done_at - t0
    patches = sum(v for k, v in writes.items() if k == "PATCH nodes")
    return {
        "nodes_changed": len(watch.seen),
        "already_before": len(watch.already),
        "propagation_seconds": {
            "p50": round(percentile(latencies, 50), 2),
            "p90": round(percentile(latencies, 90), 2),
            "p99": round(percentile(latencies, 99), 2),
            "p100": round(max(latencies), 2),
            "min": round(min(latencies), 2),
        },
        "writes": writes,
        "writes_total": sum(writes.values()),
        "node_patches_per_second": round(patches / max(propagation, 1e-3), 1),
        "writes_per_second_over_propagation": round(
            sum(writes.values()) / max(propagation, 1e-3), 1
        ),
        "measured_seconds_incl_tail": round(after.at - before.at, 1),
        "etcd_proposals": int(after.etcd_proposals - before.etcd_proposals),
        "apf_rejected": int(after.apf_rejected - before.apf_rejected),
    }


# ---------------------------------------------------------------------------------------------
# The whole run


def say(text: str) -> None:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
    print(f"[scale {stamp}] {text}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(int(mem[1]) / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    nodes: int = 1000
    window_seconds: float = 180.0
    settle_seconds: float = 30.0
    workers: int = 0
    """Simulator processes; 0: one per ``NODES_PER_WORKER`` simulated nodes."""
    rollout_timeout_seconds: float = 900.0
    sync_timeout_seconds: float = 600.0
    change_timeout_seconds: float = 300.0
    simulated_nodes: int = 0
    """Nodes whose gpuguard watchers run (every k-th node); 0: all. The DaemonSet still rolls
    out to every node. 1000 nodes' watchers (about 9000 Python threads) did not fit on this
    2-vCPU machine next to the control plane (docs/scale.md)."""
    start_rate_per_second: float = 20.0
    """Nodes whose watchers start each second (0: all at once). A DaemonSet's pods start over
    its rollout; 1000 nodes' 7000 lists at once did not converge on this 2-vCPU machine."""
    tail_seconds: float = 5.0
    """After the last label changed: time for the agents' Node Events to be counted."""
    flow_schema_shares: int = 0
    """With > 0: ``gpuguard_flow_schema`` with these nominal shares before the watchers start."""
    dra_pods_per_node: int = 0
    """With > 0: DRA mode (the module's docstring): this many DRA pods on every node."""
    dra_timeout_seconds: float = 1800.0


def run(
    opts: Options, workdir: Path, checkpoint: Callable[[Mapping[str, Any]], None] | None = None
) -> dict[str, Any]:
    """The benchmark in ``workdir`` (which the caller removes); returns the results, and hands
    them to ``checkpoint`` after each phase (a failed run keeps what it measured)."""
    save = checkpoint or (lambda _results: None)
    bins, why = find_binaries()
    if why:
        raise RuntimeError(why)
    plane_bins, why = ensure_controlplane_binaries()
    if why:
        raise RuntimeError(why)
    results: dict[str, Any] = {"provenance": header(), "machine": machine()}
    results["options"] = dataclasses.asdict(opts)
    workers: list[Worker] = []
    cluster = KubeCluster(workdir, bins)
    dra = opts.dra_pods_per_node > 0
    plane = (DRABenchPlane if dra else BenchPlane)(cluster, plane_bins)

    def processes() -> dict[str, int]:
        named: dict[str, int] = {}
        for pid in (*cluster.pids, *plane.pids):
            with contextlib.suppress(OSError):
                named[Path(f"/proc/{pid}/comm").read_text().strip()] = pid
        for i, w in enumerate(workers):
            if w.proc.poll() is None:
                named[f"simulator-{i}"] = w.proc.pid
        return named

    try:
        t0 = time.monotonic()
        cluster.start()
        plane.start()
        say(f"control plane up in {time.monotonic() - t0:.1f}s")
        meter = Meter(cluster, processes, lambda: client_requests(workers))
        prepare(cluster)
        t0 = time.monotonic()
        create_nodes(plane, opts.nodes)
        created = time.monotonic() - t0
        ready = wait_for(
            f"{opts.nodes} nodes Ready",
            lambda: ready_nodes(cluster) >= opts.nodes,
            timeout=300,
        )
        untainted = untaint_ready_nodes(cluster)
        results["nodes"] = {
            "not_ready_taints_removed": untainted,
            "created_seconds": round(created, 1),
            "ready_after_created_seconds": round(ready, 1),
        }
        say(f"{opts.nodes} kwok nodes created in {created:.1f}s, Ready {ready:.1f}s later")
        if dra:
            results["dra_setup"] = publish_dra(cluster, opts.nodes, opts.dra_pods_per_node)
            say(f"DRA: slices and pods created {results['dra_setup']}")
            results["dra_setup"] |= wait_dra(
                cluster, opts.nodes * opts.dra_pods_per_node, opts.dra_timeout_seconds
            )
            save(results)
        time.sleep(opts.settle_seconds)
        results["without_gpuguard"] = measure_window(meter, opts.window_seconds, "without")
        save(results)

        say("helm install")
        cmd, helm_seconds = helm_install(cluster, workdir)
        rollout = roll_out(cluster, opts.nodes, opts.rollout_timeout_seconds)
        rollout["helm_install_seconds"] = round(helm_seconds, 1)
        rollout["total_seconds"] = round(helm_seconds + rollout["ready_seconds"], 1)
        rollout["helm_command"] = " ".join(
            Path(c).name if i == 0 else c for i, c in enumerate(cmd[:-1])
        )
        results["rollout"] = rollout
        save(results)
        say(f"DaemonSet {opts.nodes}/{opts.nodes} Ready {rollout['ready_seconds']}s after install")

        simulated = opts.simulated_nodes or opts.nodes
        if opts.flow_schema_shares > 0:
            gpuguard_flow_schema(cluster, opts.flow_schema_shares, 1000)
        enforcer_tokens = pod_tokens(cluster, opts.nodes, SERVICE_ACCOUNT)
        agent_tokens = pod_tokens(cluster, opts.nodes, AGENT)
        # Every k-th node (a mix of the three products), so a subset is spread over the rules.
        step = opts.nodes / simulated
        tokens = {
            n: (enforcer_tokens[n], agent_tokens[n])
            for n in (node_name(int(i * step)) for i in range(simulated))
        }
        start = meter.snapshot()
        labelled = LabelWatch(cluster, FIRST_PROFILE)
        labelled.start()
        t0 = time.monotonic()
        workers.extend(
            start_workers(
                cluster,
                tokens,
                workdir,
                opts.workers or -(-simulated // NODES_PER_WORKER),
                opts.start_rate_per_second,
                dra=dra,
            )
        )
        sync = wait_for(
            "every simulated node synced",
            lambda: synced_count(workers) >= simulated,
            timeout=opts.sync_timeout_seconds,
            interval=0.5,
        )
        if dra:
            sync += wait_for(
                "every simulated node's claims read",
                lambda: claims_read(workers) >= simulated * opts.dra_pods_per_node,
                timeout=opts.sync_timeout_seconds,
                interval=0.5,
            )
        started = [w.started_at - t0 for w in workers if w.started_at is not None]
        wait_for(
            "every node labelled by its agent",
            lambda: len(labelled.seen | dict.fromkeys(labelled.already, 0.0)) >= simulated,
            timeout=opts.change_timeout_seconds,
            interval=0.5,
        )
        labelled.stop()
        first_labels = [t - t0 for t in labelled.seen.values()]
        say(f"watchers of {simulated} nodes synced in {sync:.1f}s")
        time.sleep(opts.settle_seconds)
        startup = window_result(start, meter.snapshot(), [])
        results["watchers_start"] = {
            "all_synced_seconds": round(sync, 1),
            "simulators_started_seconds": [round(x, 1) for x in started],
            "all_labelled_seconds": round(max(first_labels), 1) if first_labels else 0.0,
            "requests_by_verb_resource": {
                k: round(v * startup["seconds"])
                for k, v in startup["requests_per_second_by_verb_resource"].items()
            },
            "requests_by_code": startup["requests_by_code"],
            "apf_rejected": startup["apf_rejected"],
            "seconds_incl_settle": startup["seconds"],
        }
        results["with_gpuguard"] = measure_window(meter, opts.window_seconds, "with")
        save(results)
        say("sharing config change")
        results["config_change"] = config_change(
            cluster, meter, simulated, opts.change_timeout_seconds, opts.tail_seconds
        )
        say(
            "config change reached every node: p50 "
            f"{results['config_change']['propagation_seconds']['p50']}s, p100 "
            f"{results['config_change']['propagation_seconds']['p100']}s"
        )
    except BaseException:
        for log in sorted(workdir.glob("worker-*.log")):
            say(f"{log.name}:\n{log.read_text(errors='replace')[-3000:]}")
        say(plane.logs(1500))
        raise
    finally:
        stop_workers(workers)
        plane.close()
        cluster.close()
    results["simulator"] = simulator_summary(workers)
    results["simulator"]["requests_total"] = {
        k: int(v) for k, v in sorted(client_requests(workers).items())
    }
    results["per_simulated_node"] = per_node(results, opts.simulated_nodes or opts.nodes)
    if dra:
        results["dra"] = dra_per_node(results, opts.simulated_nodes or opts.nodes)
    return results


def per_node(results: Mapping[str, Any], simulated: int) -> dict[str, Any]:
    """With minus without, divided by the nodes whose watchers ran: the base of the
    extrapolations in docs/scale.md."""
    off, on = results["without_gpuguard"], results["with_gpuguard"]

    def delta(key: str, sub: str | None = None) -> float:
        a = off[key] if sub is None else off[key].get(sub, 0.0)
        b = on[key] if sub is None else on[key].get(sub, 0.0)
        return float(b) - float(a)

    sim = sum(v for k, v in on["cpu_cores"].items() if k.startswith("simulator"))
    return {
        "nodes": simulated,
        "requests_per_second": round(delta("requests_per_second") / simulated, 4),
        "mutating_per_second": round(delta("mutating_per_second") / simulated, 5),
        "watches": round(delta("watches_open_total") / simulated, 2),
        "apiserver_cpu_millicores": round(
            1000 * delta("cpu_cores", "kube-apiserver") / simulated, 3
        ),
        "etcd_cpu_millicores": round(1000 * delta("cpu_cores", "etcd") / simulated, 3),
        "apiserver_rss_mib": round(delta("rss_mib", "kube-apiserver") / simulated, 3),
        "etcd_rss_mib": round(delta("rss_mib", "etcd") / simulated, 4),
        "simulator_cpu_millicores": round(1000 * sim / simulated, 3),
    }


DRA_KINDS = tuple(f"{verb} {res}" for res in DRA_RESOURCES for verb in ("GET", "LIST", "WATCH"))


def dra_per_node(results: Mapping[str, Any], simulated: int) -> dict[str, Any]:
    """DRA mode: requests a simulated node's gpuguard sent a minute in the with-gpuguard window
    (counted by its clients), the API server's count of the DRA kinds (with minus without, a
    node, a minute: the controllers' share cancels), and the whole run's LIST and WATCH of
    resourceclaims by gpuguard, which must be none."""
    off, on = results["without_gpuguard"], results["with_gpuguard"]
    on_min, off_min = on["seconds"] / 60, off["seconds"] / 60
    client = on["simulator_requests_by_verb_resource"]
    server_on, server_off = on["requests_by_verb_resource"], off["requests_by_verb_resource"]
    total = results["simulator"]["requests_total"]
    return {
        "nodes": simulated,
        "window_seconds": on["seconds"],
        "client_per_node_per_minute": {
            k: round(v / simulated / on_min, 3) for k, v in client.items()
        },
        "apiserver_per_node_per_minute": {
            k: round((server_on.get(k, 0) / on_min - server_off.get(k, 0) / off_min) / simulated, 3)
            for k in DRA_KINDS
        },
        "apiserver_in_window": {
            k: {"without": server_off.get(k, 0), "with": server_on.get(k, 0)} for k in DRA_KINDS
        },
        "resourceclaims_list_or_watch_by_gpuguard": sum(
            total.get(f"{verb} resourceclaims", 0) for verb in ("LIST", "WATCH")
        ),
    }


def simulator_summary(workers: Sequence[Worker]) -> dict[str, Any]:
    restarts: Counter[str] = Counter()
    threads = 0
    for w in workers:
        restarts.update(w.final.get("watch_restarts", {}))
        threads += int(w.final.get("threads", 0))
    return {
        "processes": len(workers),
        "nodes_per_process": [w.nodes for w in workers],
        "threads": threads,
        "watch_restarts_by_resource_reason": dict(restarts.most_common()),
        "max_rss_mib": [w.final.get("max_rss_mib") for w in workers],
    }


# ---------------------------------------------------------------------------------------------
# Output


def table(results: Mapping[str, Any]) -> str:
    off, on = results["without_gpuguard"], results["with_gpuguard"]
    rows: list[tuple[str, str, str]] = [
        ("API requests/s (resource)", f"{off['requests_per_second']}",
         f"{on['requests_per_second']}"),
        ("  of which mutating/s", f"{off['mutating_per_second']}", f"{on['mutating_per_second']}"),
        ("open watches", f"{off['watches_open_total']}", f"{on['watches_open_total']}"),
        ("APF rejections", f"{off['apf_rejected']}", f"{on['apf_rejected']}"),
        ("etcd proposals/s", f"{off['etcd_proposals_per_second']}",
         f"{on['etcd_proposals_per_second']}"),
    ]  # fmt: skip
    for proc in ("kube-apiserver", "etcd"):
        rows.append(
            (
                f"{proc} CPU (cores)",
                f"{off['cpu_cores'].get(proc, '-')}",
                f"{on['cpu_cores'].get(proc, '-')}",
            )
        )
        rows.append(
            (
                f"{proc} RSS (MiB)",
                f"{off['rss_mib'].get(proc, '-')}",
                f"{on['rss_mib'].get(proc, '-')}",
            )
        )
    sim = sum(v for k, v in on["cpu_cores"].items() if k.startswith("simulator"))
    rows += [
        ("simulators CPU (cores)", "-", f"{round(sim, 3)}"),
        ("machine busy", f"{off['machine_busy_fraction']}", f"{on['machine_busy_fraction']}"),
        ("load average (mean 1m)", f"{off['load_average']['mean_1m']}",
         f"{on['load_average']['mean_1m']}"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'without':>10}  {'with':>10}"]
    lines += [f"{a:{width}}  {b:>10}  {c:>10}" for a, b, c in rows]
    ro, ch = results["rollout"], results["config_change"]
    st = results["watchers_start"]
    pn = results["per_simulated_node"]
    lines += [
        "",
        f"gpuguard's watchers ran for {pn['nodes']} of {results['options']['nodes']} nodes; "
        f"per such node: {pn['requests_per_second']} req/s, {pn['watches']} watches, "
        f"{pn['apiserver_cpu_millicores']} apiserver millicores, "
        f"{pn['apiserver_rss_mib']} MiB apiserver RSS",
        f"rollout to {results['options']['nodes']}/{results['options']['nodes']} Ready: "
        f"{ro['ready_seconds']}s after helm install ({ro['helm_install_seconds']}s)",
        f"watchers (started {results['options']['start_rate_per_second']:g} nodes/s; 0 = all "
        f"at once): synced {st['all_synced_seconds']}s, "
        f"labelled {st['all_labelled_seconds']}s",
        f"config change: p50 {ch['propagation_seconds']['p50']}s, "
        f"p100 {ch['propagation_seconds']['p100']}s over {ch['nodes_changed']} nodes; "
        f"writes {ch['writes']} ({ch['writes_per_second_over_propagation']}/s)",
    ]
    if "dra" in results:
        lines += ["", *dra_table(results)]
    return "\n".join(lines)


def dra_table(results: Mapping[str, Any]) -> list[str]:
    """DRA mode's lines: a node's requests a minute by verb and resource."""
    d = results["dra"]
    client, server = d["client_per_node_per_minute"], d["apiserver_per_node_per_minute"]
    kinds = sorted(set(client) | set(DRA_KINDS), key=lambda k: (k.split()[1], k))
    width = max(len(k) for k in kinds)
    lines = [
        f"DRA: {results['options']['dra_pods_per_node']} DRA pods on each of "
        f"{results['options']['nodes']} nodes; per simulated node ({d['nodes']}) a minute over "
        f"{d['window_seconds']}s:",
        f"{'':{width}}  {'gpuguard':>9}  {'apiserver':>9}",
    ]
    for k in kinds:
        sv = f"{server[k]}" if k in server else "-"
        lines.append(f"{k:{width}}  {client.get(k, 0):>9}  {sv:>9}")
    lines.append(
        "LIST or WATCH of resourceclaims by gpuguard (whole run): "
        f"{d['resourceclaims_list_or_watch_by_gpuguard']}"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_worker":
        return worker_main(Path(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--window", type=float, default=180.0, help="seconds of each steady state")
    p.add_argument("--settle", type=float, default=30.0)
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help=f"simulator processes (default: one per {NODES_PER_WORKER} simulated nodes)",
    )
    p.add_argument(
        "--simulate", type=int, default=0, help="nodes whose watchers run (default: all)"
    )
    p.add_argument(
        "--flow-schema-shares",
        type=int,
        default=0,
        help="give gpuguard its own APF priority level with these shares (docs/scale.md)",
    )
    p.add_argument("--tail", type=float, default=5.0, help="seconds counted after a change")
    p.add_argument(
        "--start-rate", type=float, default=20.0, help="nodes started a second (0: all at once)"
    )
    p.add_argument(
        "--dra-pods-per-node",
        type=int,
        default=0,
        help="DRA mode: this many DRA pods on every node, the enforcer reading claims",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args(argv)
    opts = Options(
        nodes=args.nodes,
        window_seconds=args.window,
        settle_seconds=args.settle,
        workers=args.workers,
        tail_seconds=args.tail,
        start_rate_per_second=args.start_rate,
        simulated_nodes=args.simulate,
        flow_schema_shares=args.flow_schema_shares,
        dra_pods_per_node=args.dra_pods_per_node,
    )
    workdir = Path(tempfile.mkdtemp(prefix="gpuguard-scale-"))

    def checkpoint(partial: Mapping[str, Any]) -> None:
        if args.json:
            args.json.write_text(json.dumps(partial, indent=2) + "\n")

    try:
        results = run(opts, workdir, checkpoint)
    finally:
        if args.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results["workdir"] = str(workdir)
    print("\n".join(header_lines()))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if results.get("dra", {}).get("resourceclaims_list_or_watch_by_gpuguard", 0):
        say("FAIL: gpuguard listed or watched resourceclaims")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# The worker: many node identities, gpuguard's real watch and agent code for each


def worker_main(spec_file: Path) -> int:
    """Runs in a simulator process: for each node of the spec, the enforcer's pod directory and
    the agent's parts, each over its own API client; prints status lines until SIGTERM."""
    from gpuguard import logs

    logs.configure(level=os.environ.get("SCALE_WORKER_LOG_LEVEL", "warning"), json=True)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(1 << 20)  # ~9 threads a node: 1 MiB stacks keep the address space small
    spec = json.loads(spec_file.read_text())
    return asyncio.run(_worker(spec))


async def _worker(spec_doc: dict[str, Any]) -> int:
    from prometheus_client import CollectorRegistry

    from gpuguard.adapters.clock import SystemClock
    from gpuguard.adapters.kube.client import load_api_client
    from gpuguard.adapters.kube.pods import KubePodDirectory
    from gpuguard.adapters.metrics import PrometheusHealthRecorder
    from gpuguard.app import AgentParts, build_agent
    from gpuguard.config import AgentSettings, KubeSettings
    from gpuguard.runtime.agent import AgentOptions

    spec: list[dict[str, str]] = spec_doc["nodes"]
    interval = float(spec_doc["start_interval_seconds"])
    dra = bool(spec_doc.get("dra"))
    count_client_requests()
    kube, agent_settings = KubeSettings(), AgentSettings()
    options = AgentOptions(
        allow_eviction=agent_settings.allow_eviction,
        keep_cordon_on_failure=agent_settings.keep_cordon_on_failure,
        interval_seconds=agent_settings.interval_seconds,
        min_write_interval_seconds=agent_settings.min_write_interval_seconds,
    )
    loop = asyncio.get_running_loop()
    # One agent per process would have its own to_thread pool: as many threads as agents here.
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=len(spec)))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    clock = SystemClock()
    registries: list[CollectorRegistry] = []
    directories: list[KubePodDirectory] = []
    agents: list[AgentParts] = []
    tasks: list[asyncio.Task[None]] = []
    last = ""

    def status() -> None:
        nonlocal last
        synced = sum(
            1
            for d, a in zip(directories, agents, strict=True)
            if d.snapshot().synced and d.node().seen and a.source.inputs().synced
        )
        claims = sum(
            1 for d in directories for c in d.dra_claims().values() if not isinstance(c, str)
        )
        line = json.dumps(
            {
                "event": "status",
                "synced": synced,
                "nodes": len(spec),
                "claims": claims,
                "requests": dict(CLIENT_REQUESTS),
            }
        )
        if line != last:
            print(line, flush=True)
            last = line

    next_status = time.monotonic() + 1.0
    for entry in spec:
        if stop.is_set():
            break
        node, kubeconfig, agent_kubeconfig = (
            entry["node"],
            entry["kubeconfig"],
            entry["agent_kubeconfig"],
        )
        enforcer_registry, registry = CollectorRegistry(), CollectorRegistry()
        registries += [enforcer_registry, registry]
        directory = KubePodDirectory(
            load_api_client(kubeconfig),  # the enforcer container's client
            node_name=node,
            clock=clock,
            health=PrometheusHealthRecorder(enforcer_registry),
            watch_timeout_seconds=kube.watch_timeout_seconds,
            connect_timeout_seconds=kube.connect_timeout_seconds,
            inactivity_seconds=kube.inactivity_seconds,
            dra=dra,
        )
        parts = build_agent(
            load_api_client(agent_kubeconfig),  # the agent container's client
            node_name=node,
            sharing_namespace=agent_settings.sharing_namespace,
            sharing_name=agent_settings.sharing_name,
            options=options,
            clock=clock,
            registry=registry,
            watch_timeout_seconds=kube.watch_timeout_seconds,
            connect_timeout_seconds=kube.connect_timeout_seconds,
            inactivity_seconds=kube.inactivity_seconds,
        )
        directory.start()
        parts.source.start()
        parts.events.start()
        directories.append(directory)
        agents.append(parts)
        tasks.append(asyncio.create_task(parts.agent.run(stop), name=f"agent-{node}"))
        if time.monotonic() >= next_status:
            status()
            next_status = time.monotonic() + 1.0
        await asyncio.sleep(interval)
    print(json.dumps({"event": "started", "nodes": len(spec)}), flush=True)
    while not stop.is_set():
        status()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    await asyncio.gather(*tasks, return_exceptions=True)
    restarts: Counter[str] = Counter()
    for registry in registries:
        for family in registry.collect():
            if family.name == "gpuguard_watch_restarts":
                for s in family.samples:
                    if s.name.endswith("_total"):
                        restarts[f"{s.labels['resource']}/{s.labels['reason']}"] += int(s.value)
    final = {
        "event": "final",
        "threads": threading.active_count(),
        "watch_restarts": dict(restarts),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(final), flush=True)
    for directory in directories:
        directory.stop()
    for parts in agents:
        parts.source.stop()
        parts.events.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
