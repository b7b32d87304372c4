"""manifests/agent-admission-policy.yaml enforced by a real kube-apiserver (docs/design.md, Sharing
config, admission fence).

The agent's token names its node (``authentication.kubernetes.io/node-name`` in the user's extra):
on v1.37.2 both a token bound to a Pod with ``spec.nodeName`` (what the kubelet projects) and a
token bound to a Node object carry it, with no feature gate or flag. As that token, the agent's
ServiceAccount (``gpuguard-agent``) may change its own node's two sharing labels (set, not
remove), ``spec.unschedulable`` (lift only a cordon that carries its marker) and the
``gpuguard.io/cordoned-by`` annotation (set only with its cordon), and nothing else; it lifts a
cordon only while its field manager (gpuguard) alone owns ``spec.unschedulable``; the Node's
``metadata.managedFields`` change only as the API server changes them on such writes (no forged
ownership, no new manager, gpuguard's entries bounded); other users are not affected, and the
enforcer's account (``gpuguard``) may not patch a Node at all.

This module starts its own cluster: the policy and the wider RBAC it grants (nodes update and
nodes/status, so that a denial is the fence's and not RBAC's) must not change what the session
cluster's other tests see.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigs.controlplane import AdminRequestError, KubeCluster, start_cluster, wait_until

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[2]
POLICY_MANIFEST = REPO / "manifests" / "agent-admission-policy.yaml"
RBAC_MANIFEST = REPO / "manifests" / "rbac.yaml"
NS = "gpuguard"
SA = "gpuguard-agent"  # the agent's ServiceAccount (manifests/rbac.yaml), which the fence binds
ENFORCER_SA = "gpuguard"  # the enforcer's: RBAC lets it read Nodes, not patch them
OTHER_SA = "someone-else"

DP = "nvidia.com/device-plugin.config"
MIG = "nvidia.com/mig.config"
CORDONED_BY = "gpuguard.io/cordoned-by"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"
# What the agent's writer sends to lift its cordon, and to drop its marker alone
# (gpuguard/adapters/kube/agent.py node_patch_body).
UNCORDON = {"metadata": {"annotations": {CORDONED_BY: None}}, "spec": {"unschedulable": None}}
FORGET = {"metadata": {"annotations": {CORDONED_BY: None}}}

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

# What RBAC would grant the agent once it cordons (the chart comes later), plus nodes/status and
# update, which it never gets: here they make every denial below the policy's, not RBAC's.
_WIDE_RBAC: list[dict[str, Any]] = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "fence-test-nodes"},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["nodes", "nodes/status"],
                "verbs": ["get", "list", "patch", "update"],
            },
            # Events anywhere, patched and updated, in both groups: for the agent's account,
            # so that the Event fence's denials are the fence's (the enforcer's keeps the
            # shipped RBAC, whose denials the tests read too).
            {
                "apiGroups": ["", "events.k8s.io"],
                "resources": ["events"],
                "verbs": ["get", "create", "patch", "update"],
            },
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "fence-test-nodes"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "fence-test-nodes",
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": SA, "namespace": NS},
            {"kind": "ServiceAccount", "name": OTHER_SA, "namespace": NS},
        ],
    },
]


def _fresh() -> str:
    return uuid.uuid4().hex[:8]


def _create(cluster: KubeCluster, doc: Mapping[str, Any]) -> dict[str, Any]:
    ns = doc["metadata"].get("namespace", NS)
    return cluster.admin_request("POST", _COLLECTIONS[doc["kind"]].format(ns=ns), doc)


@dataclass(frozen=True)
class Answer:
    code: int
    text: str


class Fence:
    """The fenced cluster: tokens, nodes and requests as a given bearer token."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.cluster = cluster
        self._ctx = ssl.create_default_context(cafile=str(cluster.pki["ca.crt"]))

    def request(
        self,
        token: str,
        method: str,
        path: str,
        body: object = None,
        content_type: str = MERGE,
    ) -> Answer:
        data = None
        if body is not None:
            data = (
                yaml.safe_dump(body).encode()
                if content_type == APPLY
                else json.dumps(body).encode()
            )
        req = urllib.request.Request(
            self.cluster.server + path,
            method=method,
            data=data,
            headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=30) as r:
                return Answer(r.status, r.read().decode())
        except urllib.error.HTTPError as e:
            with e:
                return Answer(e.code, e.read().decode(errors="replace"))

    def patch_node(
        self,
        token: str,
        node: str,
        patch: object,
        content_type: str = MERGE,
        sub: str = "",
        manager: str = "gpuguard",
    ) -> Answer:
        """A PATCH as ``token`` with field manager ``manager`` (the agent's writer names
        gpuguard; without one the API server would name the client's user agent)."""
        suffix = f"/{sub}" if sub else ""
        query = f"?fieldManager={manager}" + ("&force=true" if content_type == APPLY else "")
        return self.request(
            token, "PATCH", f"/api/v1/nodes/{node}{suffix}{query}", patch, content_type
        )

    def node(self, name: str) -> dict[str, Any]:
        return self.cluster.admin_request("GET", f"/api/v1/nodes/{name}")

    def create_node(self, name: str) -> dict[str, Any]:
        return self.cluster.create_node(
            name,
            {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": "Tesla-T4", DP: "slice-2"},
            annotations={"example.com/owner": "team-a"},
        )

    def pod_token(self, node: str, sa: str = SA) -> str:
        """A token bound to a Pod on ``node``: what the kubelet projects for the agent."""
        pod = self.cluster.admin_request(
            "POST",
            f"/api/v1/namespaces/{NS}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"agent-{uuid.uuid4().hex[:8]}"},
                "spec": {
                    "nodeName": node,
                    "serviceAccountName": sa,
                    "containers": [{"name": "agent", "image": "registry.invalid/gpuguard:1"}],
                },
            },
        )
        return self._token(sa, pod)

    def node_token(self, node: str) -> str:
        """A token bound to the Node object itself."""
        return self._token(SA, self.node(node))

    def _token(self, sa: str, bound: Mapping[str, Any]) -> str:
        """A TokenRequest for ``sa`` bound to the object ``bound`` (a Pod or a Node)."""
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
                        "kind": bound["kind"],
                        "name": bound["metadata"]["name"],
                        "uid": bound["metadata"]["uid"],
                    },
                },
            },
        )
        token: str = r["status"]["token"]
        return token

    def user(self, token: str) -> dict[str, Any]:
        got = self.request(
            token,
            "POST",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            content_type="application/json",
        )
        assert got.code == 201, got
        user: dict[str, Any] = json.loads(got.text)["status"]["userInfo"]
        return user


