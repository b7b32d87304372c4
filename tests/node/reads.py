"""What the real-node steps read from the world (tests/node/world.py): a pod's processes and
restarts, its Events, the enforcer's metrics as Prometheus finds them, a command run in a pod as
``kubectl exec`` runs it, ``gpuguard inspect`` in the enforcer pod, and the kubelet's
pod-resources answer read through its socket.

Must not judge: each returns what it read (waiting where the world needs time); the steps in
tests/node/test_real_node.py assert on it.
"""

from __future__ import annotations

import gc
import json
import time
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.podresources import PodResourcesReader
from rigs.controlplane import wait_until
from rigs.kubelet import gpu
from tests.chart_release import NAMESPACE, RELEASE
from tests.node.world import (
    TENANTS,
    Tenant,
    World,
    container_status,
    pod_pids,
    pod_resources_socket,
)


def only_pod(world: World, selector: str) -> dict[str, Any]:
    pods = world.pods(NAMESPACE, selector)
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def main_process(pod: Mapping[str, Any], comm: str) -> int:
    pids = [pid for pid, c in pod_pids(pod).items() if c == comm]
    assert len(pids) == 1, f"{pod['metadata']['name']}: {pod_pids(pod)}"
    return pids[0]


def wait_running(world: World, tenant: Tenant) -> dict[str, Any]:
    pod: dict[str, Any] = {}

    def running() -> bool:
        nonlocal pod
        pod = world.pod(TENANTS, tenant.name)
        return "running" in container_status(pod).get("state", {})

    wait_until(running, timeout=90, interval=0.5, what=f"{tenant.name} running")
    return pod


def watch_restarts(
    world: World, tenant: Tenant, *, restarts: int, timeout: float
) -> tuple[dict[str, Any], set[str]]:
    """Poll the pod until its container restarted ``restarts`` times; returns the pod and every
    waiting reason seen on the way (CrashLoopBackOff shows between restarts)."""
    reasons: set[str] = set()
    pod: dict[str, Any] = {}

    def restarted() -> bool:
        nonlocal pod
        pod = world.pod(TENANTS, tenant.name)
        status = container_status(pod)
        if reason := status.get("state", {}).get("waiting", {}).get("reason"):
            reasons.add(reason)
        return int(status.get("restartCount", 0)) >= restarts

    wait_until(restarted, timeout=timeout, interval=0.3, what=f"{tenant.name} restarts")
    return pod, reasons


def reasons_and_messages(world: World, pod: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for event in world.events(TENANTS, pod):
        found.setdefault(event["reason"], []).append(event.get("message", ""))
    return found


def last_termination(pod: Mapping[str, Any]) -> dict[str, Any]:
    return dict(container_status(pod).get("lastState", {}).get("terminated") or {})


def lifetime(terminated: Mapping[str, Any]) -> float:
    def at(stamp: str) -> float:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))

    return at(terminated["finishedAt"]) - at(terminated["startedAt"])


def metrics_url(world: World, enforcer: Mapping[str, Any]) -> str:
    """The enforcer pod's metrics URL as Prometheus finds it: the chart's headless Service's
    EndpointSlices naming the pod's IP and the ``enforcer-metrics`` port."""
    url: str | None = None

    def resolved() -> bool:
        nonlocal url
        slices = world.api(
            "GET",
            f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
            f"?labelSelector=kubernetes.io/service-name={RELEASE}-metrics",
        )["items"]
        for s in slices:
            ports = {p["name"]: p["port"] for p in s.get("ports") or []}
            for endpoint in s.get("endpoints") or []:
                ref = endpoint.get("targetRef", {}).get("name")
                if ref == enforcer["metadata"]["name"] and "enforcer-metrics" in ports:
                    url = f"http://{endpoint['addresses'][0]}:{ports['enforcer-metrics']}/metrics"
        return url is not None

    wait_until(resolved, timeout=60, interval=0.5, what="the metrics Service's endpoints")
    assert url is not None
    return url


def scrape(world: World, url: str) -> str:
    """GET ``url`` (a pod IP's) from inside the node's network namespace, where pod IPs are."""
    network = world.node.network
    assert network is not None

    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    return network.call(get)


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def exec_in(
    world: World, pod: Mapping[str, Any], container: str, argv: Sequence[str]
) -> tuple[str, str]:
    """``kubectl exec``: through the API server to the kubelet's exec endpoint (no kubectl is
    built for the tests; the Python client speaks the same websocket protocol). Returns the
    command's stdout and stderr, apart (a warning on stderr must not spoil a ``--json``)."""
    from kubernetes import client, config, stream

    def run(api_client: Any) -> tuple[str, str]:
        ws = stream.stream(
            client.CoreV1Api(api_client).connect_get_namespaced_pod_exec,
            pod["metadata"]["name"],
            pod["metadata"]["namespace"],
            container=container,
            command=list(argv),
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
            _preload_content=False,
        )
        ws.run_forever(timeout=120)
        out, err = str(ws.read_stdout()), str(ws.read_stderr())
        ws.close()
        return out, err

    kubeconfig = str(world.cluster.admin_kubeconfig)
    api_client = config.new_client_from_config(kubeconfig)  # type: ignore[no-untyped-call]
    # The client's websocket leaves its TLS socket to the garbage collector (its close() does
    # nothing once the server has closed): collect it here, out of ``run``'s frame, where its
    # ResourceWarning is expected, not at the end of the session.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            return run(api_client)
        finally:
            api_client.close()
            gc.collect()


def kubelet_answer(world: World, tenants: tuple[Tenant, ...]) -> dict[str, list[tuple[str, str]]]:
    """What the real kubelet answers ``List`` on its pod-resources socket for ``tenants``, read
    here (as root) by gpuguard's reader: pod name -> ``("<container> <resource>", device ID)``
    for each device ID."""
    socket = pod_resources_socket(world.node)
    reader = PodResourcesReader(socket, clock=SystemClock())
    try:
        answer = reader.read()
    finally:
        reader.close()
    assert answer.unknown is None, answer.unknown
    found: dict[str, list[tuple[str, str]]] = {}
    for tenant in tenants:
        pod = answer.pods[(TENANTS, tenant.name)]
        assert pod.unknown is None, pod
        found[tenant.name] = [
            (f"{d.container} {d.resource}", i) for d in pod.devices for i in d.device_ids
        ]
    return found


def inspect_rows(world: World, enforcer: Mapping[str, Any], pod: str) -> list[dict[str, Any]]:
    """``gpuguard inspect --json`` in the enforcer pod (as ``kubectl exec`` runs it): the rows
    of ``pod``'s processes, once the NVML stand-in lists one (within 30 s).

    The stand-in finds its scenario through ``NVML_STUB_SCENARIO``, which the ``nvidia``
    runtime writes into the bundle at create; an exec'd process gets the environment containerd
    keeps for the container, without it, so the exec names it (the real library needs none)."""
    scenario = f"NVML_STUB_SCENARIO={gpu.CONTAINER_SCENARIO_DIR}/scenario.json"
    deadline = time.monotonic() + 30
    while True:
        out, err = exec_in(
            world, enforcer, "enforcer", ["env", scenario, "gpuguard", "inspect", "--json"]
        )
        try:
            rows = [p for p in json.loads(out)["processes"] if p["pod"] == pod]
        except (ValueError, KeyError, TypeError) as e:
            raise AssertionError(f"inspect --json: {e!r}\n{out}\n{err}") from e
        if rows or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert rows, f"inspect lists no process of {pod}:\n{out}\n{err}"
    return rows
