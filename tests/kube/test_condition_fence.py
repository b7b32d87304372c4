"""The enforcer's ``GPUMemoryEnforced`` Node condition on a real kube-apiserver (docs/design.md,
Node condition): the fence (the ValidatingAdmissionPolicy of
helm/gpuguard/templates/enforcer-admission-policy.yaml, as rendered into
manifests/agent-admission-policy.yaml) and the writer (``KubeNodeConditionWriter``).

As the enforcer's ServiceAccount (``gpuguard``), with a token bound to a Pod on its node (what
the kubelet projects; it carries ``authentication.kubernetes.io/node-name``), an update of
``nodes/status`` may set or change only the ``GPUMemoryEnforced`` condition of its own Node,
with one of the five reasons, ``True`` only with ``Enforcing``; nothing else of the Node
changes, and ``metadata.managedFields`` change only as the API server changes them. The writer
sets the condition, flips it, keeps the kubelet's conditions, refreshes its heartbeat without
moving its transition time, writes "enforcer stopped" when it stops, and as a standby never
overwrites the holder's ``True``.

This module starts its own cluster: the wider RBAC it grants the enforcer (update of nodes and
nodes/status, so that each denial is the fence's and not RBAC's) must not change what the
session cluster's other tests see.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpuguard.adapters.kube.client import load_api_client
from gpuguard.adapters.kube.node_condition import FIELD_MANAGER, KubeNodeConditionWriter
from gpuguard.adapters.metrics import PrometheusHealthRecorder
from gpuguard.core.node_condition import ConditionReason, NodeCondition
from rigs.controlplane import KubeCluster, start_cluster, wait_until

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[2]
POLICY_MANIFEST = REPO / "manifests" / "agent-admission-policy.yaml"
RBAC_MANIFEST = REPO / "manifests" / "rbac.yaml"
NS = "gpuguard"
ENFORCER_SA = "gpuguard"
OTHER_SA = "someone-else"
POLICY = "gpuguard-enforcer-node-condition-fence"
TYPE = "GPUMemoryEnforced"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

_COLLECTIONS = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
    ),
}

# More than the shipped RBAC grants the enforcer (patch of nodes/status only): here every
# denial below is the fence's, not RBAC's. The other account shows other users unaffected.
_WIDE_RBAC: list[dict[str, Any]] = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "condition-test-nodes"},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["nodes", "nodes/status"],
                "verbs": ["get", "list", "patch", "update"],
            }
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "condition-test-nodes"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "condition-test-nodes",
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": ENFORCER_SA, "namespace": NS},
            {"kind": "ServiceAccount", "name": OTHER_SA, "namespace": NS},
        ],
    },
]

READY: dict[str, str] = {
    "type": "Ready",
    "status": "True",
    "reason": "KubeletReady",
    "message": "kubelet is posting ready status",
    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}
KUBELET_STATUS: dict[str, Any] = {
    "capacity": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "4", "pods": "110"},
    "allocatable": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "4", "pods": "110"},
    "addresses": [{"type": "InternalIP", "address": "10.0.0.7"}],
    "conditions": [
        READY,
        {
            "type": "MemoryPressure",
            "status": "False",
            "reason": "KubeletHasSufficientMemory",
            "message": "kubelet has sufficient memory available",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        },
    ],
}


def _condition(status: str = "False", reason: str = "AuditMode", **more: str) -> dict[str, str]:
    return {
        "type": TYPE,
        "status": status,
        "reason": reason,
        "message": "audit mode: violations are reported, nothing is stopped",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
        **more,
    }


def _set(condition: Mapping[str, str]) -> dict[str, Any]:
    return {"status": {"conditions": [dict(condition)]}}


class Cluster:
    """The fenced cluster: Nodes with a kubelet's status, tokens, requests as a token."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.cluster = cluster
        self._ctx = ssl.create_default_context(cafile=str(cluster.pki["ca.crt"]))

    def request(
        self, token: str, method: str, path: str, body: object = None, content_type: str = MERGE
    ) -> tuple[int, str]:
        req = urllib.request.Request(
            self.cluster.server + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read().decode(errors="replace")

    def patch(
        self,
        token: str,
        node: str,
        patch: object,
        content_type: str = STRATEGIC,
        *,
        status: bool = True,
    ) -> tuple[int, str]:
        sub = "/status" if status else ""
        path = f"/api/v1/nodes/{node}{sub}?fieldManager={FIELD_MANAGER}"
        return self.request(token, "PATCH", path, patch, content_type)

    def node(self, name: str) -> dict[str, Any]:
        return self.cluster.admin_request("GET", f"/api/v1/nodes/{name}")

    def create_node(self) -> str:
        """A Node whose status a kubelet (field manager ``kubelet``) has written."""
        name = f"gpu-{uuid.uuid4().hex[:8]}"
        self.cluster.create_node(name, {"kubernetes.io/hostname": name})
        self.cluster.admin_request(
            "PATCH",
            f"/api/v1/nodes/{name}/status?fieldManager=kubelet",
            {"status": KUBELET_STATUS},
            content_type=STRATEGIC,
        )
        return name

    def pod_token(self, node: str, sa: str = ENFORCER_SA) -> str:
        """A token bound to a Pod on ``node``: what the kubelet projects for the enforcer."""
        pod = self.cluster.admin_request(
            "POST",
            f"/api/v1/namespaces/{NS}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"enforcer-{uuid.uuid4().hex[:8]}"},
                "spec": {
                    "nodeName": node,
                    "serviceAccountName": sa,
                    "containers": [{"name": "enforcer", "image": "registry.invalid/gpuguard:1"}],
                },
            },
        )
        r = self.cluster.admin_request(
            "POST",
            f"/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": 3600,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": pod["metadata"]["name"],
                        "uid": pod["metadata"]["uid"],
                    },
                },
            },
        )
        token: str = r["status"]["token"]
        return token