@pytest.fixture(scope="module")
def fence(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fence]:
    cluster = start_cluster(tmp_path_factory.mktemp("fence"))
    try:
        f = Fence(cluster)
        for namespace in (NS, "gpu-operator"):  # rbac.yaml has a Role in each
            cluster.admin_request(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            )
        for doc in yaml.safe_load_all(RBAC_MANIFEST.read_text()):
            _create(cluster, doc)
        _create(
            cluster,
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OTHER_SA}},
        )
        for doc in _WIDE_RBAC:
            _create(cluster, doc)
        for doc in yaml.safe_load_all(POLICY_MANIFEST.read_text()):
            _create(cluster, doc)
        # Policies and RBAC reach the admission chain through informers: wait until the fence
        # denies a known-bad change, and RBAC allows a good one.
        f.create_node("probe")
        token = f.pod_token("probe")

        # (A fresh value each time: a change let through before the policy was active would
        # make the same patch a no-op, which the fence allows.)
        def probe(key: str) -> int:
            return f.patch_node(token, "probe", {"metadata": {"labels": {key: _fresh()}}}).code

        enforcer = f.pod_token("probe", sa=ENFORCER_SA)

        def event_probe() -> int:
            body = _event("Node", "probe", "default", "probe")
            path = "/api/v1/namespaces/default/events"
            return f.request(enforcer, "POST", path, body, "application/json").code

        wait_until(
            lambda: probe("example.com/probe") == 403 and probe(DP) == 200,
            timeout=30,
            what="the admission policy and the RBAC to take effect",
        )
        wait_until(lambda: event_probe() == 403, timeout=30, what="the Event fences to take effect")
        yield f
    finally:
        cluster.close()


@pytest.fixture
def node(fence: Fence) -> str:
    """A fresh Node: labels (hostname, gpu.product, device-plugin.config), one annotation."""
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    fence.create_node(name)
    return name


@pytest.fixture
def other_node(fence: Fence) -> str:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    fence.create_node(name)
    return name


@pytest.fixture
def agent(fence: Fence, node: str) -> str:
    """The agent's token: bound to a Pod on ``node``."""
    return fence.pod_token(node)


def _visible(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the fence guards: metadata minus what the server maintains, and the spec."""
    meta = {
        k: v
        for k, v in obj["metadata"].items()
        if k not in ("managedFields", "resourceVersion", "generation")
    }
    return {"metadata": meta, "spec": obj.get("spec", {})}


# -- the token ----------------------------------------------------------------------------------


def test_a_pod_bound_and_a_node_bound_token_both_name_the_node(
    fence: Fence, node: str, agent: str
) -> None:
    user = fence.user(agent)
    assert user["username"] == f"system:serviceaccount:{NS}:{SA}"
    assert user["extra"]["authentication.kubernetes.io/node-name"] == [node]
    assert fence.user(fence.node_token(node))["extra"][
        "authentication.kubernetes.io/node-name"
    ] == [node]
    plain = fence.cluster.sa_token(NS, SA)
    assert "authentication.kubernetes.io/node-name" not in fence.user(plain).get("extra", {})


def test_the_policy_fails_closed_and_binds_only_the_service_account(fence: Fence) -> None:
    base = "/apis/admissionregistration.k8s.io/v1"
    policy = fence.cluster.admin_request(
        "GET", f"{base}/validatingadmissionpolicies/gpuguard-agent-node-fence"
    )["spec"]
    assert policy["failurePolicy"] == "Fail"
    assert [c["expression"] for c in policy["matchConditions"]] == [
        f"request.userInfo.username == 'system:serviceaccount:{NS}:{SA}'"
    ]
    binding = fence.cluster.admin_request(
        "GET", f"{base}/validatingadmissionpolicybindings/gpuguard-agent-node-fence"
    )["spec"]
    assert binding["policyName"] == "gpuguard-agent-node-fence"
    assert binding["validationActions"] == ["Deny"]


def test_the_enforcers_pod_bound_token_may_not_patch_its_node(fence: Fence, node: str) -> None:
    """The enforcer's account is not the agent's: with the shipped RBAC alone
    (the wide test grant is the agent's), its pod-bound token reads its Node and changes
    nothing on it, not even a sharing label; the denial is RBAC's, before the fence."""
    token = fence.pod_token(node, sa=ENFORCER_SA)
    assert fence.user(token)["username"] == f"system:serviceaccount:{NS}:{ENFORCER_SA}"
    assert fence.request(token, "GET", f"/api/v1/nodes/{node}").code == 200
    before = _visible(fence.node(node))
    for patch in ALLOWED_ELSEWHERE.values():
        got = fence.patch_node(token, node, patch)
        assert got.code == 403, got.text
        assert "gpuguard-agent-node-fence" not in got.text
    assert _visible(fence.node(node)) == before


# -- allowed ------------------------------------------------------------------------------------

ALLOWED: dict[str, tuple[object, str, Callable[[dict[str, Any]], bool]]] = {
    "change the device-plugin label": (
        {"metadata": {"labels": {DP: "slice-4"}}},
        MERGE,
        lambda n: n["metadata"]["labels"][DP] == "slice-4",
    ),
    "add the mig label": (
        {"metadata": {"labels": {MIG: "all-1g.5gb"}}},
        MERGE,
        lambda n: n["metadata"]["labels"][MIG] == "all-1g.5gb",
    ),
    "cordon": (
        {"spec": {"unschedulable": True}},
        MERGE,
        lambda n: n["spec"]["unschedulable"] is True,
    ),
    "cordon, annotate and relabel at once (strategic merge)": (
        {
            "metadata": {"labels": {MIG: "all-1g.5gb"}, "annotations": {CORDONED_BY: "agent"}},
            "spec": {"unschedulable": True},
        },
        STRATEGIC,
        lambda n: (
            n["spec"]["unschedulable"] is True and n["metadata"]["labels"][MIG] == "all-1g.5gb"
        ),
    ),
    "the label by JSON patch": (
        [
            {
                "op": "replace",
                "path": "/metadata/labels/nvidia.com~1device-plugin.config",
                "value": "x",
            }
        ],
        JSON_PATCH,
        lambda n: n["metadata"]["labels"][DP] == "x",
    ),
    "the label by server-side apply": (
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "{node}", "labels": {MIG: "m"}}},
        APPLY,
        lambda n: n["metadata"]["labels"][MIG] == "m",
    ),
    "nothing (a no-op patch)": (
        {"metadata": {"labels": {DP: "slice-2"}}},
        MERGE,
        lambda n: n["metadata"]["labels"][DP] == "slice-2",
    ),
    "cordon and mark the cordon as its own": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}, "spec": {"unschedulable": True}},
        MERGE,
        lambda n: _cordon(n) == (True, "agent"),
    ),
    "lift its own cordon with its marker": (
        UNCORDON,
        MERGE,
        lambda n: _cordon(n) == (False, None),
    ),
    "lift its own cordon with unschedulable false": (
        {"metadata": {"annotations": {CORDONED_BY: None}}, "spec": {"unschedulable": False}},
        MERGE,
        lambda n: _cordon(n) == (False, None),
    ),
    "lift its own cordon by JSON patch": (
        [
            {"op": "remove", "path": "/spec/unschedulable"},
            {"op": "remove", "path": "/metadata/annotations/gpuguard.io~1cordoned-by"},
        ],
        JSON_PATCH,
        lambda n: _cordon(n) == (False, None),
    ),
    "remove the marker from its own cordon (the cordon stays)": (
        FORGET,
        MERGE,
        lambda n: _cordon(n) == (True, None),
    ),
    "remove a stale marker from a schedulable node": (
        FORGET,
        MERGE,
        lambda n: _cordon(n) == (False, None),
    ),
    "remove a marker of another value": (
        FORGET,
        MERGE,
        lambda n: _cordon(n) == (True, None),
    ),
    "cordon a schedulable node that carries a stale marker": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}, "spec": {"unschedulable": True}},
        MERGE,
        lambda n: _cordon(n) == (True, "agent"),
    ),
    "relabel under an admin's cordon": (
        {"metadata": {"labels": {MIG: "all-1g.5gb"}}},
        MERGE,
        lambda n: n["metadata"]["labels"][MIG] == "all-1g.5gb" and _cordon(n) == (True, None),
    ),
    "relabel beside a stale marker": (
        {"metadata": {"labels": {DP: "slice-4"}}},
        MERGE,
        lambda n: n["metadata"]["labels"][DP] == "slice-4" and _cordon(n) == (False, "agent"),
    ),
    # Field ownership (metadata.managedFields) as the API server moves it on the agent's writes.
    "relabel a label another manager owns alone (its entry goes)": (
        {"metadata": {"labels": {MIG: "all-1g.5gb"}}},
        MERGE,
        lambda n: (
            n["metadata"]["labels"][MIG] == "all-1g.5gb"
            and "gpu-operator" not in _managers(n)
            and "f:nvidia.com/mig.config" in _fields(n, "gpuguard")["f:metadata"]["f:labels"]
        ),
    ),
    "cordon a node without annotations (the agent's write creates the map)": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}, "spec": {"unschedulable": True}},
        MERGE,
        lambda n: _cordon(n) == (True, "agent"),
    ),
    "resend the managedFields as read, with a label": (
        lambda n: {
            "metadata": {
                "managedFields": n["metadata"]["managedFields"],
                "labels": {DP: "slice-8"},
            }
        },
        MERGE,
        lambda n: n["metadata"]["labels"][DP] == "slice-8",
    ),
}


