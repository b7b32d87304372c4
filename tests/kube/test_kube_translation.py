"""The kube adapter's pure parts: JSON → model, the one error table, the retry loop's waits.

No API server needed; the behaviour against a real one is in the other modules here.
"""

from __future__ import annotations

import json
import random
import threading

import pytest
import urllib3
from kubernetes import client as k8s

from gpuguard.adapters.kube.errors import (
    Decision,
    KubeRejected,
    ResourceExpired,
    decision,
    restart_reason,
    translate_error,
)
from gpuguard.adapters.kube.retry import (
    BACKOFF_MAX_SECONDS,
    REPORTED_RETRY_SECONDS,
    backoff_seconds,
    retrying,
    wait_seconds,
)
from gpuguard.core.model import LimitValue, Pod, PodUid, ambiguous_config_hashes, index_pods
from gpuguard.errors import KubeError, KubeForbidden, PermanentError
from gpuguard.kubemodel.translate import node_facts_from_json, pod_from_json

UID = "0b9c2f4e-1111-4a5b-9c3d-123456789abc"


def pod_json(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "metadata": {"uid": UID, "name": "train", "namespace": "ml", "annotations": {}},
        "status": {},
    }
    base.update(overrides)
    return base


def test_container_ids_lose_their_runtime_prefix_and_empty_ids_are_skipped() -> None:
    pod = pod_from_json(
        pod_json(
            status={
                "initContainerStatuses": [{"name": "init", "containerID": "cri-o://" + "1" * 64}],
                "containerStatuses": [
                    {"name": "main", "containerID": "containerd://" + "2" * 64},
                    {"name": "waiting", "containerID": ""},
                    {"name": "legacy", "containerID": "docker://" + "3" * 64},
                ],
            }
        )
    )
    assert pod is not None
    assert dict(pod.containers) == {"1" * 64: "init", "2" * 64: "main", "3" * 64: "legacy"}


def test_a_valid_limit_annotation_is_parsed_and_an_invalid_one_keeps_its_reason() -> None:
    ok = pod_from_json(
        pod_json(
            metadata={
                "uid": UID,
                "name": "a",
                "namespace": "ml",
                "annotations": {"gpuguard.io/gpu-memory-limit": "1.5Gi"},
            }
        )
    )
    assert ok is not None
    assert ok.annotation_limit == LimitValue(limit_bytes=int(1.5 * 2**30))
    assert ok.annotation_error is None
    bad = pod_from_json(
        pod_json(
            metadata={
                "uid": UID,
                "name": "b",
                "namespace": "ml",
                "annotations": {"gpuguard.io/gpu-memory-limit": "8 Gi"},
            }
        )
    )
    assert bad is not None
    assert bad.annotation_limit is None
    assert bad.annotation_error


def mirror(
    name: str, namespace: str, uid: str, config_hash: str, *, mirror_value: str | None = None
) -> Pod:
    annotations = {"kubernetes.io/config.hash": config_hash}
    if mirror_value is not None:
        annotations["kubernetes.io/config.mirror"] = mirror_value
    got = pod_from_json(
        pod_json(metadata={"uid": uid, "name": name, "namespace": namespace,
                           "annotations": annotations})
    )  # fmt: skip
    assert got is not None
    return got


def test_a_kubelet_mirror_pod_carries_its_static_pods_hash() -> None:
    pod = mirror("etcd-n1", "kube-system", UID, "f" * 32, mirror_value="f" * 32)
    assert pod.config_hash == "f" * 32


@pytest.mark.parametrize(
    ("config_hash", "mirror_value"),
    [
        ("f" * 32, None),  # a tenant's copy of the hash, no mirror annotation
        ("f" * 32, "e" * 32),  # mirror names another hash
        ("F" * 32, "F" * 32),  # not the kubelet's form (lower-case hex, as cgroups carry it)
        ("f" * 31, "f" * 31),
        (UID, UID),  # a UUID is a UID, not a hash
    ],
)
def test_only_a_kubelet_mirror_pod_can_claim_a_static_pods_cgroups(
    config_hash: str, mirror_value: str | None
) -> None:
    pod = mirror("evil", "default", UID, config_hash, mirror_value=mirror_value)
    assert pod.config_hash is None