@pytest.fixture(scope="module")
def fenced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("condition"))
    try:
        c = Cluster(cluster)
        for namespace in (NS, "gpu-operator"):  # rbac.yaml has a Role in each
            cluster.admin_request(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            )
        docs = [
            *yaml.safe_load_all(RBAC_MANIFEST.read_text()),
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OTHER_SA}},
            *_WIDE_RBAC,
            *yaml.safe_load_all(POLICY_MANIFEST.read_text()),
        ]
        for doc in docs:
            ns = doc["metadata"].get("namespace", NS)
            cluster.admin_request("POST", _COLLECTIONS[doc["kind"]].format(ns=ns), doc)
        # Policies and RBAC reach the admission chain through informers: wait until the fence
        # denies a known-bad change and allows a good one.
        probe = c.create_node()
        token = c.pod_token(probe)

        def code(reason: str) -> int:
            return c.patch(token, probe, _set(_condition(message=uuid.uuid4().hex, reason=reason)))[
                0
            ]

        wait_until(
            lambda: code("Bogus") == 403 and code("AuditMode") == 200,
            timeout=30,
            what="the condition fence and the RBAC to take effect",
        )
        yield c
    finally:
        cluster.close()


@pytest.fixture
def node(fenced: Cluster) -> str:
    return fenced.create_node()


@pytest.fixture
def enforcer(fenced: Cluster, node: str) -> str:
    """The enforcer's token, bound to a Pod on ``node``."""
    return fenced.pod_token(node)


def _conditions(node: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in node["status"].get("conditions", [])}


def _guarded(node: Mapping[str, Any]) -> dict[str, Any]:
    """The Node but the condition and what the server maintains."""
    meta = {
        k: v
        for k, v in node["metadata"].items()
        if k not in ("managedFields", "resourceVersion", "generation")
    }
    status = dict(node["status"])
    status["conditions"] = [c for c in status.get("conditions", []) if c["type"] != TYPE]
    return {"metadata": meta, "spec": node.get("spec", {}), "status": status}


# -- allowed ------------------------------------------------------------------------------------