def _managers(node: Mapping[str, Any]) -> list[str]:
    return [e["manager"] for e in node["metadata"].get("managedFields", [])]


def _fields(node: Mapping[str, Any], manager: str) -> dict[str, Any]:
    """The fieldsV1 of ``manager``'s (one) Update entry."""
    (entry,) = [
        e
        for e in node["metadata"]["managedFields"]
        if e["manager"] == manager and e["operation"] == "Update"
    ]
    fields: dict[str, Any] = entry["fieldsV1"]
    return fields


def _forge(change: Callable[[list[dict[str, Any]]], object]) -> Callable[[Any], object]:
    """A merge patch that sends the Node's managedFields as ``change`` rewrote them: what a
    stolen token can send, and the API server then stores."""

    def patch(node: Mapping[str, Any]) -> object:
        managed: list[dict[str, Any]] = json.loads(json.dumps(node["metadata"]["managedFields"]))
        change(managed)
        return {"metadata": {"managedFields": managed}}

    return patch


def _entry(managed: list[dict[str, Any]], manager: str) -> dict[str, Any]:
    (entry,) = [e for e in managed if e["manager"] == manager and e["operation"] == "Update"]
    return entry


def _labels_of(managed: list[dict[str, Any]], manager: str) -> dict[str, Any]:
    labels: dict[str, Any] = _entry(managed, manager)["fieldsV1"]["f:metadata"]["f:labels"]
    return labels


def _invented(manager: str, fields: Mapping[str, Any], **more: str) -> dict[str, Any]:
    return {
        "manager": manager,
        "operation": "Update",
        "apiVersion": "v1",
        "time": "2026-01-01T00:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": dict(fields),
        **more,
    }


def _add_taint_to(manager: str) -> Callable[[list[dict[str, Any]]], None]:
    def change(managed: list[dict[str, Any]]) -> None:
        _entry(managed, manager)["fieldsV1"].setdefault("f:spec", {})["f:taints"] = {}

    return change


def _drop_hostname(managed: list[dict[str, Any]]) -> None:
    del _labels_of(managed, "Python-urllib")["f:kubernetes.io/hostname"]


def _drop_admins_entry(managed: list[dict[str, Any]]) -> None:
    managed.remove(_entry(managed, "Python-urllib"))


def _add_manager(managed: list[dict[str, Any]]) -> None:
    managed.append(_invented("kubectl-edit", {"f:spec": {"f:taints": {}}}))


def _add_managers(managed: list[dict[str, Any]]) -> None:
    for i in range(1500):
        managed.append(_invented(f"invented-{i:05d}-" + "x" * 100, {"f:metadata": {}}))


def _add_a_fat_manager(managed: list[dict[str, Any]]) -> None:
    """About 300 KB more on the Node, which every watcher of Nodes would receive."""
    labels: dict[str, Any] = {
        f"f:example.com/invented-{i:05d}-" + "x" * 100: {} for i in range(2500)
    }
    managed.append(_invented("invented", {"f:metadata": {"f:labels": labels}}))


def _give_the_label_to_the_admin(managed: list[dict[str, Any]]) -> None:
    _labels_of(managed, "Python-urllib")[f"f:{DP}"] = {}


def _take_the_label_from_the_operator(managed: list[dict[str, Any]]) -> None:
    managed.remove(_entry(managed, "gpu-operator"))


def _grow_gpuguards_entry(managed: list[dict[str, Any]]) -> None:
    labels = _labels_of(managed, "gpuguard")
    for i in range(2000):
        labels[f"f:example.com/invented-{i:05d}-" + "x" * 100] = {}


def _give_gpuguard_the_admins_cordon(managed: list[dict[str, Any]]) -> None:
    del _entry(managed, "Python-urllib")["fieldsV1"]["f:spec"]["f:unschedulable"]
    _entry(managed, "gpuguard")["fieldsV1"]["f:spec"] = {"f:unschedulable": {}}


def _add_a_third_gpuguard_entry(managed: list[dict[str, Any]]) -> None:
    managed.append(
        _invented("gpuguard", {"f:metadata": {"f:labels": {f"f:{DP}": {}}}}, subresource="scale")
    )


@dataclass(frozen=True)
class Step:
    """One write before a case's request: by the admin (field manager ``manager``, a merge
    patch, or ``content_type``) or by the agent's token (field manager gpuguard)."""

    patch: object
    by: str = "admin"
    manager: str = "Python-urllib"  # what the API server names the admin's client
    content_type: str = MERGE


