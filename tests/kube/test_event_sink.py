"""KubeEventSink against a real kube-apiserver: Events readable back (on pods, and on the Node
where ``kubectl describe node`` finds them), buffered through an outage (bounded, oldest dropped
and counted), rate-limited per pod and per Node, RBAC denial reported, and every drop counted in
the ``HealthRecorder`` by its reason."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.kube import KubeEventSink, load_api_client
from gpuguard.core.model import EventReason, PodEvent, PodRef, PodUid
from gpuguard.core.reconcile import NodeEvent, NodeEventReason
from gpuguard.errors import KubeForbidden
from rigs.controlplane import KubeCluster, TcpProxy, wait_until
from rigs.kubefixtures import ensure_service_account
from tests.fakes import FakeClock, FakeRecorder

pytestmark = pytest.mark.apiserver


@contextmanager
def running_sink(kubeconfig: Path, node: str, **kwargs: Any) -> Iterator[KubeEventSink]:
    api = load_api_client(str(kubeconfig))
    sink = KubeEventSink(api, node_name=node, **kwargs)
    sink.start()
    try:
        yield sink
    finally:
        sink.stop(flush_seconds=0.5)
        api.close()  # type: ignore[no-untyped-call]


@contextmanager
def rate_limited_sink(
    kubeconfig: Path, node: str
) -> Iterator[tuple[KubeEventSink, FakeClock, FakeRecorder]]:
    """A running sink whose rate limiter allows a burst of 2 per pod (and per Node) and one more
    every 10 s of its clock (a ``FakeClock`` the test advances); its drops counted in the
    ``FakeRecorder``."""
    clock = FakeClock(wall_now=1_780_000_000.0)  # the sink's rate limiter reads it
    health = FakeRecorder()
    with running_sink(
        kubeconfig,
        node,
        clock=clock,
        per_pod_burst=2,
        per_pod_refill_seconds=10,
        health=health,
    ) as sink:
        yield sink, clock, health


def pod_ref(cluster: KubeCluster, namespace: str, name: str, node: str) -> PodRef:
    pod = cluster.create_pod(namespace, name, node=node)
    return PodRef(uid=PodUid(pod["metadata"]["uid"]), namespace=namespace, name=name)


def events_of(cluster: KubeCluster, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.admin_request(
        "GET", f"/api/v1/namespaces/{namespace}/events"
    )["items"]
    return sorted(items, key=lambda e: e["message"])


def node_events_of(cluster: KubeCluster, node: str) -> list[dict[str, Any]]:
    """Events on the Node ``node`` in every namespace, found as ``kubectl describe node`` finds
    them (its field selector: kind, name and the node's name as UID)."""
    selector = f"involvedObject.kind=Node,involvedObject.name={node},involvedObject.uid={node}"
    items: list[dict[str, Any]] = cluster.admin_request(
        "GET", f"/api/v1/events?fieldSelector={selector}"
    )["items"]
    return sorted(items, key=lambda e: e["message"])


def test_posted_events_are_readable_back_on_the_pod(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    ref = pod_ref(cluster, namespace, "p", node_name)
    with running_sink(gpuguard_kubeconfig(), node_name) as sink:
        sink.post(
            PodEvent(pod=ref, reason=EventReason.LIMIT_EXCEEDED, message="uses 9 GiB of 8 GiB")
        )
        assert sink.wait_idle(20)
        assert sink.stats().sent == 1
    (event,) = events_of(cluster, namespace)
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": namespace,
        "name": "p",
        "uid": ref.uid,
    }
    assert event["reason"] == "GPUMemoryLimitExceeded"
    assert event["type"] == "Warning"
    assert event["message"] == "uses 9 GiB of 8 GiB"
    assert event["source"] == {"component": "gpuguard", "host": node_name}
    # ...and the API finds it the way `kubectl describe pod` does.
    by_uid = cluster.admin_request(
        "GET", f"/api/v1/namespaces/{namespace}/events?fieldSelector=involvedObject.uid={ref.uid}"
    )
    assert len(by_uid["items"]) == 1


def test_events_wait_out_an_outage_in_a_bounded_buffer_dropping_the_oldest(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
    proxy: TcpProxy,
) -> None:
    refs = [pod_ref(cluster, namespace, f"p{i}", node_name) for i in range(5)]
    health = FakeRecorder()
    with running_sink(
        gpuguard_kubeconfig(server=proxy.url), node_name, buffer_size=2, health=health
    ) as sink:
        proxy.partition()
        sink.post(PodEvent(pod=refs[0], reason=EventReason.PROCESS_KILLED, message="m0"))
        wait_until(lambda: sink.stats().in_flight == 1, what="m0 in flight (being retried)")
        assert sink.stats().pending == 1
        for i in range(1, 5):  # in-flight m0 + buffer of 2: m1, m2 are pushed out by m3, m4
            sink.post(PodEvent(pod=refs[i], reason=EventReason.PROCESS_KILLED, message=f"m{i}"))
        assert health.events_dropped == ["buffer_full", "buffer_full"]
        assert sink.stats().sent == 0
        proxy.heal()
        assert sink.wait_idle(40)
        stats = sink.stats()
        assert (stats.posted, stats.sent, stats.pending) == (5, 3, 0)
        assert health.events_dropped == ["buffer_full", "buffer_full"]
    assert [e["message"] for e in events_of(cluster, namespace)] == ["m0", "m3", "m4"]


def test_events_are_rate_limited_per_pod(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    noisy = pod_ref(cluster, namespace, "noisy", node_name)
    quiet = pod_ref(cluster, namespace, "quiet", node_name)
    with rate_limited_sink(gpuguard_kubeconfig(), node_name) as (sink, clock, health):
        for i in range(5):
            sink.post(PodEvent(pod=noisy, reason=EventReason.LIMIT_EXCEEDED, message=f"n{i}"))
        sink.post(PodEvent(pod=quiet, reason=EventReason.LIMIT_EXCEEDED, message="q0"))
        clock.now += 10.0  # one token back for the noisy pod
        sink.post(PodEvent(pod=noisy, reason=EventReason.LIMIT_EXCEEDED, message="n5"))
        assert sink.wait_idle(20)
        assert health.events_dropped == ["rate_limit"] * 3
    assert [e["message"] for e in events_of(cluster, namespace)] == ["n0", "n1", "n5", "q0"]


def test_an_event_sink_without_rbac_reports_the_verb_and_resource(
    cluster: KubeCluster, namespace: str, node_name: str
) -> None:
    ensure_service_account(cluster, namespace, "nobody")
    ref = pod_ref(cluster, namespace, "p", node_name)
    health = FakeRecorder()
    kubeconfig = cluster.kubeconfig_for_sa(namespace, "nobody")
    with running_sink(kubeconfig, node_name, health=health) as sink:
        sink.post(PodEvent(pod=ref, reason=EventReason.INVALID_LIMIT, message="8GB"))
        assert sink.wait_idle(20)
        assert health.events_dropped == ["api_error"]
        problem = sink.problem()
        assert isinstance(problem, KubeForbidden)
        assert "cannot 'create' 'events'" in str(problem)
    assert events_of(cluster, namespace) == []


def test_a_retry_of_an_event_the_server_already_stored_is_not_a_duplicate(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    """The response to a create can be lost after the API server stored the Event (a dropped
    connection); the retry sends the same name, gets 409 and counts it as sent."""
    ref = pod_ref(cluster, namespace, "p", node_name)
    event = PodEvent(pod=ref, reason=EventReason.LIMIT_EXCEEDED, message="uses 9 GiB of 8 GiB")
    api = load_api_client(str(gpuguard_kubeconfig()))
    try:
        sink = KubeEventSink(api, node_name=node_name)
        body = sink.event_body(event)
        sink._send(namespace, body)  # the attempt whose response was lost
        sink._send(namespace, body)  # the retry: must not raise, must not create a second Event
    finally:
        api.close()  # type: ignore[no-untyped-call]
    assert [e["reason"] for e in events_of(cluster, namespace)] == ["GPUMemoryLimitExceeded"]


def test_an_event_the_api_server_refuses_for_good_is_dropped_as_an_api_error(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    """One error table: a 404 (the pod's namespace is gone) is not retried for an Event, as for
    a list it is a problem reported; the Event is counted as dropped (``api_error``) and the
    next one still goes out. The sink stays healthy: one refused Event is no configuration
    problem. (422 is decided by the same row: ``test_kube_translation``.)"""
    gone = PodRef(
        uid=PodUid("00000000-0000-4000-8000-000000000000"), namespace=f"{namespace}-gone", name="p"
    )
    ok = pod_ref(cluster, namespace, "ok", node_name)
    health = FakeRecorder()
    with running_sink(gpuguard_kubeconfig(), node_name, health=health) as sink:
        sink.post(PodEvent(pod=gone, reason=EventReason.LIMIT_EXCEEDED, message="refused"))
        sink.post(PodEvent(pod=ok, reason=EventReason.LIMIT_EXCEEDED, message="accepted"))
        assert sink.wait_idle(20), "a 404 must not be retried"
        assert health.events_dropped == ["api_error"]
        assert sink.problem() is None
    assert [e["message"] for e in events_of(cluster, namespace)] == ["accepted"]


def test_node_events_arrive_in_default_on_the_node_normal_or_warning_by_reason(
    cluster: KubeCluster,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    cluster.create_node(node_name)
    with running_sink(gpuguard_kubeconfig(), node_name) as sink:
        sink.post_node(NodeEvent(reason=NodeEventReason.LABELS_APPLIED, message="a applied"))
        sink.post_node(NodeEvent(reason=NodeEventReason.LABEL_CONFLICT, message="b reverted"))
        assert sink.wait_idle(20)
        assert sink.stats().sent == 2
    applied, conflict = node_events_of(cluster, node_name)
    for event in (applied, conflict):
        assert event["metadata"]["namespace"] == "default"
        assert event["involvedObject"] == {
            "apiVersion": "v1",
            "kind": "Node",
            "name": node_name,
            "uid": node_name,
        }
        assert event["source"] == {"component": "gpuguard", "host": node_name}
        assert event["reportingComponent"] == "gpuguard"
    assert (applied["reason"], applied["type"], applied["message"]) == (
        "SharingLabelsApplied",
        "Normal",
        "a applied",
    )
    assert (conflict["reason"], conflict["type"], conflict["message"]) == (
        "SharingLabelConflict",
        "Warning",
        "b reverted",
    )


def test_a_long_node_event_message_is_truncated_as_a_pod_events_is(
    cluster: KubeCluster,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    with running_sink(gpuguard_kubeconfig(), node_name) as sink:
        sink.post_node(NodeEvent(reason=NodeEventReason.CONFIG_INVALID, message="x" * 5000))
        assert sink.wait_idle(20)
    (event,) = node_events_of(cluster, node_name)
    assert event["message"] == "x" * 1023 + "…"
    assert event["type"] == "Warning"


def test_node_events_are_rate_limited_per_node_apart_from_the_pods(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    ref = pod_ref(cluster, namespace, "p", node_name)
    waiting = NodeEventReason.MIG_CHANGE_WAITING
    with rate_limited_sink(gpuguard_kubeconfig(), node_name) as (sink, clock, health):
        for i in range(4):
            sink.post_node(NodeEvent(reason=waiting, message=f"n{i}"))
        assert health.events_dropped == ["rate_limit"] * 2
        # The Node's bucket is its own: a pod on the node still has its burst.
        for i in range(2):
            sink.post(PodEvent(pod=ref, reason=EventReason.LIMIT_EXCEEDED, message=f"p{i}"))
        clock.now += 10.0  # one token back for the Node
        sink.post_node(NodeEvent(reason=waiting, message="n4"))
        sink.post_node(NodeEvent(reason=waiting, message="n5"))
        assert sink.wait_idle(20)
        assert health.events_dropped == ["rate_limit"] * 3
        stats = sink.stats()
        assert (stats.posted, stats.sent) == (8, 5)
    assert [e["message"] for e in node_events_of(cluster, node_name)] == ["n0", "n1", "n4"]
    assert [e["message"] for e in events_of(cluster, namespace)] == ["p0", "p1"]