def test_the_policy_fails_closed_and_binds_only_the_enforcers_account(fenced: Cluster) -> None:
    base = "/apis/admissionregistration.k8s.io/v1"
    policy = fenced.cluster.admin_request("GET", f"{base}/validatingadmissionpolicies/{POLICY}")
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert [c["expression"] for c in policy["spec"]["matchConditions"]] == [
        f"request.userInfo.username == 'system:serviceaccount:{NS}:{ENFORCER_SA}'"
    ]
    binding = fenced.cluster.admin_request(
        "GET", f"{base}/validatingadmissionpolicybindings/{POLICY}"
    )
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_enforcer_sets_and_changes_its_nodes_condition_and_nothing_else_moves(
    fenced: Cluster, node: str, enforcer: str
) -> None:
    before = _guarded(fenced.node(node))
    got = fenced.patch(enforcer, node, _set(_condition()))
    assert got[0] == 200, got[1]
    assert _conditions(fenced.node(node))[TYPE]["reason"] == "AuditMode"
    for status, reason in (("True", "Enforcing"), ("False", "NvmlUnavailable")):
        got = fenced.patch(enforcer, node, _set(_condition(status, reason)))
        assert got[0] == 200, got[1]
        now = fenced.node(node)
        assert (_conditions(now)[TYPE]["status"], _conditions(now)[TYPE]["reason"]) == (
            status,
            reason,
        )
    assert _guarded(fenced.node(node)) == before  # Ready, MemoryPressure, capacity untouched
    managers = {m["manager"] for m in fenced.node(node)["metadata"]["managedFields"]}
    assert FIELD_MANAGER in managers


def test_the_enforcer_takes_over_a_condition_another_manager_wrote(
    fenced: Cluster, node: str, enforcer: str
) -> None:
    """The API server moves the condition's fields from that manager to gpuguard-enforcer:
    the ownership the fence allows to change."""
    fenced.cluster.admin_request(
        "PATCH",
        f"/api/v1/nodes/{node}/status?fieldManager=kubectl-edit",
        _set(_condition("False", "NotReady")),
        content_type=STRATEGIC,
    )
    got = fenced.patch(enforcer, node, _set(_condition("True", "Enforcing")))
    assert got[0] == 200, got[1]


def test_other_users_are_not_fenced(fenced: Cluster, node: str) -> None:
    token = fenced.pod_token(node, sa=OTHER_SA)
    ready = dict(READY, status="False", reason="KubeletNotReady")
    got = fenced.patch(token, node, {"status": {"conditions": [ready]}})
    assert got[0] == 200, got[1]


# -- denied -------------------------------------------------------------------------------------