# What an admin (or an earlier request of the agent) left on the Node before a case's request:
# the cordon and the marker the fence's cordon rules read from the old Node, and who owns them
# (metadata.managedFields): the agent's cordon is written by the agent, as gpuguard.
ADMIN_CORDON = [Step({"spec": {"unschedulable": True}})]
AGENT_CORDON = [
    Step(
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}, "spec": {"unschedulable": True}},
        by="agent",
    )
]
# kubectl uncordon (and cordon) send a strategic merge patch of spec.unschedulable alone.
KUBECTL_UNCORDON = Step(
    {"spec": {"unschedulable": None}}, manager="kubectl-cordon", content_type=STRATEGIC
)
KUBECTL_CORDON = Step(
    {"spec": {"unschedulable": True}}, manager="kubectl-cordon", content_type=STRATEGIC
)
# The agent's cordon, lifted by an admin: its marker stays behind.
STALE_MARKER = [*AGENT_CORDON, KUBECTL_UNCORDON]
GIVEN: dict[str, list[Step]] = {
    "lift its own cordon with its marker": AGENT_CORDON,
    "lift its own cordon with unschedulable false": AGENT_CORDON,
    "lift its own cordon by JSON patch": AGENT_CORDON,
    "remove the marker from its own cordon (the cordon stays)": AGENT_CORDON,
    "remove a stale marker from a schedulable node": STALE_MARKER,
    "remove a marker of another value": [
        Step({"metadata": {"annotations": {CORDONED_BY: "alice"}}, "spec": {"unschedulable": True}})
    ],
    "cordon a schedulable node that carries a stale marker": STALE_MARKER,
    "relabel under an admin's cordon": ADMIN_CORDON,
    "relabel beside a stale marker": STALE_MARKER,
    "lifting an admin's cordon": ADMIN_CORDON,
    "lifting an admin's cordon with unschedulable false": ADMIN_CORDON,
    "lifting an admin's cordon by JSON patch": ADMIN_CORDON,
    "lifting an admin's cordon by server-side apply": ADMIN_CORDON,
    "lifting an admin's cordon and marking it in one request": ADMIN_CORDON,
    "marking an admin's cordon as its own": ADMIN_CORDON,
    "marking an admin's cordon as its own, with the cordon resent": ADMIN_CORDON,
    "marking an admin's cordon by overwriting another marker": [
        Step({"metadata": {"annotations": {CORDONED_BY: "alice"}}, "spec": {"unschedulable": True}})
    ],
    "lifting its own cordon but keeping the marker": AGENT_CORDON,
    "changing the marker of its own cordon": AGENT_CORDON,
    "removing the mig label": [Step({"metadata": {"labels": {MIG: "all-1g.5gb"}}})],
    "lifting its cordon after an admin lifted it and cordoned again (kubectl)": [
        *STALE_MARKER,
        KUBECTL_CORDON,
    ],
    "lifting its cordon that an admin also applied (server-side apply)": [
        *AGENT_CORDON,
        Step(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "{node}"},
                "spec": {"unschedulable": True},
            },
            manager="maintenance",
            content_type=APPLY,
        ),
    ],
    "relabel a label another manager owns alone (its entry goes)": [
        Step({"metadata": {"labels": {MIG: "all-disabled"}}}, manager="gpu-operator")
    ],
    "cordon a node without annotations (the agent's write creates the map)": [
        Step({"metadata": {"annotations": {"example.com/owner": None}}})
    ],
    "the agent's own label taken from another manager without a change": [
        Step({"metadata": {"labels": {MIG: "all-disabled"}}}, manager="gpu-operator")
    ],
    "another manager's entry given the agent's label": [
        Step({"metadata": {"labels": {DP: "slice-4"}}}, by="agent")
    ],
    "gpuguard's entry given a field that is not the agent's": [
        Step({"metadata": {"labels": {DP: "slice-4"}}}, by="agent")
    ],
    "gpuguard's entry grown by 250 KB of invented labels": [
        Step({"metadata": {"labels": {DP: "slice-4"}}}, by="agent")
    ],
    "an admin's cordon given to gpuguard alone": [
        Step({"metadata": {"labels": {DP: "slice-4"}}}, by="agent"),
        *ADMIN_CORDON,
    ],
}


def test_every_given_state_starts_a_case() -> None:
    assert set(GIVEN) <= set(ALLOWED) | set(DENIED)


def _cordon(node: Mapping[str, Any]) -> tuple[bool, str | None]:
    """``(spec.unschedulable, the marker's value)`` of a Node."""
    annotations = node["metadata"].get("annotations") or {}
    return node["spec"].get("unschedulable") is True, annotations.get(CORDONED_BY)


def _given(fence: Fence, node: str, what: str) -> None:
    """Put the Node in the state the case starts from: the admin's writes, and the agent's
    (with a token of the agent's on ``node``)."""
    for step in GIVEN.get(what, []):
        patch = _fill(step.patch, node)
        if step.by == "agent":
            got = fence.patch_node(fence.pod_token(node), node, patch, step.content_type)
            assert got.code == 200, got.text
            continue
        query = f"?fieldManager={step.manager}"
        if step.content_type == APPLY:
            query += "&force=true"
        fence.cluster.admin_request(
            "PATCH",
            f"/api/v1/nodes/{node}{query}",
            patch,  # type: ignore[arg-type]
            content_type=step.content_type,
        )


def _fill(patch: object, node: str, fence: Fence | None = None) -> object:
    """The patch for ``node``: ``{node}`` filled in; a callable is given the Node as it is."""
    if callable(patch):
        assert fence is not None
        patch = patch(fence.node(node))
    return json.loads(json.dumps(patch).replace("{node}", node))


@pytest.mark.parametrize("what", list(ALLOWED))
def test_the_agent_may_change_its_own_nodes_sharing_labels_cordon_and_annotation(
    fence: Fence, node: str, agent: str, what: str
) -> None:
    patch, content_type, check = ALLOWED[what]
    _given(fence, node, what)
    got = fence.patch_node(agent, node, _fill(patch, node, fence), content_type)
    assert got.code == 200, got.text
    assert check(fence.node(node))


def test_the_agent_cordons_and_uncordons_with_a_node_bound_token_too(
    fence: Fence, node: str
) -> None:
    token = fence.node_token(node)
    cordon = {"metadata": {"annotations": {CORDONED_BY: "agent"}}, "spec": {"unschedulable": True}}
    assert fence.patch_node(token, node, cordon).code == 200
    got = fence.node(node)
    assert got["spec"]["unschedulable"] is True
    assert got["metadata"]["annotations"][CORDONED_BY] == "agent"
    uncordon = {"metadata": {"annotations": {CORDONED_BY: None}}, "spec": {"unschedulable": None}}
    assert fence.patch_node(token, node, uncordon).code == 200
    got = fence.node(node)
    assert "unschedulable" not in got["spec"]
    assert CORDONED_BY not in got["metadata"]["annotations"]
    assert got["metadata"]["annotations"] == {"example.com/owner": "team-a"}


def test_the_agent_may_replace_its_node_when_only_the_allowed_keys_differ(
    fence: Fence, node: str, agent: str
) -> None:
    obj = fence.node(node)
    obj["metadata"]["labels"][DP] = "slice-8"
    obj["metadata"]["annotations"][CORDONED_BY] = "agent"
    obj["spec"]["unschedulable"] = True
    got = fence.request(
        agent, "PUT", f"/api/v1/nodes/{node}?fieldManager=gpuguard", obj, "application/json"
    )
    assert got.code == 200, got.text
    assert fence.node(node)["metadata"]["labels"][DP] == "slice-8"


# -- denied -------------------------------------------------------------------------------------