STATIC_HASH = "0123456789abcdef0123456789abcdef"


def test_a_tenant_copying_a_static_pods_hash_never_takes_its_processes() -> None:
    """The old defect: ``default/evil`` (listed before ``kube-system``) copied the hash of a
    kube-system static pod and its processes were SIGTERMed as evil's."""
    real = mirror(
        "etcd-n1", "kube-system", "1" * 8 + UID[8:], STATIC_HASH, mirror_value=STATIC_HASH
    )
    copy_only = mirror("evil", "default", "2" * 8 + UID[8:], STATIC_HASH)
    copy_both = mirror("evil2", "aaa", "3" * 8 + UID[8:], STATIC_HASH, mirror_value=STATIC_HASH)

    # The hash alone: the real mirror pod keeps its processes, whatever the order.
    for order in ([copy_only, real], [real, copy_only]):
        assert index_pods(order)[PodUid(STATIC_HASH)] is real
    # Both annotations copied (allowed at create time): two claims, so the hash is nobody's;
    # the processes stay unattributed (reported, never charged or signalled).
    for order in ([copy_both, real], [real, copy_both]):
        view = index_pods(order)
        assert PodUid(STATIC_HASH) not in view
        assert ambiguous_config_hashes(order) == (STATIC_HASH,)
        assert view[real.uid] is real
        assert view[copy_both.uid] is copy_both


def test_a_hash_never_shadows_a_real_pod_uid() -> None:
    victim = mirror("victim", "ml", STATIC_HASH, "e" * 32)  # a UID that looks like a hash
    claimant = mirror("evil", "default", UID, STATIC_HASH, mirror_value=STATIC_HASH)
    assert index_pods([claimant, victim])[PodUid(STATIC_HASH)] is victim


@pytest.mark.parametrize(
    "obj",
    [
        "a string",
        5,
        None,
        [],
        {"metadata": "x"},
        {"metadata": {"uid": UID, "name": "n", "namespace": "ns", "annotations": "x"}},
        {"metadata": {"uid": UID, "name": "n", "namespace": "ns", "annotations": [1, 2]}},
        {"metadata": {"uid": UID, "name": "n", "namespace": "ns", "annotations": {1: 2}}},
        {"metadata": {"uid": UID, "name": "n", "namespace": "ns"}, "status": "x"},
        {"metadata": {"uid": UID, "name": "n", "namespace": "ns"},
         "status": {"containerStatuses": 7}},
        {"metadata": {"uid": UID, "name": "n", "namespace": "ns"},
         "status": {"containerStatuses": ["x", None, {"containerID": 5, "name": []}]}},
        {"metadata": {"uid": 5, "name": "n", "namespace": "ns"}},
    ],
)  # fmt: skip
def test_a_pod_object_of_any_shape_translates_or_is_skipped_never_raises(obj: object) -> None:
    pod = pod_from_json(obj)
    assert pod is None or (pod.annotations == {} and pod.containers == {})


@pytest.mark.parametrize("value", [8, 1.5, True, None, ["8Gi"], {"a": 1}])
def test_an_unquoted_limit_is_invalid_not_a_number_of_bytes(value: object) -> None:
    """The old defect: ``limit: 8`` was an 8-byte limit through the pods file."""
    pod = pod_from_json(
        pod_json(metadata={"uid": UID, "name": "n", "namespace": "ns",
                           "annotations": {"gpuguard.io/gpu-memory-limit": value}})
    )  # fmt: skip
    assert pod is not None
    assert pod.annotation_limit is None
    assert pod.annotation_error is not None
    assert "not a string" in pod.annotation_error


