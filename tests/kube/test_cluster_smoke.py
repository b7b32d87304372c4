"""The test cluster itself, and manifests/rbac.yaml (plus the opt-in
manifests/agent-eviction-rbac.yaml) enforced by a real RBAC authorizer (S1): the enforcer's
ServiceAccount reads pods and Nodes and creates core/v1 Events (no patch, no events.k8s.io);
the agent's, and only the agent's, may patch Nodes and read the sharing ConfigMaps."""

from __future__ import annotations

import json
import ssl
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from gpuguard.adapters.kube import load_api_client
from rigs.controlplane import AdminRequestError, KubeCluster, wait_until
from rigs.kubefixtures import (
    AGENT_SA_NAME,
    NVIDIA_NAMESPACE,
    SA_NAMESPACE,
    apply_manifest,
    ensure_service_account,
)

pytestmark = pytest.mark.apiserver

EVICTION_MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "agent-eviction-rbac.yaml"
NVIDIA_CONFIGS = ("nvidia-time-slicing-config", "nvidia-mig-config")


@pytest.fixture
def as_gpuguard(gpuguard_kubeconfig: Callable[..., Path]) -> Iterator[k8s.ApiClient]:
    """The enforcer's ServiceAccount."""
    api = load_api_client(str(gpuguard_kubeconfig()))
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def as_agent(agent_kubeconfig: Callable[..., Path]) -> Iterator[k8s.ApiClient]:
    """The sharing agent's ServiceAccount."""
    api = load_api_client(str(agent_kubeconfig()))
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


@pytest.mark.parametrize("account", ["enforcer", "agent"])
def test_the_service_account_cannot_delete_pods_read_secrets_or_exec(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    as_gpuguard: k8s.ApiClient,
    as_agent: k8s.ApiClient,
    account: str,
) -> None:
    cluster.create_pod(namespace, "victim", node=node_name)
    api = as_gpuguard if account == "enforcer" else as_agent
    core: Any = k8s.CoreV1Api(api)  # raw dict bodies; the typed stubs want models
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
        "delete nodes": lambda: core.delete_node(node_name),
        "patch nodes/status": lambda: core.patch_node_status(
            node_name, {"metadata": {"labels": {"a": "b"}}}
        ),
        "list configmaps": lambda: core.list_namespaced_config_map("gpuguard"),
    }
    if account == "enforcer":  # granted for its Node condition, fenced (test_condition_fence)
        del denied["patch nodes/status"]
    got = {what: _status(call) for what, call in denied.items()}
    assert got == dict.fromkeys(denied, 403)


def test_the_enforcers_service_account_may_not_patch_a_node_or_read_the_sharing_config(
    cluster: KubeCluster, node_name: str, as_gpuguard: k8s.ApiClient
) -> None:
    """The enforcer's token is not the agent's: it reads its Node, and can
    neither cordon nor relabel one, nor read the ConfigMaps only the agent needs."""
    cluster.create_node(node_name)
    core: Any = k8s.CoreV1Api(as_gpuguard)
    selector = f"metadata.name={node_name}"
    assert {n.metadata.name for n in core.list_node(field_selector=selector).items} == {node_name}
    assert _watched_names(core.list_node, field_selector=selector) == {node_name}
    denied = {
        "patch a sharing label": lambda: core.patch_node(
            node_name, {"metadata": {"labels": {"nvidia.com/device-plugin.config": "a"}}}
        ),
        "cordon": lambda: core.patch_node(node_name, {"spec": {"unschedulable": True}}),
        "read the sharing config": lambda: core.read_namespaced_config_map(
            "gpuguard-sharing", SA_NAMESPACE
        ),
        "read an NVIDIA config": lambda: core.read_namespaced_config_map(
            NVIDIA_CONFIGS[0], NVIDIA_NAMESPACE
        ),
    }
    got = {what: _status(call) for what, call in denied.items()}
    assert got == dict.fromkeys(denied, 403)
    node = cluster.admin_request("GET", f"/api/v1/nodes/{node_name}")
    assert "nvidia.com/device-plugin.config" not in node["metadata"].get("labels", {})
    assert not node["spec"].get("unschedulable")


def test_the_enforcers_service_account_records_events_on_pods(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    as_gpuguard: k8s.ApiClient,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    pod = cluster.create_pod(namespace, "p", node=node_name)
    core: Any = k8s.CoreV1Api(as_gpuguard)  # raw dict bodies; the typed stubs want models
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
    # core/v1 only, create only (KubeEventSink never patches nor uses events.k8s.io): the grant
    # to patch let the enforcer's token rewrite any component's Events in any namespace.
    assert _status(lambda: core.patch_namespaced_event("p.1", namespace, {"message": "x"})) == 403
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
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, context=ctx, timeout=10)
    with refused.value as answer:
        assert answer.code == 403
    got = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/events")
    assert {e["metadata"]["name"] for e in got["items"]} == {"p.1"}
    assert got["items"][0]["message"] == "m"