LABELS_ONLY = "may change only the labels nvidia.com/device-plugin.config and nvidia.com/mig.config"
SET_NOT_REMOVE = (
    "may set the labels nvidia.com/device-plugin.config and nvidia.com/mig.config of a Node, "
    "not remove them"
)
NOT_ITS_CORDON = (
    "gpuguard may lift only its own cordon: this Node's cordon does not carry the annotation "
    "gpuguard.io/cordoned-by: agent"
)
NOT_ALONE = "gpuguard may lift only its own cordon: spec.unschedulable of this Node is managed by "
ADDED = "gpuguard may not add field managers to a Node's metadata.managedFields: "
FORGED = (
    "gpuguard may not rewrite the metadata.managedFields of a Node (field ownership the API "
    "server did not give): "
)
MARKER_ONLY_WITH_CORDON = (
    "gpuguard may set the annotation gpuguard.io/cordoned-by only to agent, and only together "
    "with its cordon of a schedulable Node"
)
DENIED: dict[str, tuple[object, str, str]] = {
    "a third label": (
        {"metadata": {"labels": {"example.com/pool": "a"}}},
        MERGE,
        f"{LABELS_ONLY} of a Node, not: example.com/pool",
    ),
    "a third label next to an allowed one": (
        {"metadata": {"labels": {DP: "slice-4", "nvidia.com/gpu.replicas": "4"}}},
        MERGE,
        "not: nvidia.com/gpu.replicas",
    ),
    "removing another label": (
        {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
        MERGE,
        "not: kubernetes.io/hostname",
    ),
    "changing another label": (
        {"metadata": {"labels": {"nvidia.com/gpu.product": "A100"}}},
        MERGE,
        "not: nvidia.com/gpu.product",
    ),
    "a taint": (
        {"spec": {"taints": [{"key": "gpu", "value": "x", "effect": "NoSchedule"}]}},
        MERGE,
        "may change only spec.unschedulable of a Node, not: spec.taints",
    ),
    "a taint next to the cordon": (
        {
            "spec": {
                "unschedulable": True,
                "taints": [{"key": "gpu", "value": "x", "effect": "NoSchedule"}],
            }
        },
        STRATEGIC,
        "not: spec.taints",
    ),
    "podCIDR": ({"spec": {"podCIDR": "10.9.0.0/24"}}, MERGE, "not: spec.podCIDR"),
    "providerID": ({"spec": {"providerID": "aws:///x/i-1"}}, MERGE, "not: spec.providerID"),
    "another annotation": (
        {"metadata": {"annotations": {"example.com/note": "x"}}},
        MERGE,
        "may change only the annotation gpuguard.io/cordoned-by of a Node, not: example.com/note",
    ),
    "removing another annotation": (
        {"metadata": {"annotations": {"example.com/owner": None}}},
        MERGE,
        "not: example.com/owner",
    ),
    "a finalizer": (
        {"metadata": {"finalizers": ["example.com/keep"]}},
        MERGE,
        "may not change a Node's metadata.finalizers",
    ),
    "a third label by JSON patch": (
        [{"op": "add", "path": "/metadata/labels/example.com~1pool", "value": "a"}],
        JSON_PATCH,
        "not: example.com/pool",
    ),
    "a third label by server-side apply": (
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "{node}", "labels": {"a": "b"}}},
        APPLY,
        "not: a",
    ),
    # The cordon, in both directions: only the agent's own cordon may be lifted,
    # and only the agent's cordon may carry its marker.
    "lifting an admin's cordon": (
        {"spec": {"unschedulable": None}},
        MERGE,
        NOT_ITS_CORDON,
    ),
    "lifting an admin's cordon with unschedulable false": (
        {"spec": {"unschedulable": False}},
        MERGE,
        NOT_ITS_CORDON,
    ),
    "lifting an admin's cordon by JSON patch": (
        [{"op": "remove", "path": "/spec/unschedulable"}],
        JSON_PATCH,
        NOT_ITS_CORDON,
    ),
    "lifting an admin's cordon by server-side apply": (
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "{node}"},
            "spec": {"unschedulable": False},
        },
        APPLY,
        NOT_ITS_CORDON,
    ),
    "lifting an admin's cordon and marking it in one request": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}, "spec": {"unschedulable": None}},
        MERGE,
        NOT_ITS_CORDON,
    ),
    "marking an admin's cordon as its own": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}},
        MERGE,
        MARKER_ONLY_WITH_CORDON,
    ),
    "marking an admin's cordon as its own, with the cordon resent": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}, "spec": {"unschedulable": True}},
        STRATEGIC,
        MARKER_ONLY_WITH_CORDON,
    ),
    "marking an admin's cordon by overwriting another marker": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}},
        MERGE,
        MARKER_ONLY_WITH_CORDON,
    ),
    "the marker without a cordon": (
        {"metadata": {"annotations": {CORDONED_BY: "agent"}}},
        MERGE,
        MARKER_ONLY_WITH_CORDON,
    ),
    "the marker with another value": (
        {"metadata": {"annotations": {CORDONED_BY: "admin"}}, "spec": {"unschedulable": True}},
        MERGE,
        MARKER_ONLY_WITH_CORDON,
    ),
    "changing the marker of its own cordon": (
        {"metadata": {"annotations": {CORDONED_BY: "admin"}}},
        MERGE,
        MARKER_ONLY_WITH_CORDON,
    ),
    "lifting its own cordon but keeping the marker": (
        {"spec": {"unschedulable": None}},
        MERGE,
        "gpuguard must remove the annotation gpuguard.io/cordoned-by together with its cordon",
    ),
    # The two labels may be set, not removed (the agent never removes them).
    "removing the device-plugin label": (
        {"metadata": {"labels": {DP: None}}},
        MERGE,
        f"{SET_NOT_REMOVE}: nvidia.com/device-plugin.config",
    ),
    "removing the mig label": (
        {"metadata": {"labels": {MIG: None}}},
        MERGE,
        f"{SET_NOT_REMOVE}: nvidia.com/mig.config",
    ),
    "removing the device-plugin label by JSON patch": (
        [{"op": "remove", "path": "/metadata/labels/nvidia.com~1device-plugin.config"}],
        JSON_PATCH,
        f"{SET_NOT_REMOVE}: nvidia.com/device-plugin.config",
    ),
    # The cordon is lifted only while gpuguard's field manager alone owns spec.unschedulable:
    # the marker the agent left stays behind when an admin uncordons, and proves nothing after.
    "lifting its cordon after an admin lifted it and cordoned again (kubectl)": (
        UNCORDON,
        MERGE,
        f"{NOT_ALONE}kubectl-cordon, not by gpuguard alone",
    ),
    "lifting its cordon that an admin also applied (server-side apply)": (
        UNCORDON,
        MERGE,
        "not by gpuguard alone",
    ),
    # metadata.managedFields: no other manager's entry changes but as the API server changes it
    # (a field this request changes goes to gpuguard), no new manager, and gpuguard's own
    # entries hold only the agent's fields.
    "a field added to another manager's entry": (
        _forge(_add_taint_to("Python-urllib")),
        MERGE,
        f"{FORGED}Python-urllib",
    ),
    "a field taken from another manager's entry": (_forge(_drop_hostname), MERGE, FORGED),
    "another manager's entry removed": (_forge(_drop_admins_entry), MERGE, FORGED),
    "every entry reset": ({"metadata": {"managedFields": [{}]}}, MERGE, FORGED),
    "another manager's entry given the agent's label": (
        _forge(_give_the_label_to_the_admin),
        MERGE,
        f"{FORGED}Python-urllib",
    ),
    "the agent's own label taken from another manager without a change": (
        _forge(_take_the_label_from_the_operator),
        MERGE,
        f"{FORGED}gpu-operator",
    ),
    "a new manager": (
        _forge(_add_manager),
        MERGE,
        f"{ADDED}kubectl-edit",
    ),
    "1500 new managers (the API server folds all but ten into ancient-changes)": (
        _forge(_add_managers),
        MERGE,
        f"{ADDED}ancient-changes",
    ),
    "a new manager with 300 KB of invented fields": (_forge(_add_a_fat_manager), MERGE, ADDED),
    "gpuguard's entry given a field that is not the agent's": (
        _forge(_add_taint_to("gpuguard")),
        MERGE,
        f"{FORGED}gpuguard",
    ),
    "gpuguard's entry grown by 250 KB of invented labels": (
        _forge(_grow_gpuguards_entry),
        MERGE,
        f"{FORGED}gpuguard",
    ),
    "an admin's cordon given to gpuguard alone": (
        _forge(_give_gpuguard_the_admins_cordon),
        MERGE,
        FORGED,
    ),
    "a third entry of gpuguard's": (
        _forge(_add_a_third_gpuguard_entry),
        MERGE,
        "gpuguard's own metadata.managedFields entries are at most two",
    ),
}


