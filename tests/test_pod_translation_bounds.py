"""What a pod's translation keeps is bounded by what gpuguard reads, whatever a tenant wrote,
and a list is translated page by page without holding a page it already read.

A tenant writes up to 256 KiB of annotations a pod (the API server's limit; a pods file or a
manifest is not even held to that): ``Pod.annotations`` keeps the limit annotation, a static
pod's two and a few other ``gpuguard.io/`` keys (reported as unknown), each value bounded; an
over-long limit is still reported invalid with its real length, and two different over-long
values stay apart. The real API server's side is ``tests/kube/test_fat_pods.py``.
"""

from __future__ import annotations

import gc
import json
import threading
from typing import Any

from gpuguard.adapters.kube.reflector import Reflector
from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import LIMIT_ANNOTATION, LimitPolicy, LimitSource, Pod
from gpuguard.kubemodel.translate import (
    MAX_KEPT_VALUE_CHARS,
    MAX_KEY_CHARS,
    MAX_UNKNOWN_KEYS,
    pod_finished,
    pod_from_json,
)

FAT = 250 * 1024


def pod(annotations: dict[str, Any], **extra: Any) -> Pod:
    manifest = {
        "metadata": {"uid": "u1", "name": "p", "namespace": "ns", "annotations": annotations},
        **extra,
    }
    translated = pod_from_json(manifest)
    assert translated is not None
    return translated


def kept_chars(p: Pod) -> int:
    return sum(len(k) + len(v) for k, v in p.annotations.items())


def test_a_fat_limit_value_is_invalid_with_its_length_and_not_kept_whole() -> None:
    fat = pod({LIMIT_ANNOTATION: "8" * FAT})
    assert fat.annotation_limit is None
    assert fat.annotation_error is not None
    assert "is longer than 64 characters" in fat.annotation_error
    assert f"({FAT} characters)" in fat.annotation_error
    assert len(fat.annotation_error) < 400
    kept = fat.annotations[LIMIT_ANNOTATION]
    assert len(kept) < 2 * MAX_KEPT_VALUE_CHARS, "kept whole"
    assert len(kept) > MAX_KEPT_VALUE_CHARS, "a kept value is never mistaken for a valid one"
    # Two different fat values stay apart (one InvalidGPUMemoryLimit Event per value).
    other = pod({LIMIT_ANNOTATION: "8" * (FAT - 1) + "9"})
    assert other.annotations[LIMIT_ANNOTATION] != kept


def test_a_limit_value_as_long_as_a_valid_one_is_kept_as_it_is() -> None:
    value = "1" + "0" * (MAX_KEPT_VALUE_CHARS - 1)
    assert pod({LIMIT_ANNOTATION: value}).annotations[LIMIT_ANNOTATION] == value
    assert pod({LIMIT_ANNOTATION: "8Gi"}).annotations == {LIMIT_ANNOTATION: "8Gi"}


def test_annotations_gpuguard_does_not_read_are_not_kept() -> None:
    p = pod({"tenant.example/blob": "x" * FAT, "app": "train", LIMIT_ANNOTATION: "8Gi"})
    assert dict(p.annotations) == {LIMIT_ANNOTATION: "8Gi"}


def test_other_schedulers_annotations_are_read_but_not_kept() -> None:
    p = pod({"gpu-memory": "4096", "padding": "x" * FAT})
    assert p.declared[LimitSource.KAI].amount == 4096
    assert dict(p.annotations) == {}


def test_thousands_of_unknown_gpuguard_keys_keep_a_few_each_still_reported() -> None:
    many = {f"gpuguard.io/exempt-{i:05d}": "y" * 200 for i in range(5000)}
    p = pod(many)
    unknown = sorted(p.annotations)
    assert unknown == sorted(many)[:MAX_UNKNOWN_KEYS]
    assert kept_chars(p) < MAX_UNKNOWN_KEYS * (MAX_KEY_CHARS + 2 * MAX_KEPT_VALUE_CHARS)
    limit = resolve_limit(pod=p, device_total_bytes=None, policy=LimitPolicy(), replicas=None)
    assert sum("unknown annotation gpuguard.io/exempt-" in w for w in limit.warnings) == (
        MAX_UNKNOWN_KEYS
    )


def test_a_key_longer_than_the_api_server_allows_is_not_kept() -> None:
    p = pod({"gpuguard.io/" + "k" * MAX_KEY_CHARS: "1"})
    assert dict(p.annotations) == {}


