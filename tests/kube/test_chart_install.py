"""`helm install` of helm/gpuguard on a real control plane: the real etcd and
kube-apiserver, kube-controller-manager and kube-scheduler from the same Go module, and kwok
playing the kubelet of GPU nodes labelled the way NVIDIA's GPU operator labels them. The
DaemonSet controller must give every GPU node exactly one enforcer pod and one agent pod (two
DaemonSets) and a node without ``nvidia.com/gpu.present`` none; and each of the chart's two
ServiceAccounts, asked through SelfSubjectRulesReview, must hold exactly its golden rules below
(docs/reliability.md S1): only the agent's may patch Nodes.

This module starts its own cluster (it runs controllers; the session cluster must stay
controller-free). Every process is stopped by PID at module end, also after a failure. The
binaries: etcd, kube-apiserver and helm from scripts/ensure-testbin.sh; the controller-manager,
scheduler and kwok from scripts/ensure-controlplane.sh, which the fixture runs (cached after the
first build). Missing, they skip locally and fail in CI (rigs/prereq.py).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rigs.controlplane import (
    AdminRequestError,
    ControlPlane,
    KubeCluster,
    control_plane,
    helm_binary,
    helm_env,
    wait_until,
)
from rigs.kubefixtures import create_nvidia_runtime_class, ensure_namespace
from tests.chart_release import (
    AGENT_SELECTOR,
    ENFORCER_SELECTOR,
    GPU_TAINT,
    NAMESPACE,
    RELEASE,
    RELEASE_SELECTOR,
    gpu_operator_labels,
    is_ready,
    ready_nodes,
)

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "gpuguard"
GPU_OPERATOR_NAMESPACE = "gpu-operator"
SERVICE_ACCOUNT = "gpuguard"
AGENT_SERVICE_ACCOUNT = "gpuguard-agent"
AGENT_DAEMONSET = "gpuguard-agent"
GPU_NODES = {
    # One tainted node proves the chart's toleration (chart_release.GPU_TAINT).
    "gpu-a100-0": (gpu_operator_labels("NVIDIA-A100-SXM4-80GB", 8, 81920), [GPU_TAINT]),
    "gpu-a100-1": (gpu_operator_labels("NVIDIA-A100-SXM4-80GB", 8, 81920), []),
    "gpu-t4-0": (gpu_operator_labels("Tesla-T4", 4, 15360), []),
}
CPU_NODE = "cpu-0"
LATE_GPU_NODE = "gpu-l4-0"

# ---------------------------------------------------------------------------------------------
# The golden RBAC: what `kubectl auth can-i --list` would print for each of the chart's two
# ServiceAccounts, per namespace, with default values. Each (apiGroups, resources,
# resourceNames, verbs) row is expanded to (verb, group, resource, name) atoms, so how the
# authorizer splits or orders its rules does not matter; an extra verb, resource or name does.

Rule = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]
Atom = tuple[str, str, str, str]

# Every ServiceAccount's, from the API server's bootstrap policy: ask what one may do and who
# one is (system:basic-user), read the cluster's trust bundles (system:cluster-trust-bundle-
# discovery, bound to system:serviceaccounts).
EVERY_SERVICE_ACCOUNTS: list[Rule] = [
    (("certificates.k8s.io",), ("clustertrustbundles",), (), ("get", "list", "watch")),
    (
        ("authorization.k8s.io",),
        ("selfsubjectaccessreviews", "selfsubjectrulesreviews"),
        (),
        ("create",),
    ),
    (("authentication.k8s.io",), ("selfsubjectreviews",), (), ("create",)),
]
# Events: create, core/v1 only (no patch: a patch grant let a token rewrite any component's
# Events; what each account may create is fenced by its Event fence).
EVENTS: Rule = (("",), ("events",), (), ("create",))
# The enforcer's ClusterRole, in every namespace: its node's pods, its Node (the MIG state and
# the time-slicing replicas), Namespaces (the admin's exempt label, the exempt names that
# exist), Events on pods, DRA claims by name and its node's ResourceSlices.
# Its one Node write: patch of nodes/status, for its GPUMemoryEnforced condition (fenced to its
# own Node and that condition by the condition fence).
ENFORCER_WIDE: list[Rule] = [
    (("",), ("pods",), (), ("get", "list", "watch")),
    (("",), ("nodes",), (), ("get", "list", "watch")),
    (("",), ("nodes/status",), (), ("patch",)),
    (("",), ("namespaces",), (), ("get", "list", "watch")),
    EVENTS,
    (("resource.k8s.io",), ("resourceclaims",), (), ("get",)),
    (("resource.k8s.io",), ("resourceslices",), (), ("list", "watch")),
]
# The agent's ClusterRole, in every namespace: its Node (patched under the admission fence) and
# its node's pods; its Events (on its Node) only in default.
AGENT_WIDE: list[Rule] = [
    (("",), ("nodes",), (), ("get", "list", "watch", "patch")),
    (("",), ("pods",), (), ("get", "list", "watch")),
]
GOLDEN_RULES: dict[tuple[str, str], list[Rule]] = {
    **{
        (SERVICE_ACCOUNT, ns): [*EVERY_SERVICE_ACCOUNTS, *ENFORCER_WIDE]
        for ns in (NAMESPACE, GPU_OPERATOR_NAMESPACE, "default")
    },
    (AGENT_SERVICE_ACCOUNT, NAMESPACE): [
        *EVERY_SERVICE_ACCOUNTS,
        *AGENT_WIDE,
        (("",), ("configmaps",), ("gpuguard-sharing",), ("get", "list", "watch")),
    ],
    (AGENT_SERVICE_ACCOUNT, GPU_OPERATOR_NAMESPACE): [
        *EVERY_SERVICE_ACCOUNTS,
        *AGENT_WIDE,
        (
            ("",),
            ("configmaps",),
            ("nvidia-mig-config", "nvidia-time-slicing-config"),
            ("get", "list", "watch"),
        ),
    ],
    (AGENT_SERVICE_ACCOUNT, "default"): [*EVERY_SERVICE_ACCOUNTS, *AGENT_WIDE, EVENTS],
}
# Every ServiceAccount's, read-only: API discovery and health (system:discovery,
# system:public-info-viewer) and the issuer's OIDC discovery (system:service-account-issuer-
# discovery).
GOLDEN_NON_RESOURCE = {
    ("get", url)
    for url in (
        "/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*",
        "/readyz", "/version", "/version/", "/.well-known/openid-configuration",
        "/.well-known/openid-configuration/", "/openid/v1/jwks", "/openid/v1/jwks/",
    )
}  # fmt: skip


def atoms(rules: Iterable[Rule]) -> set[Atom]:
    return {
        (verb, group, resource, name)
        for groups, resources, names, verbs in rules
        for verb in verbs
        for group in groups
        for resource in resources
        for name in names or ("",)
    }


# ---------------------------------------------------------------------------------------------
# Fixtures


@dataclass(frozen=True, slots=True, kw_only=True)
class Env:
    cluster: KubeCluster
    plane: ControlPlane
    helm: Path
    helm_env: Mapping[str, str]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Its own etcd + kube-apiserver + controller-manager + scheduler + kwok, stopped by PID."""
    helm = helm_binary()
    d = tmp_path_factory.mktemp("controlplane")
    with control_plane(d) as plane:
        yield Env(cluster=plane.cluster, plane=plane, helm=helm, helm_env=helm_env(d / "helm-home"))