def _assert_denied(fence: Fence, got: Answer, message: str, node: str, before: object) -> None:
    assert got.code == 403, got.text
    status = json.loads(got.text)
    assert status["reason"] == "Forbidden"
    assert "ValidatingAdmissionPolicy 'gpuguard-agent-node-fence'" in status["message"]
    assert message in status["message"]
    assert _visible(fence.node(node)) == before


@pytest.mark.parametrize("what", list(DENIED))
def test_the_agent_may_change_nothing_else_on_its_own_node(
    fence: Fence, node: str, agent: str, what: str
) -> None:
    patch, content_type, message = DENIED[what]
    _given(fence, node, what)
    before = _visible(fence.node(node))
    got = fence.patch_node(agent, node, _fill(patch, node, fence), content_type)
    _assert_denied(fence, got, message, node, before)


def test_the_agent_may_not_replace_its_node_with_another_change(
    fence: Fence, node: str, agent: str
) -> None:
    before = _visible(fence.node(node))
    obj = fence.node(node)
    obj["metadata"]["labels"][DP] = "slice-8"
    obj["metadata"]["labels"]["example.com/pool"] = "a"
    got = fence.request(
        agent, "PUT", f"/api/v1/nodes/{node}?fieldManager=gpuguard", obj, "application/json"
    )
    _assert_denied(fence, got, "not: example.com/pool", node, before)


ALLOWED_ELSEWHERE: dict[str, object] = {
    "the device-plugin label": {"metadata": {"labels": {DP: "slice-4"}}},
    "the mig label": {"metadata": {"labels": {MIG: "all-1g.5gb"}}},
    "a cordon": {"spec": {"unschedulable": True}},
    "the cordoned-by annotation": {"metadata": {"annotations": {CORDONED_BY: "agent"}}},
}


@pytest.mark.parametrize("what", list(ALLOWED_ELSEWHERE))
def test_the_agent_may_not_change_another_node(
    fence: Fence, node: str, other_node: str, agent: str, what: str
) -> None:
    before = _visible(fence.node(other_node))
    got = fence.patch_node(agent, other_node, ALLOWED_ELSEWHERE[what])
    message = f"gpuguard on node {node} may not change another Node ({other_node})"
    _assert_denied(fence, got, message, other_node, before)


@pytest.mark.parametrize("what", list(ALLOWED_ELSEWHERE))
def test_a_token_that_names_no_node_may_change_nothing(fence: Fence, node: str, what: str) -> None:
    token = fence.cluster.sa_token(NS, SA)
    assert fence.request(token, "GET", f"/api/v1/nodes/{node}").code == 200  # RBAC lets it
    before = _visible(fence.node(node))
    got = fence.patch_node(token, node, ALLOWED_ELSEWHERE[what])
    message = "may change a Node only with a token that names its node"
    _assert_denied(fence, got, message, node, before)


def test_the_agent_may_not_write_its_nodes_status(fence: Fence, node: str, agent: str) -> None:
    before = fence.node(node)
    got = fence.patch_node(
        agent, node, {"status": {"capacity": {"nvidia.com/gpu": "8"}}}, sub="status"
    )
    _assert_denied(fence, got, "gpuguard may not update nodes/status", node, _visible(before))
    assert fence.node(node).get("status") == before.get("status")


# -- no false denials ---------------------------------------------------------------------------

EVERYTHING: dict[str, tuple[object, str]] = {
    **{what: (patch, ct) for what, (patch, ct, _) in DENIED.items()},
    "status": ({"status": {"capacity": {"nvidia.com/gpu": "8"}}}, "status"),
}


@pytest.mark.parametrize("what", list(EVERYTHING))
def test_the_policy_does_not_affect_the_admin(fence: Fence, node: str, what: str) -> None:
    patch, content_type = EVERYTHING[what]
    _given(fence, node, what)
    sub = "status" if content_type == "status" else ""
    path = f"/api/v1/nodes/{node}/{sub}".rstrip("/")
    if content_type == APPLY:
        path += "?fieldManager=admin&force=true"  # the given state is another manager's
    try:
        fence.cluster.admin_request(
            "PATCH",
            path,
            _fill(patch, node, fence),  # type: ignore[arg-type]
            content_type=MERGE if sub else content_type,
        )
    except AdminRequestError as e:
        pytest.fail(str(e))


def test_the_policy_does_not_affect_another_service_account_with_a_node_bound_token(
    fence: Fence, node: str, other_node: str
) -> None:
    token = fence.pod_token(node, sa=OTHER_SA)
    assert fence.user(token)["extra"]["authentication.kubernetes.io/node-name"] == [node]
    for patch in (
        {"metadata": {"labels": {"example.com/pool": "a", "kubernetes.io/hostname": None}}},
        {"metadata": {"annotations": {"example.com/note": "x"}}},
        {"spec": {"taints": [{"key": "gpu", "value": "x", "effect": "NoSchedule"}]}},
    ):
        for target in (node, other_node):
            got = fence.patch_node(token, target, patch)
            assert got.code == 200, got.text


# -- field ownership: what a forged managedFields would make an admin's write do --------------

MAINTENANCE_TAINT = {"key": "example.com/maintenance", "value": "disk", "effect": "NoSchedule"}


def test_forged_field_ownership_cannot_make_an_admins_unchanged_apply_remove_a_taint_or_label(
    fence: Fence, node: str, agent: str
) -> None:
    """The admin's server-side apply (manager ``maintenance``) owns a label; ``kubectl taint``
    (manager ``kubectl-taint``) set a NoSchedule taint. Had the agent's token moved the taint
    and the ``nvidia.com/gpu.product`` label into the apply's entry, the admin's next,
    unchanged apply would remove both (a server-side apply drops what its manager alone owned
    and no longer sends). The fence refuses the forged ownership, so the apply keeps them."""
    config = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node, "labels": {"example.com/pool": "a"}},
    }
    path = f"/api/v1/nodes/{node}"
    cluster = fence.cluster
    apply = f"{path}?fieldManager=maintenance&force=true"
    cluster.admin_request("PATCH", apply, config, content_type=APPLY)
    taints = [*fence.node(node)["spec"].get("taints", []), MAINTENANCE_TAINT]
    taint = {"spec": {"taints": taints}}
    cluster.admin_request(
        "PATCH", f"{path}?fieldManager=kubectl-taint", taint, content_type=STRATEGIC
    )

    def forge(managed: list[dict[str, Any]]) -> None:
        (applied,) = [e for e in managed if e["manager"] == "maintenance"]
        tainted = _entry(managed, "kubectl-taint")
        managed.remove(tainted)
        applied["fieldsV1"]["f:spec"] = tainted["fieldsV1"]["f:spec"]
        del _labels_of(managed, "Python-urllib")["f:nvidia.com/gpu.product"]
        applied["fieldsV1"]["f:metadata"]["f:labels"]["f:nvidia.com/gpu.product"] = {}

    before = _visible(fence.node(node))
    got = fence.patch_node(agent, node, _fill(_forge(forge), node, fence))
    _assert_denied(fence, got, FORGED, node, before)

    cluster.admin_request("PATCH", apply, config, content_type=APPLY)
    after = fence.node(node)
    assert MAINTENANCE_TAINT in after["spec"]["taints"]
    assert after["metadata"]["labels"]["nvidia.com/gpu.product"] == "Tesla-T4"
    assert after["metadata"]["labels"]["example.com/pool"] == "a"