DENIED: dict[str, tuple[object, str, bool, str]] = {
    "the kubelet's Ready condition changed": (
        {"status": {"conditions": [
            dict(READY, status="False"),
            _condition(),
        ]}},
        STRATEGIC, True, "no other condition",
    ),
    "another condition added": (
        {"status": {"conditions": [_condition(), {"type": "Fake", "status": "True"}]}},
        STRATEGIC, True, "no other condition",
    ),
    "the other conditions removed (a merge patch replaces the list)": (
        _set(_condition()), MERGE, True, "no other condition",
    ),
    "capacity changed": (
        {"status": {"capacity": {"nvidia.com/gpu": "64"}, "conditions": [_condition()]}},
        STRATEGIC, True, "not: status.capacity",
    ),
    "addresses changed": (
        {"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}},
        STRATEGIC, True, "not: status.addresses",
    ),
    "a label through nodes/status": (
        {"metadata": {"labels": {"example.com/x": "y"}}, "status": {"conditions": [_condition()]}},
        STRATEGIC, True, "metadata.labels",
    ),
    "an annotation through nodes/status": (
        {"metadata": {"annotations": {"example.com/x": "y"}}}, STRATEGIC, True,
        "metadata.annotations",
    ),
    "an unknown reason": (_set(_condition(reason="Bogus")), STRATEGIC, True, "reason is one of"),
    "True without Enforcing": (
        _set(_condition("True", "AuditMode")), STRATEGIC, True, "True only with Enforcing",
    ),
    "Enforcing but False": (
        _set(_condition("False", "Enforcing")), STRATEGIC, True, "True only with Enforcing",
    ),
    "a long message": (
        _set(_condition(message="x" * 257)), STRATEGIC, True, "at most 256 characters",
    ),
    "the Node itself (a label)": (
        {"metadata": {"labels": {"example.com/x": "y"}}}, MERGE, False,
        "may update only nodes/status",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DENIED))
def test_the_enforcer_may_change_nothing_else(
    fenced: Cluster, node: str, enforcer: str, case: str
) -> None:
    patch, content_type, status, message = DENIED[case]
    before = fenced.node(node)
    got = fenced.patch(enforcer, node, patch, content_type, status=status)
    assert got[0] == 403, got[1]
    assert POLICY in got[1]
    assert message in got[1]
    after = fenced.node(node)
    assert _guarded(after) == _guarded(before)
    assert _conditions(after).get(TYPE) == _conditions(before).get(TYPE)


def test_field_ownership_sent_through_nodes_status_is_dropped_by_the_api_server(
    fenced: Cluster, node: str, enforcer: str
) -> None:
    """metadata.managedFields in a write of nodes/status (a patch, or a whole Node put) never
    reach the Node: the API server keeps the live ones for a subresource, so no manager is
    added and the kubelet's ownership stays (the fence's managedFields rules are its second
    line, for the Node itself, which the fence denies the enforcer anyway)."""
    live = fenced.node(node)
    managed = live["metadata"]["managedFields"]
    kubelet = next(m for m in managed if m["manager"] == "kubelet")
    forged = [*managed, dict(kubelet, manager="someone")]
    shrunk = [m for m in managed if m["manager"] != "kubelet"]
    for managed_fields in (forged, shrunk):
        patch = {"metadata": {"managedFields": managed_fields}, **_set(_condition())}
        got = fenced.patch(enforcer, node, patch, MERGE)
        assert got[0] in (200, 403), got[1]
        whole = dict(fenced.node(node))
        whole["metadata"] = dict(whole["metadata"], managedFields=managed_fields)
        path = f"/api/v1/nodes/{node}/status?fieldManager={FIELD_MANAGER}"
        got = fenced.request(enforcer, "PUT", path, whole, "application/json")
        assert got[0] in (200, 403), got[1]
        after = fenced.node(node)["metadata"]["managedFields"]
        assert "someone" not in {m["manager"] for m in after}
        assert next(m for m in after if m["manager"] == "kubelet") == kubelet


def test_the_enforcer_may_not_remove_its_condition(
    fenced: Cluster, node: str, enforcer: str
) -> None:
    assert fenced.patch(enforcer, node, _set(_condition()))[0] == 200
    conditions = fenced.node(node)["status"]["conditions"]
    index = [c["type"] for c in conditions].index(TYPE)
    got = fenced.patch(
        enforcer, node, [{"op": "remove", "path": f"/status/conditions/{index}"}], JSON_PATCH
    )
    assert got[0] == 403, got[1]
    assert "not remove it" in got[1]


def test_the_enforcer_may_not_change_another_node(fenced: Cluster, node: str) -> None:
    other = fenced.create_node()
    token = fenced.pod_token(node)
    got = fenced.patch(token, other, _set(_condition()))
    assert got[0] == 403, got[1]
    assert f"on node {node} may not change another Node ({other})" in got[1]
    assert TYPE not in _conditions(fenced.node(other))


def test_a_token_that_names_no_node_is_denied(fenced: Cluster, node: str) -> None:
    token = fenced.cluster.sa_token(NS, ENFORCER_SA)
    got = fenced.patch(token, node, _set(_condition()))
    assert got[0] == 403, got[1]
    assert "authentication.kubernetes.io/node-name" in got[1]


# -- the writer ---------------------------------------------------------------------------------


def _writer(fenced: Cluster, node: str, **kw: Any) -> KubeNodeConditionWriter:
    kubeconfig = fenced.cluster.kubeconfig_for_token(
        fenced.pod_token(node), name=f"enforcer-{uuid.uuid4().hex[:8]}"
    )
    writer = KubeNodeConditionWriter(load_api_client(str(kubeconfig)), node_name=node, **kw)
    writer.start()
    return writer


AUDIT = NodeCondition(status=False, reason=ConditionReason.AUDIT_MODE, message="audit mode")
ENFORCING = NodeCondition(status=True, reason=ConditionReason.ENFORCING, message="enforcing")
STANDBY = NodeCondition(
    status=False, reason=ConditionReason.LOCK_HELD_ELSEWHERE, message="another enforcer acts"
)


def test_the_writer_sets_flips_and_heartbeats_the_condition_keeping_the_kubelets(
    fenced: Cluster, node: str
) -> None:
    writer = _writer(fenced, node, heartbeat_seconds=1.0)
    try:
        writer.set(AUDIT)
        assert writer.wait_written(10)
        first = _conditions(fenced.node(node))[TYPE]
        assert (first["status"], first["reason"], first["message"]) == (
            "False",
            "AuditMode",
            "audit mode",
        )
        time.sleep(1.1)  # timestamps have whole seconds
        writer.set(ENFORCING)
        assert writer.wait_written(10)
        flipped = _conditions(fenced.node(node))[TYPE]
        assert (flipped["status"], flipped["reason"]) == ("True", "Enforcing")
        assert flipped["lastTransitionTime"] > first["lastTransitionTime"]
        wait_until(
            lambda: (
                _conditions(fenced.node(node))[TYPE]["lastHeartbeatTime"]
                > flipped["lastHeartbeatTime"]
            ),
            timeout=10,
            what="a heartbeat",
        )
        beat = _conditions(fenced.node(node))[TYPE]
        assert beat["lastTransitionTime"] == flipped["lastTransitionTime"]
        assert _conditions(fenced.node(node))["Ready"] == READY
    finally:
        writer.stop()
    stopped = _conditions(fenced.node(node))[TYPE]
    assert (stopped["status"], stopped["reason"], stopped["message"]) == (
        "False",
        "NotReady",
        "enforcer stopped",
    )


def test_a_standby_writer_leaves_the_holders_condition_and_writes_over_an_abandoned_one(
    fenced: Cluster, node: str
) -> None:
    """The holder's condition is a True one, or one refreshed within two heartbeats (a live
    holder in audit mode, or not ready); a standby writes only over an absent or abandoned
    one, so two enforcers never overwrite each other."""
    holder = _writer(fenced, node)
    standby = _writer(fenced, node)
    try:
        holder.set(ENFORCING)
        assert holder.wait_written(10)
        standby.set(STANDBY, standby=True)
        assert standby.wait_written(10)
        standby.stop()  # its "enforcer stopped" is a standby's too
        got = _conditions(fenced.node(node))[TYPE]
        assert (got["status"], got["reason"]) == ("True", "Enforcing")
        holder.set(AUDIT)
        assert holder.wait_written(10)
        quiet = _writer(fenced, node)  # a standby with the 5-minute heartbeat
        quiet.set(STANDBY, standby=True)
        assert quiet.wait_written(10)
        quiet.stop()
        assert _conditions(fenced.node(node))[TYPE]["reason"] == "AuditMode"
    finally:
        holder.stop()
    late = _writer(fenced, node, heartbeat_seconds=1.0)  # "enforcer stopped" ages in 2 s
    try:
        late.set(STANDBY, standby=True)
        wait_until(
            lambda: _conditions(fenced.node(node))[TYPE]["reason"] == "LockHeldElsewhere",
            timeout=15,
            what="the standby to write over an abandoned condition",
        )
    finally:
        late.stop()


def test_a_refused_write_is_counted_retried_and_never_holds_up_the_stop(
    fenced: Cluster, node: str
) -> None:
    """A token the fence refuses (it names no node): each failed attempt counts in
    ``gpuguard_kube_write_errors_total{resource="nodes/status"}``, the writer keeps trying, and
    its stop still returns within its bound."""
    registry = CollectorRegistry()
    kubeconfig = fenced.cluster.kubeconfig_for_token(
        fenced.cluster.sa_token(NS, ENFORCER_SA), name=f"plain-{uuid.uuid4().hex[:8]}"
    )
    writer = KubeNodeConditionWriter(
        load_api_client(str(kubeconfig)),
        node_name=node,
        health=PrometheusHealthRecorder(registry),
        stop_seconds=1.0,
    )
    writer.start()
    labels = {"resource": "nodes/status"}
    try:
        assert registry.get_sample_value("gpuguard_kube_write_errors_total", labels) == 0
        writer.set(ENFORCING)
        wait_until(
            lambda: (
                (registry.get_sample_value("gpuguard_kube_write_errors_total", labels) or 0) >= 2
            ),
            timeout=15,
            what="two failed attempts counted",
        )
        assert not writer.wait_written(0.1)
    finally:
        started = time.monotonic()
        writer.stop()
        assert time.monotonic() - started < 3.0
    assert TYPE not in _conditions(fenced.node(node))