def _node_event(node_name: str, name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "involvedObject": {"kind": "Node", "name": node_name},
        "reason": "SharingLabelsApplied",
        "message": "m",
        "type": "Normal",
    }


def test_the_agents_service_account_patches_its_node_and_records_node_events_in_default_only(
    cluster: KubeCluster, namespace: str, node_name: str, as_agent: k8s.ApiClient
) -> None:
    """The agent writes Events only on its Node, which go to namespace default (events.py
    NODE_EVENT_NAMESPACE): its account may post them there and nowhere else."""
    cluster.create_node(node_name)
    core: Any = k8s.CoreV1Api(as_agent)  # raw dict bodies; the typed stubs want models
    core.patch_node(node_name, {"metadata": {"labels": {"nvidia.com/device-plugin.config": "a"}}})
    labels = cluster.admin_request("GET", f"/api/v1/nodes/{node_name}")["metadata"]["labels"]
    assert labels["nvidia.com/device-plugin.config"] == "a"
    name = f"{node_name}.{uuid.uuid4().hex[:8]}"
    core.create_namespaced_event("default", _node_event(node_name, name))
    assert cluster.admin_request("GET", f"/api/v1/namespaces/default/events/{name}")
    elsewhere = _status(
        lambda: core.create_namespaced_event(namespace, _node_event(node_name, name))
    )
    assert elsewhere == 403
    patched = _status(lambda: core.patch_namespaced_event(name, "default", {"message": "x"}))
    assert patched == 403


def test_the_apiserver_can_be_stopped_and_restarted_with_its_data(
    cluster: KubeCluster, namespace: str, node_name: str
) -> None:
    created = cluster.create_pod(namespace, "survivor", node=node_name)
    cluster.stop_apiserver()
    assert not cluster.apiserver_running
    cluster.start_apiserver()
    got = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods/survivor")
    assert got["metadata"]["uid"] == created["metadata"]["uid"]


def _create_config_map(cluster: KubeCluster, namespace: str, name: str) -> bool:
    """As admin; False when one is already there (the namespace outlives a test)."""
    try:
        cluster.admin_request(
            "POST",
            f"/api/v1/namespaces/{namespace}/configmaps",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {}},
        )
    except AdminRequestError as e:
        if e.code != 409:
            raise
        return False
    return True


def _watched_names(list_call: Callable[..., Any], **kwargs: Any) -> set[str]:
    """The name in a watch's first event (the object listed at start); raises ApiException."""
    response = list_call(watch=True, timeout_seconds=5, _preload_content=False, **kwargs)
    try:
        for line in response:
            return {json.loads(line)["object"]["metadata"]["name"]}
    finally:
        response.release_conn()
    return set()


def test_the_agent_reads_the_two_nvidia_configmaps_by_name_and_no_other_in_gpu_operator(
    cluster: KubeCluster, as_agent: k8s.ApiClient
) -> None:
    other = f"other-{uuid.uuid4().hex[:8]}"
    wanted = [(NVIDIA_NAMESPACE, n) for n in (*NVIDIA_CONFIGS, other)]
    wanted.append((SA_NAMESPACE, "gpuguard-sharing"))
    created = [(ns, n) for ns, n in wanted if _create_config_map(cluster, ns, n)]
    try:
        _check_nvidia_configmap_access(as_agent, other)
    finally:  # an empty gpuguard-sharing left behind would be an invalid config to other tests
        for ns, n in created:
            cluster.admin_request("DELETE", f"/api/v1/namespaces/{ns}/configmaps/{n}")


def _check_nvidia_configmap_access(as_agent: k8s.ApiClient, other: str) -> None:
    core: Any = k8s.CoreV1Api(as_agent)

    def listed(namespace: str, name: str) -> set[str]:
        got = core.list_namespaced_config_map(namespace, field_selector=f"metadata.name={name}")
        return {c.metadata.name for c in got.items}

    wait_until(
        lambda: _status(lambda: listed(NVIDIA_NAMESPACE, NVIDIA_CONFIGS[0])) == 200,
        what="the SA's Role in gpu-operator to take effect",
    )
    for namespace, name in [(NVIDIA_NAMESPACE, n) for n in NVIDIA_CONFIGS] + [
        (SA_NAMESPACE, "gpuguard-sharing")
    ]:
        assert listed(namespace, name) == {name}
        assert core.read_namespaced_config_map(name, namespace).metadata.name == name
        selector = f"metadata.name={name}"
        watched = _watched_names(
            core.list_namespaced_config_map, namespace=namespace, field_selector=selector
        )
        assert watched == {name}
    denied = {
        "get another": lambda: core.read_namespaced_config_map(other, NVIDIA_NAMESPACE),
        "list another by name": lambda: listed(NVIDIA_NAMESPACE, other),
        "list all": lambda: core.list_namespaced_config_map(NVIDIA_NAMESPACE),
        "watch all": lambda: _watched_names(
            core.list_namespaced_config_map, namespace=NVIDIA_NAMESPACE
        ),
        "update one": lambda: core.patch_namespaced_config_map(
            NVIDIA_CONFIGS[0], NVIDIA_NAMESPACE, {"data": {"x": "y"}}
        ),
        "list across namespaces": lambda: core.list_config_map_for_all_namespaces(
            field_selector=f"metadata.name={NVIDIA_CONFIGS[0]}"
        ),
    }
    got = {what: _status(call) for what, call in denied.items()}
    assert got == dict.fromkeys(denied, 403)


