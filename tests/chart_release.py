"""The chart's Helm release as the tests install it, and the GPU nodes it goes onto.

Owns: the release's name and namespace, the label selectors of its two DaemonSets' pods, the
objects an install creates (to prove an uninstall, or a refused install, left none), and the
node facts the install tests share: GPU feature discovery's labels, the GPU taint, readiness.
Used by the template tests (``tests/test_chart.py``), the kwok install tests (``tests/kube/``)
and the real node (``tests/node/``). Changes nothing on a cluster: it only reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rigs.controlplane import KubeCluster

RELEASE = "gpuguard"
NAMESPACE = "gpuguard"
RELEASE_SELECTOR = f"app.kubernetes.io/instance={RELEASE}"
"""Every object of the release carries it."""
ENFORCER_SELECTOR = f"app.kubernetes.io/name=gpuguard,{RELEASE_SELECTOR}"
"""The enforcer DaemonSet's pods."""
AGENT_SELECTOR = f"app.kubernetes.io/name=gpuguard-agent,{RELEASE_SELECTOR}"
"""The sharing agent DaemonSet's pods (their own name: the enforcer's immutable selector never
matches them)."""

RELEASE_PATHS = (
    "/apis/apps/v1/daemonsets",
    "/api/v1/pods",
    "/api/v1/services",
    "/api/v1/configmaps",
    "/api/v1/serviceaccounts",
    "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "/apis/rbac.authorization.k8s.io/v1/roles",
    "/apis/rbac.authorization.k8s.io/v1/rolebindings",
    "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
    "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
)
"""Every kind an install creates (or whose pods it causes), in every namespace."""


def release_objects(get: Callable[[str], Any]) -> list[str]:
    """Every object of the release, anywhere (``kind/name``), and Helm's release records;
    ``get`` is an admin GET of an API path returning the decoded list."""
    found = [
        f"{path.rsplit('/', 1)[1]}/{item['metadata']['name']}"
        for path in RELEASE_PATHS
        for item in get(f"{path}?labelSelector={RELEASE_SELECTOR}")["items"]
    ]
    secrets = get("/api/v1/secrets?labelSelector=owner=helm")["items"]
    return found + [f"helm release {s['metadata']['name']}" for s in secrets]


def gpu_operator_labels(product: str, count: int, memory_mib: int) -> dict[str, str]:
    """What GPU feature discovery and the operator put on a GPU node (a subset)."""
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.deploy.driver": "true",
        "nvidia.com/gpu.deploy.device-plugin": "true",
        "nvidia.com/gpu.deploy.gpu-feature-discovery": "true",
        "nvidia.com/gpu.deploy.dcgm-exporter": "true",
        "nvidia.com/mig.capable": "false",
    }


# The operator does not taint GPU nodes by default; clusters often do (and the chart tolerates
# it): one node carries the taint, to prove the toleration.
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def ready_nodes(cluster: KubeCluster) -> set[str]:
    """The names of the Nodes whose Ready condition is True."""
    return {
        n["metadata"]["name"]
        for n in cluster.admin_request("GET", "/api/v1/nodes")["items"]
        if any(
            cond["type"] == "Ready" and cond["status"] == "True"
            for cond in n.get("status", {}).get("conditions", [])
        )
    }


def is_ready(pod: Mapping[str, Any]) -> bool:
    """The pod runs and its Ready condition is True."""
    conditions = pod.get("status", {}).get("conditions", [])
    return pod.get("status", {}).get("phase") == "Running" and any(
        cond["type"] == "Ready" and cond["status"] == "True" for cond in conditions
    )
