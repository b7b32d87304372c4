"""The test cluster itself, and manifests/rbac.yaml enforced by a real RBAC authorizer (S1)."""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from gpuguard.adapters.kube import load_api_client
from tests.apiserver import KubeCluster, wait_until

pytestmark = pytest.mark.apiserver


@pytest.fixture
def as_gpuguard(gpuguard_kubeconfig: Callable[..., Path]) -> Iterator[k8s.ApiClient]:
    api = load_api_client(str(gpuguard_kubeconfig()))
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


def _status(call: Callable[[], object]) -> int:
    try:
        call()
    except k8s.ApiException as e:
        return int(e.status)
    return 200


def test_the_cluster_serves_a_stamped_version_and_stores_a_pod_bound_to_a_node(
    cluster: KubeCluster, namespace: str, node_name: str
) -> None:
    version = cluster.admin_request("GET", "/version")
    assert version["gitVersion"] == "v1.37.2"
    pod = cluster.create_pod(namespace, "p", node=node_name)
    assert pod["spec"]["nodeName"] == node_name
    assert pod["metadata"]["uid"]
    assert pod["status"]["phase"] == "Pending"  # no kubelet: it never runs


def test_the_service_account_lists_only_its_nodes_pods_with_a_field_selector(
    cluster: KubeCluster, namespace: str, node_name: str, as_gpuguard: k8s.ApiClient
) -> None:
    cluster.create_pod(namespace, "mine", node=node_name)
    cluster.create_pod(namespace, "other", node=node_name + "-x")
    core: Any = k8s.CoreV1Api(as_gpuguard)  # raw dict bodies; the typed stubs want models

    def names() -> set[str]:
        pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node_name}")
        return {p.metadata.name for p in pods.items}

    wait_until(lambda: names() == {"mine"}, what="the SA to list exactly its node's pod")


def test_the_service_account_cannot_delete_pods_read_secrets_or_exec(
    cluster: KubeCluster, namespace: str, node_name: str, as_gpuguard: k8s.ApiClient
) -> None:
    cluster.create_pod(namespace, "victim", node=node_name)
    core: Any = k8s.CoreV1Api(as_gpuguard)  # raw dict bodies; the typed stubs want models
    # The grants work (so a 403 below is RBAC, not a broken token)...
    assert _status(lambda: core.read_namespaced_pod("victim", namespace)) == 200
    # ...and nothing beyond them does.
    denied = {
        "delete pods": lambda: core.delete_namespaced_pod("victim", namespace),
        "list secrets": lambda: core.list_secret_for_all_namespaces(),
        "get secrets": lambda: core.read_namespaced_secret("x", namespace),
        "create pods": lambda: core.create_namespaced_pod(
            namespace, {"metadata": {"name": "evil"}, "spec": {"containers": []}}
        ),
        "create pods/eviction": lambda: core.create_namespaced_pod_eviction(
            "victim", namespace, {"metadata": {"name": "victim", "namespace": namespace}}
        ),
        "update nodes": lambda: core.replace_node(node_name, {"metadata": {"name": node_name}}),
        "patch nodes/status": lambda: core.patch_node_status(
            node_name, {"metadata": {"labels": {"a": "b"}}}
        ),
        "list configmaps": lambda: core.list_namespaced_config_map("gpuguard"),
    }
    got = {what: _status(call) for what, call in denied.items()}
    assert got == dict.fromkeys(denied, 403)


def test_the_service_account_patches_its_node_labels_and_records_events(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    as_gpuguard: k8s.ApiClient,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    cluster.create_node(node_name)
    pod = cluster.create_pod(namespace, "p", node=node_name)
    core: Any = k8s.CoreV1Api(as_gpuguard)  # raw dict bodies; the typed stubs want models
    core.patch_node(node_name, {"metadata": {"labels": {"nvidia.com/device-plugin.config": "a"}}})
    labels = cluster.admin_request("GET", f"/api/v1/nodes/{node_name}")["metadata"]["labels"]
    assert labels["nvidia.com/device-plugin.config"] == "a"
    core.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": "p.1"},
            "involvedObject": {
                "kind": "Pod",
                "name": "p",
                "namespace": namespace,
                "uid": pod["metadata"]["uid"],
            },
            "reason": "Test",
            "message": "m",
            "type": "Normal",
        },
    )
    # events.k8s.io/v1 through raw HTTP: the Python client re-serialises eventTime without the
    # microseconds MicroTime requires (kubernetes 37.0.2), which is not what this test is about.
    token = json.loads(gpuguard_kubeconfig().read_text())["users"][0]["user"]["token"]
    req = urllib.request.Request(
        f"{cluster.server}/apis/events.k8s.io/v1/namespaces/{namespace}/events",
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        data=json.dumps(
            {
                "metadata": {"name": "p.2"},
                "eventTime": "2026-01-01T00:00:00.000000Z",
                "reportingController": "gpuguard.io/enforcer",
                "reportingInstance": node_name,
                "action": "Test",
                "reason": "Test",
                "regarding": {"kind": "Pod", "name": "p", "namespace": namespace},
                "type": "Normal",
            }
        ).encode(),
    )
    ctx = ssl.create_default_context(cafile=str(cluster.pki["ca.crt"]))
    with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
        assert r.status == 201
    got = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/events")
    assert {e["metadata"]["name"] for e in got["items"]} == {"p.1", "p.2"}


def test_the_apiserver_can_be_stopped_and_restarted_with_its_data(
    cluster: KubeCluster, namespace: str, node_name: str
) -> None:
    created = cluster.create_pod(namespace, "survivor", node=node_name)
    cluster.stop_apiserver()
    assert not cluster.apiserver_running
    cluster.start_apiserver()
    got = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods/survivor")
    assert got["metadata"]["uid"] == created["metadata"]["uid"]
