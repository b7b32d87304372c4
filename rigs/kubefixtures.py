"""Fixtures for tests against the real kube-apiserver (marker ``apiserver``), shared by every
folder through ``tests/conftest.py`` so that one session cluster serves them all; the manifests
and admin helpers among them (RBAC, the fence, namespaces, bound tokens) serve the soak benchmark
and the DRA rig too.

Owns: the session cluster (``rigs.controlplane.KubeCluster``), the project's RBAC applied once, a
unique namespace and node name per test, and kubeconfigs for gpuguard's two ServiceAccounts (the
enforcer's and the agent's); the objects several tests create as admin (namespaces,
ServiceAccounts with or without their own rules, NVIDIA's RuntimeClass). Must not leave processes
behind: the cluster is stopped by PID at session end, also after failures.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigs.controlplane import AdminRequestError, KubeCluster, TcpProxy, find_binaries
from rigs.prereq import require

REPO = Path(__file__).resolve().parents[1]
RBAC_MANIFEST = REPO / "manifests" / "rbac.yaml"
FENCE_MANIFEST = REPO / "manifests" / "agent-admission-policy.yaml"
"""The admission fences: the agent's on Nodes, both accounts' on Events (apply before a real
``gpuguard agent`` runs: it writes nothing until its fence is in force)."""
SA_NAMESPACE = "gpuguard"
SA_NAME = "gpuguard"
"""The enforcer's ServiceAccount (manifests/rbac.yaml): pods and Nodes read, Events."""
AGENT_SA_NAME = "gpuguard-agent"
"""The sharing agent's ServiceAccount: the only one that may patch Nodes."""
NVIDIA_NAMESPACE = "gpu-operator"
"""Where rbac.yaml's Role for the two NVIDIA ConfigMaps lives (NVIDIA's GPU operator's)."""

_PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
}


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """etcd + kube-apiserver for the whole session (start-up costs seconds)."""
    binaries, why = find_binaries()
    require(why is None, why or "")
    cluster = KubeCluster(tmp_path_factory.mktemp("kube"), binaries)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster(kube_cluster: KubeCluster) -> KubeCluster:
    """The session cluster, with its apiserver running (a failed outage test may stop it)."""
    if not kube_cluster.apiserver_running:
        kube_cluster.start_apiserver()
    return kube_cluster


def apply_manifest(cluster: KubeCluster, path: Path) -> list[dict[str, Any]]:
    """Create (or replace) every object of a multi-document YAML file as admin."""
    created = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        kind, meta = doc["kind"], doc["metadata"]
        group_version = doc["apiVersion"]
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        ns = meta.get("namespace")
        collection = (
            f"{base}/namespaces/{ns}/{_PLURALS[kind]}" if ns else f"{base}/{_PLURALS[kind]}"
        )
        try:
            created.append(cluster.admin_request("POST", collection, doc))
        except AdminRequestError as e:  # 409: already there (a second apply) → replace
            if e.code != 409:
                raise
            current = cluster.admin_request("GET", f"{collection}/{meta['name']}")
            doc = {
                **doc,
                "metadata": {**meta, "resourceVersion": current["metadata"]["resourceVersion"]},
            }
            created.append(cluster.admin_request("PUT", f"{collection}/{meta['name']}", doc))
    return created


def pod_bound_token(
    cluster: KubeCluster, namespace: str, sa: str, node: str, *, seconds: int = 3600
) -> str:
    """What the kubelet projects for a pod of ``sa`` on ``node``: a token bound to a Pod with
    that ``spec.nodeName``, which names the node (``authentication.kubernetes.io/node-name``,
    what the admission fences read)."""
    pod = cluster.admin_request(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"generateName": f"{sa}-"},
            "spec": {
                "nodeName": node,
                "serviceAccountName": sa,
                "containers": [{"name": "main", "image": "registry.invalid/gpuguard:1"}],
            },
        },
    )
    got = cluster.admin_request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            },
        },
    )
    token: str = got["status"]["token"]
    return token


