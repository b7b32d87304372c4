"""``KubePodDirectory(dra=True)`` on a real DRA control plane: the real etcd, kube-apiserver,
kube-controller-manager (with the ResourceClaim controller) and kube-scheduler v1.37.2, and kwok
playing the kubelet of one GPU node.

The objects are those of NVIDIA's DRA driver with ``--consumable-shares=memory``
(kubernetes-sigs/dra-driver-nvidia-gpu@9593204, recorded from a live run of that driver):
the DeviceClass ``gpu.nvidia.com``, one ResourceSlice per node (pool = node name, devices
``gpu-<minor>`` with a ``uuid`` attribute and a consumable ``memory`` capacity), claim templates
asking for ``10Gi`` and ``1500M`` (rounded up to 1431Mi by the scheduler), and a claim two pods
share. The directory reads them as the enforcer's ServiceAccount with the chart's RBAC
(manifests/rbac.yaml, which tests/test_chart.py proves equal to the rendered chart).

This module starts its own cluster (it runs controllers; the session cluster must stay
controller-free). Every process is stopped by PID at module end, also after a failure.
"""

from __future__ import annotations

import ssl
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.adapters.kube import KubePodDirectory, load_api_client
from gpuguard.adapters.kube.dra_claims import MISSING
from gpuguard.core.model import Declaration, LimitSource, Pod
from gpuguard.errors import KubeForbidden
from rigs import dra_objects
from rigs.controlplane import AdminRequestError, ControlPlane, KubeCluster, wait_until
from rigs.dra_cluster import start_dra_cluster
from rigs.kubefixtures import (
    RBAC_MANIFEST,
    SA_NAME,
    SA_NAMESPACE,
    ensure_namespace,
    service_account_with_rules,
)

pytestmark = pytest.mark.apiserver

NODE = "gpu-node-1"
DRIVER = dra_objects.DRIVER
RESOURCE = dra_objects.RESOURCE_API
MIB = dra_objects.MIB
GIB = 1 << 30
GPU_MEMORY = "81559Mi"  # H100 80GB HBM3 as NVML reports it, rounded down to 1Mi by the driver
UUIDS = ("GPU-6f1d6a5c-0b6e-4a55-9d1a-2f0e7c1a0001", "GPU-6f1d6a5c-0b6e-4a55-9d1a-2f0e7c1a0002")


def resource_slice(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node's slice as the driver publishes it for two H100s (``UUIDS``)."""
    return dra_objects.nvidia_slice(node, UUIDS, GPU_MEMORY, product="NVIDIA H100 80GB HBM3")


@dataclass(frozen=True, slots=True, kw_only=True)
class Env:
    cluster: KubeCluster
    plane: ControlPlane
    node: Mapping[str, Any]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Its own control plane with DRA, the chart's RBAC, the DeviceClass and a kwok GPU node."""
    dra = start_dra_cluster(tmp_path_factory.mktemp("dra"))
    try:
        node = dra.plane.create_fake_node(NODE)
        dra.post(f"{RESOURCE}/resourceslices", resource_slice(node))
        yield Env(cluster=dra.cluster, plane=dra.plane, node=node)
    finally:
        dra.close()


@pytest.fixture
def ns(env: Env) -> str:
    """A fresh namespace with the two claim templates and a claim two pods may share."""
    c = env.cluster
    name = f"t-{uuid.uuid4().hex[:8]}"
    ensure_namespace(c, name)
    for template, memory in (("gpu-10gi", "10Gi"), ("gpu-1500m", "1500M")):
        c.admin_request(
            "POST",
            f"{RESOURCE}/namespaces/{name}/resourceclaimtemplates",
            dra_objects.claim_template(name, template, memory),
        )
    c.admin_request(
        "POST",
        f"{RESOURCE}/namespaces/{name}/resourceclaims",
        dra_objects.resource_claim(name, "shared-20gi", "20Gi"),
    )
    return name


def create_pod(
    c: KubeCluster, ns: str, name: str, *, template: str | None = None, claim: str | None = None
) -> None:
    c.admin_request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        dra_objects.claim_pod(ns, name, node=NODE, template=template, claim=claim),
    )


def wait_running(env: Env, ns: str, *names: str) -> None:
    def running() -> bool:
        pods = env.cluster.admin_request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
        phase = {p["metadata"]["name"]: p.get("status", {}).get("phase") for p in pods}
        return all(phase.get(n) == "Running" for n in names)

    wait_until(running, timeout=90, what=f"{names} scheduled and Running ({env.plane.logs()})")