# -- the agent's own writer through the fence ------------------------------------------------------


def test_every_patch_the_agents_writer_sends_passes_the_fence_on_its_own_node_only(
    fence: Fence, node: str, other_node: str, agent: str
) -> None:
    """No false denial of what ``KubeNodeWriter`` really sends (merge patches carrying the
    resourceVersion, field manager ``gpuguard``): labels, cordon, uncordon, forget; and the same
    writer aimed at another Node is refused by the fence."""
    from gpuguard.adapters.kube.agent import KubeNodeWriter
    from gpuguard.adapters.kube.client import load_api_client
    from gpuguard.core.agent import NodePatch
    from gpuguard.core.reconcile import CordonAction
    from gpuguard.errors import GpuguardError

    api = load_api_client(str(fence.cluster.kubeconfig_for_token(agent, name=f"agent-{node}")))
    try:
        writer = KubeNodeWriter(api, node_name=node)

        def version() -> str:
            rv: str = fence.node(node)["metadata"]["resourceVersion"]
            return rv

        steps = [
            NodePatch(resource_version="", labels={DP: "slice-4", MIG: "all-1g.10gb"}),
            NodePatch(resource_version="", cordon=CordonAction.CORDON),
            NodePatch(resource_version="", labels={MIG: "all-3g.40gb"}),
            NodePatch(resource_version="", cordon=CordonAction.UNCORDON),
            NodePatch(resource_version="", labels={DP: "slice-2"}, cordon=CordonAction.CORDON),
            NodePatch(resource_version="", cordon=CordonAction.FORGET),
        ]
        for step in steps:
            writer.patch_node(
                NodePatch(resource_version=version(), labels=step.labels, cordon=step.cordon)
            )
        after = fence.node(node)
        assert after["metadata"]["labels"][DP] == "slice-2"
        assert after["metadata"]["labels"][MIG] == "all-3g.40gb"
        assert after["spec"].get("unschedulable") is True
        assert CORDONED_BY not in after["metadata"].get("annotations", {})
        assert after["metadata"]["annotations"]["example.com/owner"] == "team-a"

        elsewhere = KubeNodeWriter(api, node_name=other_node)
        other_version = fence.node(other_node)["metadata"]["resourceVersion"]
        with pytest.raises(GpuguardError, match="may not change another Node"):
            elsewhere.patch_node(NodePatch(resource_version=other_version, labels={DP: "x"}))
        assert fence.node(other_node)["metadata"]["labels"][DP] == "slice-2"
    finally:
        api.close()  # type: ignore[no-untyped-call]


# -- Events: create only, core/v1, about Pods (the enforcer) or its own Node (the agent) ---------


def _event(kind: str, name: str, namespace: str, node: str, **more: object) -> dict[str, Any]:
    """A core/v1 Event as ``KubeEventSink`` builds it (source and reporting: gpuguard on
    ``node``), about ``kind`` ``name``; ``more`` replaces top-level keys."""
    involved = {"apiVersion": "v1", "kind": kind, "name": name, "uid": name}
    if kind == "Pod":
        involved["namespace"] = namespace
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{uuid.uuid4().hex}", "namespace": namespace},
        "involvedObject": involved,
        "reason": "GPUProcessKilled",
        "message": "test",
        "type": "Warning",
        "source": {"component": "gpuguard", "host": node},
        "reportingComponent": "gpuguard",
        "reportingInstance": node,
        "firstTimestamp": "2026-01-01T00:00:00Z",
        "lastTimestamp": "2026-01-01T00:00:00Z",
        "count": 1,
        "action": "GPUProcessKilled",
    }
    body.update(more)
    return body


def _kubelets_event(fence: Fence, namespace: str, about: str) -> dict[str, Any]:
    """An Event another component (the kubelet) posted, as the admin: what a patch grant
    would let gpuguard's token rewrite."""
    body = _event(
        "Pod" if namespace != "default" else "Node",
        about,
        namespace,
        about,
        source={"component": "kubelet", "host": about},
        reportingComponent="kubelet",
        reason="Killing",
    )
    created: dict[str, Any] = fence.cluster.admin_request(
        "POST", f"/api/v1/namespaces/{namespace}/events", body
    )
    return created


EVENT_FENCE = "ValidatingAdmissionPolicy 'gpuguard-{who}-event-fence'"
AS_ITSELF = "gpuguard may create Events only as itself on its node"


@dataclass(frozen=True)
class EventCase:
    who: str  # "enforcer" or "agent": whose pod-bound token (on ``node``) sends it
    body: Callable[[str, str], object]  # (node, other_node) -> the request body
    method: str = "POST"
    path: str = "/api/v1/namespaces/default/events"
    content_type: str = "application/json"
    denied_by: str = "fence"  # or "rbac"
    message: str = ""


def _patch_of(namespace: str, about_pod: bool = True) -> Callable[[Fence, str], str]:
    def path(fence: Fence, other: str) -> str:
        made = _kubelets_event(fence, namespace, other if not about_pod else "tenant-pod")
        return f"/api/v1/namespaces/{namespace}/events/{made['metadata']['name']}"

    return path


