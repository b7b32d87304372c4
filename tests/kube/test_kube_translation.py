"""The kube adapter's pure parts: JSON → model, client errors → gpuguard errors, backoff.

No API server needed; the behaviour against a real one is in the other modules here.
"""

from __future__ import annotations

import json
import random
import threading

import pytest
import urllib3
from kubernetes import client as k8s

from gpuguard.adapters.kube import (
    BACKOFF_MAX_SECONDS,
    backoff_seconds,
    node_labels_from_json,
    pod_from_json,
    retry_policy,
    translate,
)
from gpuguard.core.model import LimitValue
from gpuguard.errors import KubeError, KubeForbidden

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


def test_a_static_pod_carries_its_config_hash() -> None:
    pod = pod_from_json(
        pod_json(
            metadata={
                "uid": UID,
                "name": "s",
                "namespace": "kube-system",
                "annotations": {"kubernetes.io/config.hash": "f" * 32},
            }
        )
    )
    assert pod is not None
    assert pod.config_hash == "f" * 32


def test_an_object_without_uid_is_not_a_pod() -> None:
    assert pod_from_json({"metadata": {"name": "x", "namespace": "y"}}) is None


@pytest.mark.parametrize(
    ("value", "replicas"),
    [("4", 4), ("1", 1), ("0", None), ("-1", None), ("x", None), ("４", None), ("", None)],
)
def test_the_replicas_label_is_a_positive_integer_or_unknown(
    value: str, replicas: int | None
) -> None:
    labels = node_labels_from_json({"metadata": {"labels": {"nvidia.com/gpu.replicas": value}}})
    assert labels.found
    assert labels.replicas == replicas


def test_a_missing_node_is_reported_as_not_found() -> None:
    assert not node_labels_from_json(None).found


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
    err = translate(
        _api_exception(403, 'pods is forbidden: User "x" cannot watch'),
        verb="watch",
        resource="pods",
        scope="cluster scope",
    )
    assert isinstance(err, KubeForbidden)
    assert str(err).startswith(
        "RBAC: the ServiceAccount cannot 'watch' 'pods' at cluster scope; apply manifests/rbac.yaml"
    )


def test_transport_errors_and_5xx_are_transient() -> None:
    for exc in (
        urllib3.exceptions.NewConnectionError(None, "refused"),  # type: ignore[arg-type]
        urllib3.exceptions.ReadTimeoutError(None, "/", "timed out"),  # type: ignore[arg-type]
        _api_exception(500, "etcd timeout"),
        _api_exception(401, "token expired"),
    ):
        assert isinstance(translate(exc, verb="list", resource="pods", scope="s"), KubeError)


def test_a_429_with_retry_after_is_waited_out() -> None:
    err = translate(
        _api_exception(429, "slow down", {"Retry-After": "7"}),
        verb="list",
        resource="pods",
        scope="s",
    )
    assert isinstance(err, KubeError)
    assert getattr(err, "retry_after_seconds", None) == 7.0


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
        retry_policy(stop, what="test")(failing)
    assert calls == 2


def test_the_retry_policy_does_not_retry_forbidden_unless_told() -> None:
    stop = threading.Event()
    calls = 0

    def forbidden() -> None:
        nonlocal calls
        calls += 1
        raise KubeForbidden("RBAC")

    with pytest.raises(KubeForbidden):
        retry_policy(stop, what="test")(forbidden)
    assert calls == 1