def test_an_object_without_uid_is_not_a_pod() -> None:
    assert pod_from_json({"metadata": {"name": "x", "namespace": "y"}}) is None


@pytest.mark.parametrize(
    ("value", "replicas"),
    [("4", 4), ("1", 1), ("0", None), ("-1", None), ("x", None), ("４", None), ("", None)],
)
def test_the_replicas_label_is_a_positive_integer_or_unknown(
    value: str, replicas: int | None
) -> None:
    facts = node_facts_from_json(
        {"metadata": {"labels": {"nvidia.com/gpu.replicas": value}}}, name="n1"
    )
    assert facts.seen
    assert facts.replicas == replicas


def test_the_mig_config_state_label_is_read_as_text() -> None:
    facts = node_facts_from_json(
        {"metadata": {"labels": {"nvidia.com/mig.config.state": "pending"}}}, name="n1"
    )
    assert (facts.name, facts.mig_config_state) == ("n1", "pending")


@pytest.mark.parametrize("obj", [None, "x", {"metadata": "x"}, {"metadata": {"labels": [1]}}])
def test_a_node_list_without_this_node_or_of_any_shape_gives_no_labels(obj: object) -> None:
    facts = node_facts_from_json(obj, name="n1")
    assert facts.seen, "the list answered: the node's facts are known (it has none)"
    assert (facts.replicas, facts.mig_config_state) == (None, None)


def test_backoff_grows_from_under_a_second_to_at_most_thirty_with_jitter() -> None:
    rng = random.Random(7)
    first = [backoff_seconds(1, rng=rng) for _ in range(200)]
    assert all(0.4 <= s <= 0.8 for s in first)
    assert len(set(first)) > 100, "jittered, not lockstep"
    late = [backoff_seconds(n, rng=rng) for n in range(8, 60)]
    assert all(BACKOFF_MAX_SECONDS / 2 <= s <= BACKOFF_MAX_SECONDS for s in late)


def _api_exception(status: int, message: str, headers: dict[str, str] | None = None) -> Exception:
    exc = k8s.ApiException(status=status, reason="x")
    exc.body = json.dumps({"kind": "Status", "message": message, "code": status})
    exc.headers = headers or {}
    return exc


def test_a_403_names_the_verb_the_resource_and_the_fix() -> None:
    err = translate_error(
        _api_exception(403, 'pods is forbidden: User "x" cannot watch'),
        verb="watch",
        resource="pods",
        scope="cluster scope",
    )
    assert isinstance(err, KubeForbidden)
    assert str(err).startswith(
        "RBAC: the credentials in use cannot 'watch' 'pods' at cluster scope; installed with the "
        "chart: re-run its `helm upgrade --install`"
    )
    assert "apply manifests/rbac.yaml" in str(err)


def test_transport_errors_and_5xx_are_transient() -> None:
    for exc in (
        urllib3.exceptions.NewConnectionError(None, "refused"),  # type: ignore[arg-type]
        urllib3.exceptions.ReadTimeoutError(None, "/", "timed out"),  # type: ignore[arg-type]
        _api_exception(500, "etcd timeout"),
        _api_exception(401, "token expired"),
    ):
        err = translate_error(exc, verb="list", resource="pods", scope="s")
        assert isinstance(err, KubeError)
        assert decision(err) is Decision.RETRY


def test_a_429_with_retry_after_is_waited_out() -> None:
    err = translate_error(
        _api_exception(429, "slow down", {"Retry-After": "7"}),
        verb="list",
        resource="pods",
        scope="s",
    )
    assert isinstance(err, KubeError)
    assert getattr(err, "retry_after_seconds", None) == 7.0
    assert 7.0 <= wait_seconds(err, attempt=1) <= BACKOFF_MAX_SECONDS