def ensure_namespace(cluster: KubeCluster, name: str) -> None:
    try:
        cluster.admin_request(
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )
    except AdminRequestError as e:
        if e.code != 409:
            raise


def create_nvidia_runtime_class(cluster: KubeCluster) -> None:
    """The RuntimeClass ``nvidia`` (handler ``nvidia``), as NVIDIA's GPU operator (or container
    toolkit) creates it; the chart's pods name it."""
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


def ensure_service_account(cluster: KubeCluster, namespace: str, name: str) -> None:
    """The ServiceAccount ``name`` in ``namespace``, created unless it is there already."""
    try:
        cluster.admin_request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
        )
    except AdminRequestError as e:
        if e.code != 409:
            raise


def service_account_with_rules(
    cluster: KubeCluster, namespace: str, name: str, rules: list[dict[str, Any]]
) -> None:
    """A ServiceAccount ``name`` in ``namespace`` bound cluster-wide to its own ClusterRole
    ``name`` that holds ``rules`` and nothing else (a grant with a rule missing, to see what the
    code says about it)."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    ensure_service_account(cluster, namespace, name)
    cluster.admin_request(
        "POST",
        f"{rbac}/clusterroles",
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": name}, "rules": rules},
    )  # fmt: skip
    cluster.admin_request(
        "POST",
        f"{rbac}/clusterrolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    )  # fmt: skip


@pytest.fixture(scope="session")
def gpuguard_rbac(kube_cluster: KubeCluster) -> str:
    """manifests/rbac.yaml applied; returns the enforcer's ServiceAccount's user name."""
    ensure_namespace(kube_cluster, SA_NAMESPACE)
    ensure_namespace(kube_cluster, NVIDIA_NAMESPACE)  # the GPU operator creates it on a cluster
    apply_manifest(kube_cluster, RBAC_MANIFEST)
    return f"system:serviceaccount:{SA_NAMESPACE}:{SA_NAME}"


@pytest.fixture
def gpuguard_kubeconfig(cluster: KubeCluster, gpuguard_rbac: str) -> Callable[..., Path]:
    """``make(server=None)`` → a kubeconfig with a fresh token of the enforcer's
    ServiceAccount."""

    def make(server: str | None = None) -> Path:
        return cluster.kubeconfig_for_sa(SA_NAMESPACE, SA_NAME, server=server)

    return make


@pytest.fixture
def agent_kubeconfig(cluster: KubeCluster, gpuguard_rbac: str) -> Callable[..., Path]:
    """``make(server=None)`` → a kubeconfig with a fresh token of the agent's ServiceAccount."""

    def make(server: str | None = None) -> Path:
        return cluster.kubeconfig_for_sa(SA_NAMESPACE, AGENT_SA_NAME, server=server)

    return make


@pytest.fixture
def namespace(cluster: KubeCluster) -> str:
    """A fresh namespace per test (namespaces never finish deleting without controllers)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    ensure_namespace(cluster, name)
    return name


@pytest.fixture
def node_name() -> str:
    """A node name no other test uses (pods are bound to it with spec.nodeName)."""
    return f"node-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def proxy(cluster: KubeCluster) -> Iterator[TcpProxy]:
    """A TCP proxy to the apiserver that a test can partition (one node's network)."""
    p = TcpProxy(cluster.apiserver_port)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def cluster_without_watch_cache(cluster: KubeCluster) -> Iterator[KubeCluster]:
    """Watches served from etcd, so a compacted resourceVersion is a deterministic 410
    (tests of the reflector's relist, in ``tests/kube/`` and ``tests/integration/``)."""
    cluster.stop_apiserver()
    cluster.start_apiserver(watch_cache=False)
    try:
        yield cluster
    finally:
        cluster.stop_apiserver()
        cluster.start_apiserver()