@contextmanager
def directory_as(env: Env, kubeconfig: Path, **kwargs: Any) -> Iterator[KubePodDirectory]:
    api = load_api_client(str(kubeconfig))
    directory = KubePodDirectory(api, node_name=NODE, dra=True, **kwargs)
    directory.start()
    try:
        assert directory.wait_synced(30)
        yield directory
    finally:
        directory.stop()
        assert not directory.running, "watcher threads did not stop"
        api.close()  # type: ignore[no-untyped-call]


def enforcer_kubeconfig(env: Env) -> Path:
    return env.cluster.kubeconfig_for_sa(SA_NAMESPACE, SA_NAME)


def pod(directory: KubePodDirectory, ns: str, name: str) -> Pod | None:
    for p in directory.snapshot().pods.values():
        if p.namespace == ns and p.name == name:
            return p
    return None


def dra_of(directory: KubePodDirectory, ns: str, name: str) -> Declaration | None:
    p = pod(directory, ns, name)
    return None if p is None else p.declared.get(LimitSource.DRA)


def resolved(directory: KubePodDirectory, ns: str, *names: str) -> bool:
    decls = [dra_of(directory, ns, n) for n in names]
    return all(
        d is not None and d.unresolved is None and d.shares and all(s.uuid for s in d.shares)
        for d in decls
    )


def unplaced(directory: KubePodDirectory, ns: str, name: str) -> bool:
    """The pod's shares cannot be placed on a GPU: unresolved, or a device no slice names
    (``uuid`` None, which core.limits turns into no limit on any device)."""
    d = dra_of(directory, ns, name)
    return d is not None and (d.unresolved is not None or any(s.uuid is None for s in d.shares))


def the_slice(env: Env) -> dict[str, Any]:
    items = env.cluster.admin_request(
        "GET", f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={NODE}"
    )["items"]
    assert len(items) == 1, items
    return dict(items[0])


def test_each_pod_carries_the_shares_the_scheduler_allocated_with_the_slices_uuid(
    env: Env, ns: str
) -> None:
    c = env.cluster
    create_pod(c, ns, "p10", template="gpu-10gi")
    create_pod(c, ns, "p1500", template="gpu-1500m")
    create_pod(c, ns, "s1", claim="shared-20gi")
    create_pod(c, ns, "s2", claim="shared-20gi")
    wait_running(env, ns, "p10", "p1500", "s1", "s2")
    with directory_as(env, enforcer_kubeconfig(env)) as d:
        wait_until(
            lambda: resolved(d, ns, "p10", "p1500", "s1", "s2"),
            timeout=30,
            what="every pod's DRA shares resolved",
        )
        assert d.problem() is None
        by_pod = {n: dra_of(d, ns, n) for n in ("p10", "p1500", "s1", "s2")}
        memory = {n: [s.memory_bytes for s in decl.shares] for n, decl in by_pod.items() if decl}
        # The limit is what the scheduler consumed: 1500M is rounded up to the 1Mi step.
        assert memory == {
            "p10": [10 * GIB], "p1500": [1431 * MIB], "s1": [20 * GIB], "s2": [20 * GIB]
        }  # fmt: skip
        for decl in by_pod.values():
            assert decl is not None
            for share in decl.shares:
                assert share.uuid in UUIDS
                assert (share.driver, share.pool) == (DRIVER, NODE)
                assert share.device == f"gpu-{UUIDS.index(share.uuid)}"
        shared = {(n, s.share_id, s.pods_sharing) for n in ("s1", "s2") for s in by_pod[n].shares}  # type: ignore[union-attr]
        assert len({share_id for _, share_id, _ in shared}) == 1, shared  # one share, two pods
        assert {count for _, _, count in shared} == {2}, shared

        # A pod deleted: its template claim is deleted with it (the claim controller), and the
        # directory forgets both; the shared claim is re-read for the pod left on it.
        p10_claims = [k for k in d.dra_claims() if k.namespace == ns and k.name.startswith("p10-")]
        assert len(p10_claims) == 1, dict(d.dra_claims())
        c.delete_pod(ns, "p10")
        c.delete_pod(ns, "s1")
        wait_until(
            lambda: pod(d, ns, "p10") is None and p10_claims[0] not in d.dra_claims(),
            timeout=30,
            what="p10 and its claim forgotten",
        )
        wait_until(
            lambda: [s.pods_sharing for s in (dra_of(d, ns, "s2") or Declaration()).shares] == [1],
            timeout=30,
            what="the shared claim re-read with one pod left on it",
        )
        wait_until(lambda: _gone(c, ns, p10_claims[0].name), timeout=30, what="p10's claim deleted")
        assert dict(d.dra_claims()).get(p10_claims[0]) in (None, MISSING)


