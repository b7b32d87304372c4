"""KubePodDirectory against a real kube-apiserver, as gpuguard's least-privilege ServiceAccount.

Covers docs/reliability.md F2 (outage → stale → resync), F3 (410 Gone via etcd compaction), F4
(half-open watch), F6 (403 names verb and resource), F8 (same name, new uid).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.kube import KubePodDirectory, load_api_client
from gpuguard.core.model import LimitValue, PodUid
from gpuguard.errors import KubeForbidden, PermanentError
from rigs.controlplane import KubeCluster, TcpProxy, wait_until
from rigs.kubefixtures import ensure_service_account, service_account_with_rules
from tests.fakes import FakeRecorder

pytestmark = pytest.mark.apiserver

CID_A = "a" * 64
CID_B = "b" * 64


@contextmanager
def running_directory(kubeconfig: Path, node: str, **kwargs: Any) -> Iterator[KubePodDirectory]:
    api = load_api_client(str(kubeconfig))  # the production factory (urllib3 retries off)
    directory = KubePodDirectory(api, node_name=node, **kwargs)
    directory.start()
    try:
        yield directory
    finally:
        directory.stop()
        assert not directory.running, "watcher threads did not stop"
        api.close()  # type: ignore[no-untyped-call]


@contextmanager
def synced_directory(kubeconfig: Path, node: str, **kwargs: Any) -> Iterator[KubePodDirectory]:
    """``running_directory``, once its first list is in (20 s at most)."""
    with running_directory(kubeconfig, node, **kwargs) as directory:
        assert directory.wait_synced(20), directory.problem()
        yield directory


def names(directory: KubePodDirectory) -> dict[str, str]:
    """name → uid of the pods in the snapshot, keyed by uid only (not config hash)."""
    snap = directory.snapshot()
    return {p.name: p.uid for key, p in snap.pods.items() if key == p.uid}


def test_directory_syncs_this_nodes_pods_with_containers_limits_and_static_hashes(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    good = cluster.create_pod(
        namespace, "good", node=node_name, annotations={"gpuguard.io/gpu-memory-limit": "8Gi"}
    )
    cluster.set_container_statuses(
        namespace, "good", [{"name": "main", "containerID": f"containerd://{CID_A}"}]
    )
    bad = cluster.create_pod(
        namespace, "bad", node=node_name, annotations={"gpuguard.io/gpu-memory-limit": "8GB"}
    )
    static_hash = "0123456789abcdef0123456789abcdef"
    static = cluster.create_pod(
        namespace,
        "static",
        node=node_name,
        annotations={
            "kubernetes.io/config.hash": static_hash,
            "kubernetes.io/config.mirror": static_hash,
        },
    )
    # A tenant copying the hash alone (no mirror annotation) claims nothing.
    copier = cluster.create_pod(
        namespace,
        "a-copier",
        node=node_name,
        annotations={"kubernetes.io/config.hash": static_hash},
    )
    cluster.create_pod(namespace, "elsewhere", node=node_name + "-other")

    with synced_directory(gpuguard_kubeconfig(), node_name) as d:
        snap = d.snapshot()
        assert snap.synced
        assert snap.last_contact_at is not None
        assert names(d) == {
            "good": good["metadata"]["uid"],
            "bad": bad["metadata"]["uid"],
            "static": static["metadata"]["uid"],
            "a-copier": copier["metadata"]["uid"],
        }
        g = snap.lookup(PodUid(good["metadata"]["uid"]))
        assert g is not None
        assert g.namespace == namespace
        assert dict(g.containers) == {CID_A: "main"}
        assert g.annotation_limit == LimitValue(limit_bytes=8 * 2**30)
        assert g.annotation_error is None
        b = snap.lookup(PodUid(bad["metadata"]["uid"]))
        assert b is not None
        assert b.annotation_limit is None
        assert b.annotation_error
        by_hash = snap.lookup(PodUid(static_hash))
        assert by_hash is not None
        assert by_hash.uid == static["metadata"]["uid"]
        assert d.problem() is None


def test_directory_sees_pods_added_updated_and_deleted(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    with synced_directory(gpuguard_kubeconfig(), node_name) as d:
        assert names(d) == {}
        pod = cluster.create_pod(namespace, "p", node=node_name)
        uid = PodUid(pod["metadata"]["uid"])
        wait_until(lambda: d.snapshot().lookup(uid) is not None, what="ADDED")
        cluster.patch_pod(
            namespace, "p", {"metadata": {"annotations": {"gpuguard.io/gpu-memory-limit": "25%"}}}
        )

        def limit() -> LimitValue | None:
            p = d.snapshot().lookup(uid)
            return None if p is None else p.annotation_limit

        wait_until(lambda: limit() == LimitValue(percent=25.0), what="MODIFIED annotation")
        cluster.set_container_statuses(
            namespace, "p", [{"name": "main", "containerID": f"cri-o://{CID_B}"}]
        )
        wait_until(
            lambda: dict(d.snapshot().pods[uid].containers) == {CID_B: "main"},
            what="MODIFIED status",
        )
        cluster.delete_pod(namespace, "p")
        wait_until(lambda: d.snapshot().lookup(uid) is None, what="DELETED")


def test_a_pod_recreated_with_the_same_name_is_a_different_pod(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    with synced_directory(gpuguard_kubeconfig(), node_name) as d:
        old = PodUid(
            cluster.create_pod(
                namespace,
                "same",
                node=node_name,
                annotations={"gpuguard.io/gpu-memory-limit": "1Gi"},
            )["metadata"]["uid"]
        )
        wait_until(lambda: d.snapshot().lookup(old) is not None, what="the old pod")
        cluster.delete_pod(namespace, "same")
        new = PodUid(
            cluster.create_pod(
                namespace,
                "same",
                node=node_name,
                annotations={"gpuguard.io/gpu-memory-limit": "2Gi"},
            )["metadata"]["uid"]
        )
        assert new != old
        wait_until(lambda: d.snapshot().lookup(new) is not None, what="the new pod")
        snap = d.snapshot()
        assert snap.lookup(old) is None, "the old uid must not resolve to the new pod"
        pod = snap.lookup(new)
        assert pod is not None
        assert pod.annotation_limit == LimitValue(limit_bytes=2 * 2**30)
        assert names(d) == {"same": new}


def test_the_node_gives_replicas_and_mig_state_once_its_list_answered(
    cluster: KubeCluster,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    with synced_directory(gpuguard_kubeconfig(), node_name) as d:
        facts = d.node()
        assert facts.seen, "wait_synced covers the first Node list"
        assert (facts.name, facts.replicas, facts.mig_config_state) == (node_name, None, None)
        cluster.create_node(node_name, {"nvidia.com/gpu.replicas": "4"})
        wait_until(lambda: d.node().replicas == 4, what="replicas label")
        assert d.node().name == node_name
        cluster.label_node(
            node_name, {"nvidia.com/gpu.replicas": "x", "nvidia.com/mig.config.state": "pending"}
        )
        wait_until(lambda: d.node().mig_config_state == "pending", what="mig.config.state label")
        assert d.node().replicas is None, "an invalid replicas label is unknown, not 0 or 1"


def test_an_apiserver_outage_makes_the_snapshot_stale_and_a_restart_resyncs(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    kept = PodUid(cluster.create_pod(namespace, "kept", node=node_name)["metadata"]["uid"])
    health = FakeRecorder()
    with synced_directory(
        gpuguard_kubeconfig(), node_name, watch_timeout_seconds=2.0, health=health
    ) as d:
        first = d.snapshot().last_contact_at
        assert first is not None
        wait_until(
            lambda: (d.snapshot().last_contact_at or 0) > first,
            what="contact to advance while healthy (re-watch at the server timeout)",
        )
        cluster.stop_apiserver()
        stopped_at = time.monotonic()
        time.sleep(1.0)  # let in-flight reads fail
        frozen = d.snapshot().last_contact_at
        time.sleep(4.0)  # two watch timeouts: a healthy directory would have advanced
        during = d.snapshot()
        assert during.last_contact_at == frozen, "no contact can happen while the API is down"
        assert frozen is not None
        assert frozen <= stopped_at + 0.5
        assert during.synced, "the cache is kept (stale), not dropped"
        assert during.lookup(kept) is not None
        cluster.start_apiserver()
        added = PodUid(cluster.create_pod(namespace, "added", node=node_name)["metadata"]["uid"])
        cluster.delete_pod(namespace, "kept")
        wait_until(
            lambda: d.snapshot().lookup(added) is not None and d.snapshot().lookup(kept) is None,
            timeout=60,
            what="resync after the restart",
        )
        assert (d.snapshot().last_contact_at or 0) > frozen
        assert ("pods", "error") in health.watch_restarts
        assert ("pods", "timeout") in health.watch_restarts, "healthy windows ended on time"


def test_a_410_after_etcd_compaction_relists_without_duplicates_or_ghosts(
    cluster_without_watch_cache: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
    proxy: TcpProxy,
) -> None:
    cluster = cluster_without_watch_cache
    health = FakeRecorder()
    gone_pod = PodUid(cluster.create_pod(namespace, "gone", node=node_name)["metadata"]["uid"])
    changed = PodUid(cluster.create_pod(namespace, "changed", node=node_name)["metadata"]["uid"])
    with synced_directory(
        gpuguard_kubeconfig(server=proxy.url), node_name, watch_timeout_seconds=2.0, health=health
    ) as d:
        assert set(names(d)) == {"gone", "changed"}
        proxy.partition()  # this node loses the API server; the cluster goes on
        cluster.delete_pod(namespace, "gone")
        cluster.patch_pod(
            namespace,
            "changed",
            {"metadata": {"annotations": {"gpuguard.io/gpu-memory-limit": "3Gi"}}},
        )
        born = PodUid(cluster.create_pod(namespace, "born", node=node_name)["metadata"]["uid"])
        for i in range(5):  # unrelated churn, so the compaction point is past anything seen
            cluster.create_pod(namespace, f"noise-{i}", node=node_name + "-other")
        cluster.compact_etcd()
        assert d.snapshot().lookup(gone_pod) is not None, "still the pre-partition view"
        proxy.heal()

        def healed() -> bool:
            snap = d.snapshot()
            c = snap.lookup(changed)
            return (
                snap.lookup(gone_pod) is None
                and snap.lookup(born) is not None
                and c is not None
                and c.annotation_limit == LimitValue(limit_bytes=3 * 2**30)
            )

        wait_until(healed, timeout=60, what="relist after 410")
        assert ("pods", "expired") in health.watch_restarts, "the resync went through a 410"
        snap = d.snapshot()
        assert sorted(p.name for k, p in snap.pods.items() if k == p.uid) == ["born", "changed"]


def test_a_half_open_watch_is_dropped_and_redone(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
    proxy: TcpProxy,
) -> None:
    health = FakeRecorder()
    with synced_directory(
        gpuguard_kubeconfig(server=proxy.url),
        node_name,
        watch_timeout_seconds=2.0,
        inactivity_seconds=2.0,
        health=health,
    ) as d:
        proxy.freeze()  # connections stay open, nothing flows
        time.sleep(1.0)
        frozen = d.snapshot().last_contact_at
        time.sleep(5.0)
        assert d.snapshot().last_contact_at == frozen, "a silent connection is not contact"
        assert ("pods", "inactivity") in health.watch_restarts, "the silent watch was dropped"
        proxy.heal()
        uid = PodUid(cluster.create_pod(namespace, "after", node=node_name)["metadata"]["uid"])
        wait_until(lambda: d.snapshot().lookup(uid) is not None, timeout=30, what="recovery")


def test_without_rbac_the_directory_names_the_verb_and_resource_it_lacks(
    cluster: KubeCluster, namespace: str, node_name: str
) -> None:
    ensure_service_account(cluster, namespace, "nobody")
    kubeconfig = cluster.kubeconfig_for_sa(namespace, "nobody")
    with running_directory(kubeconfig, node_name) as d:
        wait_until(lambda: d.problem() is not None, what="a problem to be reported")
        problem = d.problem()
        assert isinstance(problem, KubeForbidden)
        assert "cannot 'list' 'pods' at cluster scope" in str(problem)
        assert "manifests/rbac.yaml" in str(problem)
        assert not d.snapshot().synced, "never synced: the runtime must not enforce"


def test_with_list_but_no_watch_the_directory_says_watch_is_missing(
    cluster: KubeCluster, namespace: str, node_name: str
) -> None:
    sa = f"listonly-{namespace}"
    service_account_with_rules(
        cluster,
        namespace,
        sa,
        [{"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["list"]}],
    )
    kubeconfig = cluster.kubeconfig_for_sa(namespace, sa)
    with running_directory(kubeconfig, node_name) as d:
        wait_until(lambda: d.problem() is not None, what="the missing watch to be reported")
        assert "cannot 'watch' 'pods' at cluster scope" in str(d.problem())
        assert d.snapshot().synced, "the list itself worked"


def test_an_api_server_unreachable_at_start_means_unsynced_until_it_answers(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
    proxy: TcpProxy,
) -> None:
    uid = PodUid(cluster.create_pod(namespace, "p", node=node_name)["metadata"]["uid"])
    kubeconfig = gpuguard_kubeconfig(server=proxy.url)
    proxy.partition()
    with running_directory(kubeconfig, node_name) as d:
        time.sleep(2.0)
        snap = d.snapshot()
        assert not snap.synced
        assert snap.last_contact_at is None
        assert d.problem() is None, "unreachable is transient, not a configuration problem"
        proxy.heal()
        assert d.wait_synced(40)
        assert d.snapshot().lookup(uid) is not None


def test_a_list_in_several_pages_is_one_consistent_view(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    uids = {
        PodUid(cluster.create_pod(namespace, f"p{i}", node=node_name)["metadata"]["uid"])
        for i in range(5)
    }
    health = FakeRecorder()
    with synced_directory(gpuguard_kubeconfig(), node_name, list_page_size=2, health=health) as d:
        assert set(d.snapshot().pods) == uids
        assert [r for r in health.watch_restarts if r[1] != "timeout"] == [], "listed once"


def test_a_list_answered_404_is_a_problem_reported_as_for_an_event_not_a_silent_retry(
    cluster: KubeCluster, namespace: str, node_name: str
) -> None:
    """One error table: a 404 will not fix itself, so the directory reports it (a
    ``PermanentError``, as an Event refused with it is dropped) instead of retrying it as a
    transient error forever with nothing said. Here the kubeconfig's server URL has a wrong path
    (a misrouted proxy), so every list is answered 404."""
    sa = f"wrongpath-{namespace}"
    service_account_with_rules(
        cluster,
        namespace,
        sa,
        [
            {"nonResourceURLs": ["/wrong-prefix", "/wrong-prefix/*"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["list", "watch"]},
        ],
    )
    kubeconfig = cluster.kubeconfig_for_sa(namespace, sa, server=cluster.server + "/wrong-prefix")
    health = FakeRecorder()
    with running_directory(kubeconfig, node_name, health=health) as d:
        wait_until(lambda: d.problem() is not None, what="the 404 to be reported")
        problem = d.problem()
        assert isinstance(problem, PermanentError)
        assert "list pods (cluster scope): HTTP 404" in str(problem)
        assert not d.snapshot().synced
        assert not d.wait_synced(0.1)
        assert ("pods", "error") in health.watch_restarts