def test_the_agent_watches_cordons_and_labels_its_node_but_cannot_update_or_delete_it(
    cluster: KubeCluster, node_name: str, as_agent: k8s.ApiClient
) -> None:
    cluster.create_node(node_name)
    core: Any = k8s.CoreV1Api(as_agent)
    selector = f"metadata.name={node_name}"
    assert {n.metadata.name for n in core.list_node(field_selector=selector).items} == {node_name}
    assert _watched_names(core.list_node, field_selector=selector) == {node_name}
    core.patch_node(
        node_name,
        {
            "metadata": {
                "labels": {"nvidia.com/mig.config": "all-1g.10gb"},
                "annotations": {"gpuguard.io/cordoned-by": "agent"},
            },
            "spec": {"unschedulable": True},
        },
    )
    node = cluster.admin_request("GET", f"/api/v1/nodes/{node_name}")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["labels"]["nvidia.com/mig.config"] == "all-1g.10gb"
    denied = {
        "update": lambda: core.replace_node(node_name, {"metadata": {"name": node_name}}),
        "delete": lambda: core.delete_node(node_name),
    }
    assert {what: _status(call) for what, call in denied.items()} == dict.fromkeys(denied, 403)


def _evict(api: k8s.ApiClient, namespace: str, pod: str) -> int:
    core: Any = k8s.CoreV1Api(api)
    body = {"metadata": {"name": pod, "namespace": namespace}}
    return _status(lambda: core.create_namespaced_pod_eviction(pod, namespace, body))


def test_pod_eviction_is_granted_only_by_the_opt_in_eviction_manifest(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    as_gpuguard: k8s.ApiClient,
    as_agent: k8s.ApiClient,
    tmp_path: Path,
) -> None:
    """As shipped, the manifest binds the agent's gpuguard/gpuguard-agent; here a test-local
    ServiceAccount and renamed objects stand in, so the grant never reaches the session's other
    tests."""
    docs = [d for d in yaml.safe_load_all(EVICTION_MANIFEST.read_text()) if d]
    assert [d["kind"] for d in docs] == ["ClusterRole", "ClusterRoleBinding"]
    role, binding = docs
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": AGENT_SA_NAME, "namespace": SA_NAMESPACE}
    ]
    local_sa, suffix = "evictor", uuid.uuid4().hex[:8]
    ensure_service_account(cluster, namespace, local_sa)
    name = f"{role['metadata']['name']}-{suffix}"
    role["metadata"]["name"] = binding["metadata"]["name"] = binding["roleRef"]["name"] = name
    binding["subjects"] = [{"kind": "ServiceAccount", "name": local_sa, "namespace": namespace}]
    local = tmp_path / "eviction.yaml"
    local.write_text(yaml.safe_dump_all([role, binding]))
    cluster.create_pod(namespace, "victim", node=node_name)
    evictor = load_api_client(str(cluster.kubeconfig_for_sa(namespace, local_sa)))
    try:
        assert _evict(as_gpuguard, namespace, "victim") == 403  # rbac.yaml alone
        assert _evict(as_agent, namespace, "victim") == 403
        assert _evict(evictor, namespace, "victim") == 403  # nothing applied yet
        apply_manifest(cluster, local)
        try:
            wait_until(
                lambda: _evict(evictor, namespace, "victim") != 403,
                what="the eviction ClusterRoleBinding to take effect",
            )
            assert _evict(evictor, namespace, "victim") in {200, 201}
            assert _evict(as_gpuguard, namespace, "victim") == 403  # bound to the local SA only
        finally:
            rbac = "/apis/rbac.authorization.k8s.io/v1"
            cluster.admin_request("DELETE", f"{rbac}/clusterrolebindings/{name}")
            cluster.admin_request("DELETE", f"{rbac}/clusterroles/{name}")
    finally:
        evictor.close()  # type: ignore[no-untyped-call]