def test_the_retry_policy_stops_when_asked_and_raises_the_last_error() -> None:
    stop = threading.Event()
    calls = 0

    def failing() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            stop.set()
        raise KubeError(f"down {calls}")

    with pytest.raises(KubeError, match="down 2"):
        retrying(stop, what="test", persist=False)(failing)
    assert calls == 2


def test_one_request_gives_up_on_a_reported_error_and_a_stream_persists() -> None:
    stop = threading.Event()
    calls = 0
    seen: list[BaseException] = []

    def forbidden() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            stop.set()
        raise KubeForbidden("RBAC")

    with pytest.raises(KubeForbidden):
        retrying(stop, what="test", persist=False)(forbidden)
    assert calls == 1
    with pytest.raises(KubeForbidden):
        retrying(stop, what="test", persist=True, on_retry=seen.append)(forbidden)
    assert calls == 3
    assert len(seen) == 1, "the stream was told before its wait"


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (0, Decision.RETRY),  # no answer at all
        (401, Decision.RETRY),  # a token being rotated
        (408, Decision.RETRY),
        (429, Decision.RETRY),
        (500, Decision.RETRY),
        (503, Decision.RETRY),
        (403, Decision.REPORT),
        (400, Decision.REPORT),
        (404, Decision.REPORT),
        (405, Decision.REPORT),
        (422, Decision.REPORT),
        (409, Decision.DONE),
        (410, Decision.RELIST),
    ],
)
def test_every_status_is_decided_by_the_one_table(status: int, expected: Decision) -> None:
    err = translate_error(_api_exception(status, "m"), verb="list", resource="pods", scope="s")
    assert decision(err) is expected


@pytest.mark.parametrize("status", [404, 422])
@pytest.mark.parametrize(
    ("verb", "resource"), [("list", "pods"), ("watch", "nodes"), ("create", "events")]
)
def test_a_404_or_422_is_a_problem_reported_whatever_the_request(
    status: int, verb: str, resource: str
) -> None:
    """The old defect: a 404/422 was retried forever as transient on a list and given
    up on an Event. It will not fix itself: a reported problem for every request."""
    err = translate_error(
        _api_exception(status, 'namespaces "x" not found'),
        verb=verb,
        resource=resource,
        scope="s",
    )
    assert isinstance(err, KubeRejected)
    assert isinstance(err, PermanentError)
    assert decision(err) is Decision.REPORT
    assert str(err) == f'{verb} {resource} (s): HTTP {status}: namespaces "x" not found'


def test_a_silent_connection_an_expired_version_and_other_errors_are_told_apart() -> None:
    def reason(exc: Exception) -> str:
        return restart_reason(translate_error(exc, verb="watch", resource="pods", scope="s"))

    assert reason(urllib3.exceptions.ReadTimeoutError(None, "/", "timed out")) == "inactivity"  # type: ignore[arg-type]
    assert reason(_api_exception(410, "too old")) == "expired"
    assert reason(_api_exception(500, "etcd")) == "error"
    assert reason(urllib3.exceptions.ProtocolError("reset")) == "error"


def test_a_410_relists_at_once_the_first_time_and_backs_off_when_it_repeats() -> None:
    gone = ResourceExpired("too old")
    assert wait_seconds(gone, attempt=1) == 0.0
    assert 0.4 <= wait_seconds(gone, attempt=2) <= 0.8
    assert wait_seconds(gone, attempt=50) <= BACKOFF_MAX_SECONDS


def test_a_reported_error_is_retried_on_a_ladder_up_to_a_minute() -> None:
    forbidden = KubeForbidden("RBAC")
    assert 0.4 <= wait_seconds(forbidden, attempt=1) <= 0.8, "a cold RBAC cache: seconds"
    late = [wait_seconds(forbidden, attempt=20) for _ in range(50)]
    assert all(REPORTED_RETRY_SECONDS / 2 <= s <= REPORTED_RETRY_SECONDS for s in late)
    assert max(late) > BACKOFF_MAX_SECONDS