def run_helm(env: Env, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env.helm), *args, f"--kubeconfig={env.cluster.admin_kubeconfig}"],
        env=dict(env.helm_env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def installed(env: Env) -> Env:
    """The GPU operator's side (namespace, RuntimeClass ``nvidia``), four kwok nodes, and the
    chart installed with default values, ``--wait`` until every DaemonSet pod is Ready."""
    c = env.cluster
    for ns in (NAMESPACE, GPU_OPERATOR_NAMESPACE):
        ensure_namespace(c, ns)
    create_nvidia_runtime_class(c)
    for name, (labels, taints) in GPU_NODES.items():
        env.plane.create_fake_node(name, labels=labels, taints=taints)
    env.plane.create_fake_node(CPU_NODE, labels={"node.kubernetes.io/instance-type": "m5.large"})
    wait_until(
        lambda: ready_nodes(c) >= {*GPU_NODES, CPU_NODE},
        timeout=60,
        what="kwok to mark the nodes Ready",
    )
    t0 = time.monotonic()
    done = run_helm(
        env, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--wait", "--timeout=150s"
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{env.plane.logs()}"
    print(f"helm install --wait: {time.monotonic() - t0:.1f}s")
    return env


# ---------------------------------------------------------------------------------------------
# Helpers


def gpuguard_pods(c: KubeCluster, selector: str = ENFORCER_SELECTOR) -> list[dict[str, Any]]:
    """The enforcer's pods (``selector``: another DaemonSet's), not being deleted."""
    path = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}"
    pods: list[dict[str, Any]] = c.admin_request("GET", path)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pods_by_node(c: KubeCluster, selector: str = ENFORCER_SELECTOR) -> dict[str, list[str]]:
    by_node: dict[str, list[str]] = {}
    for p in gpuguard_pods(c, selector):
        by_node.setdefault(p["spec"].get("nodeName", ""), []).append(p["metadata"]["name"])
    return by_node


def rules_review(c: KubeCluster, token: str, namespace: str) -> dict[str, Any]:
    """SelfSubjectRulesReview sent with ``token`` (as the ServiceAccount, not as admin)."""
    req = urllib.request.Request(
        f"{c.server}/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        method="POST",
        data=json.dumps(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectRulesReview",
                "spec": {"namespace": namespace},
            }
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    ctx = ssl.create_default_context(cafile=str(c.pki["ca.crt"]))
    with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
        status: dict[str, Any] = json.loads(r.read())["status"]
        return status


# ---------------------------------------------------------------------------------------------
# Tests (in order: the last one uninstalls)


@pytest.mark.parametrize("selector", [ENFORCER_SELECTOR, AGENT_SELECTOR], ids=["enforcer", "agent"])
def test_install_schedules_one_ready_pod_per_gpu_node_and_none_on_the_cpu_node(
    installed: Env, selector: str
) -> None:
    by_node = pods_by_node(installed.cluster, selector)
    assert by_node.keys() == set(GPU_NODES), by_node
    assert all(len(names) == 1 for names in by_node.values()), by_node
    assert CPU_NODE not in by_node
    assert all(is_ready(p) for p in gpuguard_pods(installed.cluster, selector))


def test_each_daemonset_owns_only_its_own_pods_under_its_own_service_account(
    installed: Env,
) -> None:
    """Two pods per GPU node, one per DaemonSet (no selector overlap: neither DaemonSet counts
    or adopts the other's pods), each pod running as its component's ServiceAccount."""
    c = installed.cluster
    every = gpuguard_pods(c, RELEASE_SELECTOR)
    accounts = {
        (p["metadata"]["ownerReferences"][0]["name"], p["spec"]["serviceAccountName"])
        for p in every
    }
    assert accounts == {(RELEASE, SERVICE_ACCOUNT), (AGENT_DAEMONSET, AGENT_SERVICE_ACCOUNT)}
    assert len(every) == 2 * len(GPU_NODES)
    containers = {
        p["spec"]["serviceAccountName"]: [k["name"] for k in p["spec"]["containers"]] for p in every
    }
    assert containers == {SERVICE_ACCOUNT: ["enforcer"], AGENT_SERVICE_ACCOUNT: ["agent"]}


def test_the_tainted_gpu_node_runs_its_pod_through_the_charts_toleration(
    installed: Env,
) -> None:
    (tainted,) = [n for n, (_, taints) in GPU_NODES.items() if taints]
    node = installed.cluster.admin_request("GET", f"/api/v1/nodes/{tainted}")
    assert any(GPU_TAINT.items() <= t.items() for t in node["spec"]["taints"]), node["spec"]
    pods = [p for p in gpuguard_pods(installed.cluster) if p["spec"]["nodeName"] == tainted]
    assert len(pods) == 1, pods_by_node(installed.cluster)
    assert is_ready(pods[0])


@pytest.mark.parametrize("name", [RELEASE, AGENT_DAEMONSET])
def test_the_daemonset_reports_every_gpu_node_scheduled_and_ready(
    installed: Env, name: str
) -> None:
    ds = installed.cluster.admin_request(
        "GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{name}"
    )
    status = ds["status"]
    assert status["desiredNumberScheduled"] == len(GPU_NODES)
    assert status["currentNumberScheduled"] == len(GPU_NODES)
    assert status["numberReady"] == len(GPU_NODES)
    assert status.get("numberMisscheduled", 0) == 0


def test_a_gpu_node_added_later_gets_its_pod_and_a_cpu_node_still_none(installed: Env) -> None:
    c = installed.cluster
    installed.plane.create_fake_node(
        LATE_GPU_NODE, labels=gpu_operator_labels("NVIDIA-L4", 1, 23034)
    )
    for selector in (ENFORCER_SELECTOR, AGENT_SELECTOR):
        wait_until(
            lambda selector=selector: any(
                p["spec"].get("nodeName") == LATE_GPU_NODE and is_ready(p)
                for p in gpuguard_pods(c, selector)
            ),
            timeout=60,
            what=f"a Ready pod ({selector}) on {LATE_GPU_NODE}",
        )
        by_node = pods_by_node(c, selector)
        assert by_node.keys() == {*GPU_NODES, LATE_GPU_NODE}, by_node
        assert all(len(names) == 1 for names in by_node.values()), by_node


@pytest.mark.parametrize(("account", "ns"), sorted(GOLDEN_RULES))
def test_the_service_accounts_rules_equal_the_golden_list(
    installed: Env, account: str, ns: str
) -> None:
    c = installed.cluster
    token = c.sa_token(NAMESPACE, account)
    review = rules_review(c, token, ns)
    assert review["incomplete"] is False, review.get("evaluationError")
    got: list[Rule] = [
        (
            tuple(r.get("apiGroups", ())),
            tuple(r.get("resources", ())),
            tuple(r.get("resourceNames", ())),
            tuple(r["verbs"]),
        )
        for r in review["resourceRules"]
    ]
    assert not [r for r in got if any("*" in part for field in r for part in field)], got
    assert atoms(got) == atoms(GOLDEN_RULES[(account, ns)])
    non_resource = {
        (verb, url) for r in review["nonResourceRules"] for verb in r["verbs"]
        for url in r["nonResourceURLs"]
    }  # fmt: skip
    assert non_resource == GOLDEN_NON_RESOURCE


def test_uninstall_removes_the_daemonset_and_its_pods(installed: Env) -> None:
    c = installed.cluster
    done = run_helm(installed, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=60s")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    for name in (RELEASE, AGENT_DAEMONSET):
        with pytest.raises(AdminRequestError) as gone:
            c.admin_request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{name}")
        assert gone.value.code == 404
    # The garbage collector deletes the DaemonSets' pods; kwok finishes their deletion.
    wait_until(
        lambda: (
            not c.admin_request(
                "GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={RELEASE_SELECTOR}"
            )["items"]
        ),
        timeout=60,
        what="the garbage collector and kwok to remove gpuguard's pods",
    )