EVENTS_DENIED: dict[str, tuple[EventCase, Callable[[Fence, str], str] | None]] = {
    "the agent: an Event about another Node": (
        EventCase("agent", lambda n, o: _event("Node", o, "default", n, type="Warning"),
                  message="may create Events only about its own Node, not about Node"),
        None,
    ),
    "the agent: an Event about a Pod": (
        EventCase("agent", lambda n, o: _event("Pod", "p", "default", n),
                  message="may create Events only about its own Node, not about Pod p"),
        None,
    ),
    "the agent: an Event about its Node as the kubelet": (
        EventCase("agent", lambda n, o: _event("Node", n, "default", n,
                                              source={"component": "kubelet", "host": n}),
                  message=AS_ITSELF),
        None,
    ),
    "the agent: an Event about its Node reported from another node": (
        EventCase("agent", lambda n, o: _event("Node", n, "default", n, reportingInstance=o),
                  message=AS_ITSELF),
        None,
    ),
    "the agent: an Event about its Node naming another object as related": (
        EventCase("agent", lambda n, o: _event("Node", n, "default", n,
                                              related={"kind": "Node", "name": o}),
                  message=AS_ITSELF),
        None,
    ),
    "the agent: a patch of the kubelet's Event about another Node": (
        EventCase("agent", lambda n, o: {"message": "rewritten"}, method="PATCH",
                  content_type=MERGE, message="gpuguard only creates Events"),
        _patch_of("default", about_pod=False),
    ),
    "the agent: an events.k8s.io Event about its own Node": (
        EventCase("agent", lambda n, o: {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": f"{n}.{uuid.uuid4().hex}", "namespace": "default"},
            "eventTime": "2026-01-01T00:00:00.000000Z", "reportingController": "gpuguard",
            "reportingInstance": n, "action": "A", "reason": "SharingLabelsApplied",
            "type": "Normal", "regarding": {"apiVersion": "v1", "kind": "Node", "name": n},
        }, path="/apis/events.k8s.io/v1/namespaces/default/events",
            message="gpuguard creates core/v1 Events only, not events.k8s.io ones"),
        None,
    ),
    "the enforcer: an Event about a Node": (
        EventCase("enforcer", lambda n, o: _event("Node", o, "default", n),
                  message="gpuguard's enforcer may create Events only about Pods, not about Node"),
        None,
    ),
    "the enforcer: an Event about a tenant's Pod as the kubelet": (
        EventCase("enforcer", lambda n, o: _event("Pod", "p", "tenant", n,
                                                 reportingComponent="kubelet"),
                  path="/api/v1/namespaces/tenant/events", message=AS_ITSELF),
        None,
    ),
    "the enforcer: an Event about a Pod reported from another node": (
        EventCase("enforcer", lambda n, o: _event("Pod", "p", "tenant", n,
                                                 source={"component": "gpuguard", "host": o}),
                  path="/api/v1/namespaces/tenant/events", message=AS_ITSELF),
        None,
    ),
    # The enforcer's RBAC (as shipped) grants create on core/v1 Events only.
    "the enforcer: a patch of a tenant's GPUProcessKilled": (
        EventCase("enforcer", lambda n, o: {"message": "rewritten"}, method="PATCH",
                  content_type=MERGE, denied_by="rbac"),
        _patch_of("tenant"),
    ),
    "the enforcer: a patch of a kube-system Event": (
        EventCase("enforcer", lambda n, o: {"message": "rewritten"}, method="PATCH",
                  content_type=MERGE, denied_by="rbac"),
        _patch_of("kube-system"),
    ),
    "the enforcer: an events.k8s.io Event": (
        EventCase("enforcer", lambda n, o: {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": f"p.{uuid.uuid4().hex}", "namespace": "tenant"},
            "eventTime": "2026-01-01T00:00:00.000000Z", "reportingController": "gpuguard",
            "reportingInstance": n, "action": "A", "reason": "GPUProcessKilled",
            "type": "Warning",
            "regarding": {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "tenant"},
        }, path="/apis/events.k8s.io/v1/namespaces/tenant/events", denied_by="rbac"),
        None,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def tenant(fence: Fence) -> str:
    fence.cluster.admin_request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tenant"}},
    )
    return "tenant"


@pytest.mark.parametrize("what", list(EVENTS_DENIED))
def test_each_account_may_create_only_its_own_events(
    fence: Fence, node: str, other_node: str, tenant: str, what: str
) -> None:
    case, target = EVENTS_DENIED[what]
    sa = SA if case.who == "agent" else ENFORCER_SA
    token = fence.pod_token(node, sa=sa)
    path = target(fence, other_node) if target is not None else case.path
    before = fence.cluster.admin_request("GET", path) if case.method == "PATCH" else None
    got = fence.request(token, case.method, path, case.body(node, other_node), case.content_type)
    assert got.code == 403, got.text
    message = json.loads(got.text)["message"]
    if case.denied_by == "rbac":
        assert "ValidatingAdmissionPolicy" not in message, message
        assert f"system:serviceaccount:{NS}:{sa}" in message, message
    else:
        assert EVENT_FENCE.format(who=case.who) in message, message
        assert case.message in message, message
    if before is not None:
        after = fence.cluster.admin_request("GET", path)
        assert after["message"] == before["message"]


def test_a_token_that_names_no_node_may_create_no_event(fence: Fence, node: str) -> None:
    for sa in (SA, ENFORCER_SA):
        token = fence.cluster.sa_token(NS, sa)
        kind = "Node" if sa == SA else "Pod"
        body = _event(kind, node if kind == "Node" else "p", "default", node)
        got = fence.request(
            token, "POST", "/api/v1/namespaces/default/events", body, "application/json"
        )
        assert got.code == 403, got.text
        assert "may create an Event only with a token that names its node" in got.text


def test_the_event_sinks_of_both_accounts_pass_their_fences(
    fence: Fence, node: str, tenant: str
) -> None:
    """No false denial of what ``KubeEventSink`` really sends: the enforcer's pod Events and
    the agent's Node Events, each with its account's pod-bound token."""
    from gpuguard.adapters.kube import KubeEventSink, load_api_client
    from gpuguard.core.model import EventReason, PodEvent, PodRef, PodUid
    from gpuguard.core.reconcile import NodeEvent, NodeEventReason

    pod = fence.cluster.create_pod(tenant, f"p-{_fresh()}", node=node)
    ref = PodRef(uid=PodUid(pod["metadata"]["uid"]), namespace=tenant, name=pod["metadata"]["name"])
    for sa in (ENFORCER_SA, SA):
        token = fence.pod_token(node, sa=sa)
        api = load_api_client(str(fence.cluster.kubeconfig_for_token(token, name=f"{sa}-{node}")))
        sink = KubeEventSink(api, node_name=node)
        sink.start()
        try:
            if sa == SA:
                sink.post_node(NodeEvent(reason=NodeEventReason.LABELS_APPLIED, message="m"))
            else:
                sink.post(
                    PodEvent(pod=ref, reason=EventReason.PROCESS_KILLED, message="m",
                             type="Warning")
                )  # fmt: skip
            assert sink.wait_idle(10.0)
            assert sink.problem() is None
            assert sink.stats().sent == 1
        finally:
            sink.stop(flush_seconds=0.5)
            api.close()  # type: ignore[no-untyped-call]


# -- the agent's check of its fence at start -----------------------------------------------------


def test_the_agents_start_check_finds_its_fence_in_force_and_a_fenceless_account_not(
    fence: Fence, node: str, agent: str
) -> None:
    """``KubeFenceProbe`` (what ``gpuguard agent`` runs before its first write): a dry-run patch
    of a label the fence refuses. With the agent's token the fence refuses it; with a token of
    an account the fence does not bind (RBAC lets it patch Nodes) the API server allows it,
    which the probe reports as ``FenceMissing``. Neither stores anything."""
    from gpuguard.adapters.kube.client import load_api_client
    from gpuguard.adapters.kube.fence import FENCE_PROBE_LABEL, KubeFenceProbe
    from gpuguard.errors import FenceMissing

    before = _visible(fence.node(node))
    for token, in_force in ((agent, True), (fence.pod_token(node, sa=OTHER_SA), False)):
        kubeconfig = fence.cluster.kubeconfig_for_token(token, name=f"probe-{_fresh()}")
        api = load_api_client(str(kubeconfig))
        try:
            probe = KubeFenceProbe(api, node_name=node)
            if in_force:
                probe.check_fence()
            else:
                with pytest.raises(FenceMissing, match=FENCE_PROBE_LABEL):
                    probe.check_fence()
        finally:
            api.close()  # type: ignore[no-untyped-call]
    assert _visible(fence.node(node)) == before