def _gone(c: KubeCluster, ns: str, claim: str) -> bool:
    try:
        c.admin_request("GET", f"{RESOURCE}/namespaces/{ns}/resourceclaims/{claim}")
    except AdminRequestError as e:
        return e.code == 404
    return False


def test_a_reread_sees_a_claim_deleted_for_good_that_no_pod_change_announced(
    env: Env, ns: str
) -> None:
    """A claim deleted (its finalizer dropped: 404) while its pod runs changes no pod, so
    without a reread the share would stand until the 60 s refresh; ``reread`` (what a violation
    due to be acted on asks for) reads it at once, and a reread already answered since the
    moment asks for nothing."""
    c = env.cluster
    create_pod(c, ns, "p", template="gpu-10gi")
    wait_running(env, ns, "p")
    with directory_as(env, enforcer_kubeconfig(env)) as d:
        wait_until(lambda: resolved(d, ns, "p"), timeout=30, what="p resolved")
        first = dra_of(d, ns, "p")
        assert first is not None
        assert first.read_at is not None
        p = pod(d, ns, "p")
        assert p is not None
        moment = time.monotonic()
        d.reread({p.uid: moment})
        wait_until(
            lambda: ((dra_of(d, ns, "p") or Declaration()).read_at or 0.0) >= moment,
            timeout=5,
            what="the claim read again, unchanged, and the read published",
        )
        assert [s.memory_bytes for s in (dra_of(d, ns, "p") or Declaration()).shares] == [10 * GIB]

        (claim,) = [k for k in d.dra_claims() if k.namespace == ns and k.name.startswith("p-")]
        path = f"{RESOURCE}/namespaces/{ns}/resourceclaims/{claim.name}"
        c.admin_request("DELETE", path)
        c.admin_request(
            "PATCH",
            path,
            {"metadata": {"finalizers": None}},
            content_type="application/merge-patch+json",
        )
        wait_until(lambda: _gone(c, ns, claim.name), timeout=10, what="the claim gone")
        time.sleep(1.0)

        def shares() -> int:
            decl = dra_of(d, ns, "p")
            return 0 if decl is None else len(decl.shares)

        assert shares() == 1, "no pod changed: without a reread the share stands"
        d.reread({p.uid: time.monotonic()})
        wait_until(lambda: shares() == 0, timeout=5, what="the share forgotten after the reread")
        assert dict(d.dra_claims()).get(claim) == MISSING


def test_a_deleted_slice_leaves_the_pods_shares_unresolved_until_it_is_back(
    env: Env, ns: str
) -> None:
    c = env.cluster
    create_pod(c, ns, "p", template="gpu-10gi")
    wait_running(env, ns, "p")
    with directory_as(env, enforcer_kubeconfig(env)) as d:
        wait_until(lambda: resolved(d, ns, "p"), timeout=30, what="p resolved")
        old = the_slice(env)
        c.admin_request("DELETE", f"{RESOURCE}/resourceslices/{old['metadata']['name']}")
        # The claim keeps its allocation: only the device → uuid mapping is gone, and a share
        # that cannot be placed on a GPU is never a limit there (no signal on a guess).
        wait_until(
            lambda: unplaced(d, ns, "p"),
            timeout=30,
            what="p unresolved without the slice",
        )
        c.admin_request("POST", f"{RESOURCE}/resourceslices", resource_slice(env.node))
        wait_until(lambda: resolved(d, ns, "p"), timeout=30, what="p resolved again")


