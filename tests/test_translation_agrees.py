"""A Pod manifest means the same ``Pod`` to the pods file, ``check-pod`` and the simulator.

Why: the manifest → ``Pod`` translation was written three times (``pod_from_json``,
check-pod's parser, ``sim``) and they disagreed (an unquoted ``limit: 8`` was 8 bytes through
``--pods-file`` and an error in ``check-pod``). All three now go through
``kubemodel.translate``; this property holds them to it for generated manifests: any names,
any annotations, the limit valid, invalid or not a string at all, containers in any status list,
static-pod hashes real or copied.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.adapters.manifest import (
    MANIFEST_MAX_BYTES,
    PodManifest,
    load_yaml_documents,
    pod_manifests,
    read_bounded,
)
from gpuguard.adapters.podfile import FilePodDirectory
from gpuguard.commands.check_pod import manifest_pod
from gpuguard.core.model import (
    CONFIG_HASH_ANNOTATION,
    CONFIG_MIRROR_ANNOTATION,
    LIMIT_ANNOTATION,
    Pod,
    PodUid,
)
from gpuguard.sim.node import sim_pod
from tests.fakes import FakeClock

STATIC_HASH = "0123456789abcdef0123456789abcdef"
STATUS_LISTS = ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")
ABSENT = object()
"""No limit annotation at all."""

texts = st.text(max_size=16)
names = st.text(min_size=1, max_size=16)  # the API server never lists an empty name or namespace

valid_limits = st.sampled_from(["8Gi", "1.5Gi", "25%", "100%", "1Mi", "80G", "1e9"]) | st.integers(
    1, 2**30
).map(lambda n: f"{n}Mi")
invalid_limits = (
    st.sampled_from(["8GB", "8 Gi", "", "-1Gi", "16", "0", "150%", "NaN", "１６Gi"]) | texts
)
not_strings = (
    st.sampled_from([8, 1.5, 8 * 2**30, 25, True, None, ["8Gi"], {"limit": "8Gi"}])  # YAML unquoted
    | st.integers(-(10**18), 10**18)
    | st.integers(2**20, 2**40)  # a plausible number of bytes: still not a limit
    | st.floats()
    | st.lists(st.integers(0, 9), max_size=3)
    | st.dictionaries(texts, st.integers(0, 9), max_size=2)
)
limits = st.just(ABSENT) | valid_limits | invalid_limits | not_strings
static_hashes = st.sampled_from(
    [
        {},
        {
            CONFIG_HASH_ANNOTATION: STATIC_HASH,
            CONFIG_MIRROR_ANNOTATION: STATIC_HASH,
        },  # a mirror pod
        {CONFIG_HASH_ANNOTATION: STATIC_HASH},  # a tenant's copy of the hash alone
        {CONFIG_HASH_ANNOTATION: "F" * 32, CONFIG_MIRROR_ANNOTATION: "F" * 32},  # not the form
    ]
)
container_ids = st.text(alphabet="0123456789abcdef", min_size=1, max_size=64)


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    """What the three paths are given: identity, annotations (any values), containers."""
    annotations: dict[str, object] = draw(st.dictionaries(texts, texts, max_size=3))
    annotations.update(draw(static_hashes))
    limit = draw(limits)
    if limit is not ABSENT:
        annotations[LIMIT_ANNOTATION] = limit
    containers = draw(st.dictionaries(container_ids, names, max_size=4))
    return {
        "uid": draw(names),
        "namespace": draw(names),
        "name": draw(names),
        "annotations": annotations,
        "containers": containers,
        "runtimes": [draw(st.sampled_from(["containerd", "cri-o", "docker"])) for _ in containers],
        "lists": [draw(st.sampled_from(STATUS_LISTS)) for _ in containers],
    }


def manifest(spec: dict[str, Any]) -> dict[str, Any]:
    """The Pod as ``kubectl get pod -o yaml`` shows it, containers spread over status lists."""
    status: dict[str, list[dict[str, str]]] = {}
    for (cid, cname), runtime, key in zip(
        spec["containers"].items(), spec["runtimes"], spec["lists"], strict=True
    ):
        status.setdefault(key, []).append({"name": cname, "containerID": f"{runtime}://{cid}"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "uid": spec["uid"],
            "namespace": spec["namespace"],
            "name": spec["name"],
            "annotations": spec["annotations"],
        },
        "spec": {"containers": [{"name": "main", "image": "x"}]},
        "status": status,
    }


def through_pods_file(path: Path, uid: str) -> Pod:
    directory = FilePodDirectory(path, node_name="node-1", clock=FakeClock())
    directory.start()
    try:
        return directory.snapshot().pods[PodUid(uid)]
    finally:
        directory.stop()


def through_check_pod(path: Path) -> Pod:
    text = read_bounded(path, max_bytes=MANIFEST_MAX_BYTES, what="manifest")
    (document,) = load_yaml_documents(text, where=str(path))
    (found,) = pod_manifests(document, where=f"{path}: document 1")
    assert isinstance(found, PodManifest)
    assert not found.problems
    return manifest_pod(found)


def through_sim(spec: dict[str, Any]) -> Pod:
    return sim_pod(
        spec["uid"],
        spec["namespace"],
        spec["name"],
        containers=spec["containers"],
        annotations=spec["annotations"],
    )


def meaning(pod: Pod) -> tuple[object, ...]:
    return (
        pod.uid,
        pod.namespace,
        pod.name,
        dict(pod.annotations),
        pod.annotation_limit,
        pod.annotation_error,
        dict(pod.containers),
        pod.config_hash,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=pods())
def test_the_pods_file_check_pod_and_the_simulator_read_a_manifest_alike(
    spec: dict[str, Any],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pods.yaml"
        path.write_text(
            yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [manifest(spec)]}),
            encoding="utf-8",
        )
        from_file = through_pods_file(path, spec["uid"])
        from_check_pod = through_check_pod(path)
    from_sim = through_sim(spec)
    assert meaning(from_file) == meaning(from_check_pod) == meaning(from_sim)
    limit = spec["annotations"].get(LIMIT_ANNOTATION, ABSENT)
    if limit is not ABSENT and not isinstance(limit, str):
        assert from_file.annotation_limit is None, "an unquoted value is never a limit"
        assert from_file.annotation_error is not None