def test_a_static_pods_hash_is_still_read() -> None:
    h = "0123456789abcdef0123456789abcdef"
    p = pod({"kubernetes.io/config.hash": h, "kubernetes.io/config.mirror": h, "x": "y" * FAT})
    assert p.config_hash == h
    assert kept_chars(p) < 200


def test_finished_phases() -> None:
    assert pod_finished({"status": {"phase": "Succeeded"}})
    assert pod_finished({"status": {"phase": "Failed"}})
    for phase in ("Pending", "Running", "Unknown", None, 3):
        assert not pod_finished({"status": {"phase": phase}})
    assert not pod_finished({"status": "Failed"})
    assert not pod_finished([])


class FakeListResponse:
    """A list answer as the client hands it with ``_preload_content=False``."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def read(self) -> bytes:
        body, self._body = self._body, b""
        return body

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_list_is_translated_page_by_page_and_no_read_page_is_held() -> None:
    """When the reflector asks for page N+1, no raw object of page N is alive anywhere in the
    process: only its translation is."""
    pages = [[f"page{n}-pod{i}" for i in range(3)] for n in range(4)]
    held: list[str] = []
    replaced: list[list[str]] = []
    stop = threading.Event()

    def alive(uids: set[str]) -> list[str]:
        gc.collect()
        return [
            o["metadata"]["uid"]
            for o in gc.get_objects()
            if isinstance(o, dict)
            and isinstance(o.get("metadata"), dict)
            and o["metadata"].get("uid") in uids
        ]

    def call(**kwargs: Any) -> FakeListResponse:
        if kwargs.get("watch"):
            return FakeListResponse(b"")
        token = kwargs.get("_continue")
        n = int(token) if token else 0
        if n:
            held.extend(alive(set(pages[n - 1])))
        body = {
            "metadata": {
                "continue": str(n + 1) if n + 1 < len(pages) else "",
                "resourceVersion": "7",
            },
            "items": [{"metadata": {"uid": uid}, "padding": "x" * 1000} for uid in pages[n]],
        }
        return FakeListResponse(json.dumps(body).encode())

    def on_replace(items: list[str]) -> None:
        replaced.append(items)
        stop.set()

    reflector: Reflector[str] = Reflector(
        name="pods",
        call=call,
        field_selector="spec.nodeName=n1",
        resource="pods",
        scope="cluster scope",
        translate=lambda obj: str(obj["metadata"]["uid"]),
        on_replace=on_replace,
        on_event=lambda kind, uid: None,
        on_contact=lambda: None,
        on_problem=lambda problem: None,
        stop_event=stop,
        health=None,
        watch_timeout_seconds=1,
        connect_timeout_seconds=1,
        inactivity_seconds=1,
        page_size=3,
    )
    reflector.run()
    assert replaced == [[uid for page in pages for uid in page]]
    assert held == [], "raw objects of a page already translated were still held"


def test_container_statuses_are_bounded_and_a_clashing_id_names_no_container() -> None:
    """``Pod.containers`` names the container a per-container declaration holds: a status list
    of any size, names and IDs of any length, and one ID given two names are read bounded, and
    an ambiguous ID is nobody's (its processes are held with the pod's, never to a guessed
    container's own limit)."""
    from gpuguard.kubemodel.translate import MAX_CONTAINER_STATUSES, pod_from_json

    statuses = [{"name": f"c{i}", "containerID": f"containerd://{i:064x}"} for i in range(100_000)]
    statuses[0:0] = [
        {"name": "main", "containerID": "containerd://" + "a" * 64},
        {"name": "side", "containerID": "containerd://" + "a" * 64},
        {"name": "x" * 64, "containerID": "containerd://" + "b" * 64},
        {"name": "long-id", "containerID": "containerd://" + "c" * 129},
    ]
    made = pod_from_json(
        {
            "metadata": {"uid": "u", "name": "p", "namespace": "ns"},
            "status": {"containerStatuses": statuses},
        }
    )
    assert made is not None
    assert len(made.containers) <= MAX_CONTAINER_STATUSES
    assert "a" * 64 not in made.containers
    assert "b" * 64 not in made.containers
    assert not any(len(c) > 128 for c in made.containers)
    assert f"{0:064x}" in made.containers