def test_without_get_on_claims_the_pods_are_unresolved_and_the_directory_says_why(
    env: Env, ns: str
) -> None:
    """The chart's enforcer rules minus ``get resourceclaims`` (read from manifests/rbac.yaml):
    a 403 on a claim is no limit and no signal, and ``problem()`` names the missing grant."""
    c = env.cluster
    rules = [r for r in chart_enforcer_rules() if r.get("resources") != ["resourceclaims"]]
    assert len(rules) == len(chart_enforcer_rules()) - 1
    sa = f"no-claims-{uuid.uuid4().hex[:6]}"
    service_account_with_rules(c, SA_NAMESPACE, sa, rules)
    create_pod(c, ns, "p", template="gpu-10gi")
    wait_running(env, ns, "p")
    with directory_as(env, c.kubeconfig_for_sa(SA_NAMESPACE, sa)) as d:
        wait_until(
            lambda: isinstance(d.problem(), KubeForbidden), timeout=30, what="a 403 reported"
        )
        assert "resourceclaims" in str(d.problem())
        decl = dra_of(d, ns, "p")
        assert decl is not None
        assert decl.unresolved is not None, decl
    # The chart's own rules suffice: the same pod resolves as the enforcer's account.
    with directory_as(env, enforcer_kubeconfig(env)) as d:
        wait_until(lambda: resolved(d, ns, "p"), timeout=30, what="p resolved")
        assert d.problem() is None


def chart_enforcer_rules() -> list[dict[str, Any]]:
    for doc in yaml.safe_load_all(RBAC_MANIFEST.read_text()):
        if doc and doc["kind"] == "ClusterRole" and doc["metadata"]["name"] == "gpuguard-enforcer":
            return list(doc["rules"])
    raise AssertionError("no ClusterRole gpuguard-enforcer in manifests/rbac.yaml")


def request_counts(c: KubeCluster) -> dict[tuple[str, str], float]:
    """``apiserver_request_total`` by (verb, resource) for resource.k8s.io, from the API
    server's own metrics."""
    ctx: ssl.SSLContext = c.ssl_context()
    with urllib.request.urlopen(c.server + "/metrics", context=ctx, timeout=30) as r:
        text = r.read().decode()
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{") or 'group="resource.k8s.io"' not in line:
            continue
        labels = dict(
            part.split("=", 1) for part in line[line.index("{") + 1 : line.rindex("}")].split(",")
        )
        key = (labels["verb"].strip('"'), labels["resource"].strip('"'))
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_a_quiet_minute_costs_a_bounded_number_of_requests(env: Env, ns: str) -> None:
    """8 DRA pods on the node, nothing changing for a minute: each claim is read again once per
    refresh (60 s; 2 allows for where the minute falls), the slices' watch is re-opened once
    per watch window (20 s), and the claims are never listed or watched."""
    c = env.cluster
    names = [f"p{i}" for i in range(8)]
    for i, name in enumerate(names):
        template = "gpu-10gi" if i % 2 else "gpu-1500m"
        create_pod(c, ns, name, template=template)
    wait_running(env, ns, *names)
    with directory_as(env, enforcer_kubeconfig(env)) as d:
        wait_until(lambda: resolved(d, ns, *names), timeout=60, what="8 pods resolved")
        before = request_counts(c)
        time.sleep(60)
        after = request_counts(c)
        assert d.problem() is None
        claims = len(d.dra_claims())  # this test's 8, and those of pods other tests left
    assert claims >= len(names)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    delta = {k: v for k, v in delta.items() if v}
    print("resource.k8s.io requests in a quiet minute:", delta)
    # Other clients (scheduler, claim controller) watch with 5-10 min windows: at most one
    # re-watch each in the minute. Nobody else GETs claims.
    assert delta.get(("GET", "resourceclaims"), 0.0) <= 2 * claims, delta
    assert delta.get(("LIST", "resourceclaims"), 0.0) == 0, delta
    assert delta.get(("LIST", "resourceslices"), 0.0) <= 1, delta
    assert delta.get(("WATCH", "resourceslices"), 0.0) <= 4 + 2, delta


DECOY_PODS, DECOY_CLAIMS = 16, 32
"""16 pods naming 32 claims each (the most a pod may name): 512, the node's whole budget."""


def test_decoy_pods_naming_claims_that_do_not_exist_crowd_out_no_running_pods_claims(
    env: Env, ns: str
) -> None:
    """A tenant's namespace that sorts before every other holds 16 pods that set
    ``spec.nodeName`` themselves (no scheduler, and nothing checks their claims exist), each
    naming 32 claims that do not exist: 512 names, as many as the node reads. Its own DRA pod,
    whose claim sorts after the decoys', and another tenant's DRA pod must still resolve (until
    now both sorted past the cap, unresolved, and held to no limit at all). kwok runs even the
    decoys (a real kubelet would leave them Pending, their claims read last): this is the harder
    case, where the 404 answers and the namespaces' turns keep them from crowding out."""
    c = env.cluster
    early = f"a0-{uuid.uuid4().hex[:6]}"
    assert early < ns
    ensure_namespace(c, early)
    c.admin_request(
        "POST",
        f"{RESOURCE}/namespaces/{early}/resourceclaimtemplates",
        dra_objects.claim_template(early, "gpu-10gi", "10Gi"),
    )
    decoys = [f"decoy-{p:02d}" for p in range(DECOY_PODS)]
    try:
        for name in decoys:
            claims = [f"{name}-{i:02d}" for i in range(DECOY_CLAIMS)]
            c.admin_request(
                "POST",
                f"/api/v1/namespaces/{early}/pods",
                dra_objects.bound_pod(early, name, node=NODE, claims=claims),
            )
        create_pod(c, early, "zz-trainer", template="gpu-10gi")
        create_pod(c, ns, "trainer", template="gpu-10gi")
        wait_running(env, early, "zz-trainer")
        wait_running(env, ns, "trainer")
        with directory_as(env, enforcer_kubeconfig(env)) as d:
            wait_until(
                lambda: resolved(d, ns, "trainer"),
                timeout=60,
                what="the other tenant's DRA pod resolved beside 512 claims that do not exist",
            )
            # The decoys' own tenant waits for its namespace's turns: its claim sorts after
            # the 512 it named, each one GET (a minute when the API server answers in 0.1 s).
            wait_until(
                lambda: resolved(d, early, "zz-trainer"),
                timeout=180,
                what="the decoys' tenant's own DRA pod resolved once its decoys were found gone",
            )
            for namespace, name in ((ns, "trainer"), (early, "zz-trainer")):
                decl = dra_of(d, namespace, name)
                assert decl is not None
                assert [s.memory_bytes for s in decl.shares] == [10 * GIB]
            states = dict(d.dra_claims())
            decoy_states = [
                v for k, v in states.items() if k.namespace == early and k.name.startswith("decoy-")
            ]
            assert len(decoy_states) == DECOY_PODS * DECOY_CLAIMS
            assert MISSING in decoy_states, "read, and found gone"
    finally:
        for name in decoys:
            c.delete_pod(early, name)


SLOW_GET_SECONDS = 0.1
"""A loaded API server's answer time for one claim GET (a CI run measured about this)."""


def test_a_running_pods_claim_is_published_while_a_slow_pass_over_decoys_goes_on(
    env: Env, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every claim GET answered in 0.1 s, as by a loaded API server, and 256 claims that do not
    exist named by decoy pods of a namespace that sorts first: a pass over them all is half a
    minute. Another tenant's running DRA pod must resolve within seconds: its claim is read in
    its namespace's turn and published without waiting for the pass to end (until now nothing
    was published before the whole pass, and claims were read in the order first seen)."""
    from kubernetes.client import ResourceV1Api

    real = ResourceV1Api.read_namespaced_resource_claim

    def slow(self: ResourceV1Api, *args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_GET_SECONDS)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ResourceV1Api, "read_namespaced_resource_claim", slow)
    c = env.cluster
    early = f"a0-{uuid.uuid4().hex[:6]}"
    assert early < ns
    ensure_namespace(c, early)
    decoys = [f"decoy-{p:02d}" for p in range(DECOY_PODS // 2)]
    try:
        for name in decoys:
            claims = [f"{name}-{i:02d}" for i in range(DECOY_CLAIMS)]
            c.admin_request(
                "POST",
                f"/api/v1/namespaces/{early}/pods",
                dra_objects.bound_pod(early, name, node=NODE, claims=claims),
            )
        create_pod(c, ns, "trainer", template="gpu-10gi")
        wait_running(env, ns, "trainer")
        with directory_as(env, enforcer_kubeconfig(env)) as d:
            started = time.monotonic()
            wait_until(
                lambda: resolved(d, ns, "trainer"),
                timeout=8,
                what="the running pod's claim published during the pass over 256 decoys",
            )
            took = time.monotonic() - started
            pass_seconds = len(decoys) * DECOY_CLAIMS * SLOW_GET_SECONDS
            assert took < pass_seconds / 3, (took, pass_seconds)
    finally:
        for name in decoys:
            c.delete_pod(early, name)
        c.delete_pod(ns, "trainer")
