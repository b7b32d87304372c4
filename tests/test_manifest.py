"""adapters.manifest: bounded reads of user-supplied files, bounded YAML, the pod-template walker.

Real files, FIFOs, sockets and devices: the refusals are the kernel's file types, not mocks.
"""

from __future__ import annotations

import io
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.manifest import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    InputError,
    OtherObject,
    PodManifest,
    ShapeProblem,
    load_yaml_documents,
    pod_manifests,
    read_bounded,
)
from gpuguard.errors import GpuguardError

# ---------------------------------------------------------------------------------------------
# read_bounded


def test_reads_a_regular_file_up_to_exactly_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text("kind: Pod\n", encoding="utf-8")
    assert read_bounded(path, max_bytes=10, what="manifest") == "kind: Pod\n"
    assert read_bounded(str(path), max_bytes=10, what="manifest") == "kind: Pod\n"


def test_a_file_one_byte_over_the_bound_is_refused_naming_file_size_and_bound(
    tmp_path: Path,
) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (1024 + 1))
    with pytest.raises(InputError) as caught:
        read_bounded(path, max_bytes=1024, what="manifest")
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert "1025 bytes" in message
    assert "1Ki" in message
    assert not caught.value.unopenable
    assert isinstance(caught.value, GpuguardError)


def test_a_file_whose_size_lies_is_bounded_while_reading() -> None:
    # /proc files are regular files of st_size 0: only the bound on the read itself holds.
    with pytest.raises(InputError, match=r"/proc/self/status: manifest is larger than 16 bytes"):
        read_bounded("/proc/self/status", max_bytes=16, what="manifest")


def test_dash_reads_the_given_stdin_bounded() -> None:
    assert read_bounded("-", max_bytes=9, what="manifest", stdin=io.BytesIO(b"kind: Pod")) == (
        "kind: Pod"
    )
    with pytest.raises(InputError, match=r"^<stdin>: manifest is larger than 8 bytes"):
        read_bounded("-", max_bytes=8, what="manifest", stdin=io.BytesIO(b"kind: Pod"))


def test_a_fifo_is_refused_at_once_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(InputError, match=r"pipe.yaml: is a FIFO \(named pipe\), not a regular"):
        read_bounded(fifo, max_bytes=1024, what="manifest")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/zero", "a character device"), ("/", "a directory")]
)
def test_devices_and_directories_are_refused_naming_what_they_are(path: str, kind: str) -> None:
    with pytest.raises(InputError) as caught:
        read_bounded(path, max_bytes=1024, what="pods file")
    assert str(caught.value) == (
        f"{path}: is {kind}, not a regular file: refusing to read it as a pods file"
    )


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        with pytest.raises(InputError, match="is a socket, not a regular file"):
            read_bounded(path, max_bytes=1024, what="manifest")


def test_a_missing_file_is_unopenable(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        read_bounded(tmp_path / "nope.yaml", max_bytes=1024, what="manifest")
    assert caught.value.unopenable
    assert (
        str(caught.value)
        == f"{tmp_path / 'nope.yaml'}: cannot read manifest: No such file or directory"
    )


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
            "is binary, not text (a NUL byte at byte offset 8)",
        ),
        (
            b"kind: Pod\n\xff\xfe",
            "is not UTF-8 text (byte 0xff at byte offset 10: invalid start byte)",
        ),
        (
            b"name: caf\xc3",
            "is not UTF-8 text (byte 0xc3 at byte offset 9: unexpected end of data)",
        ),
    ],
)
def test_binary_and_non_utf8_bytes_are_refused_with_the_byte_offset(
    tmp_path: Path, data: bytes, says: str
) -> None:
    path = tmp_path / "blob"
    path.write_bytes(data)
    with pytest.raises(InputError) as caught:
        read_bounded(path, max_bytes=1024, what="manifest")
    assert str(caught.value) == f"{path}: manifest {says}"


# ---------------------------------------------------------------------------------------------
# load_yaml_documents


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def billion_laughs(levels: int, width: int = 9) -> str:
    lines = ["kind: Pod", "x0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"x{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    lines += ["metadata:", "  name: lol", f"  namespace: *a{levels - 1}"]
    return "\n".join(lines) + "\n"


def test_loads_every_document_of_a_stream() -> None:
    documents = load_yaml_documents("a: 1\n---\n- x\n---\n", where="f.yaml")
    assert documents == [{"a": 1}, ["x"], None]


def test_nesting_up_to_the_limit_loads_and_one_deeper_is_refused_with_its_position() -> None:
    (document,) = load_yaml_documents(nested(MAX_DEPTH), where="f.yaml")
    assert isinstance(document, list)
    with pytest.raises(InputError) as caught:
        load_yaml_documents("a: 1\n---\n" + nested(MAX_DEPTH + 1), where="f.yaml")
    assert str(caught.value) == (
        f"f.yaml: document 2 nests deeper than {MAX_DEPTH} levels (line 3, column "
        f"{MAX_DEPTH + 1}): refusing it"
    )


@pytest.mark.parametrize("depth", [5_000, 1_000_000])
def test_a_bracket_bomb_is_refused_fast_without_recursion(depth: int) -> None:
    started = time.monotonic()
    # libyaml refuses flow nesting past 1000 while scanning ahead; the pure-Python scanner does
    # not, and the event scan stops it at MAX_DEPTH.
    with pytest.raises(InputError, match=r"^bomb.yaml: .*(nests deeper than|maximum nesting)"):
        load_yaml_documents(nested(depth), where="bomb.yaml")
    assert time.monotonic() - started < 5  # a generous bound: it stops at level 65


@pytest.mark.parametrize("levels", [7, 9])
def test_a_billion_laughs_is_refused_before_anything_is_expanded(levels: int) -> None:
    text = billion_laughs(levels)
    assert len(text) < 1100
    started = time.monotonic()
    with pytest.raises(InputError) as caught:
        load_yaml_documents(text, where="lol.yaml")
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert message.startswith(
        f"lol.yaml: document 1: aliases expand to more than {MAX_ALIAS_NODES} nodes (line "
    )
    assert len(message) < 200


def test_ordinary_anchors_and_merge_keys_still_load() -> None:
    text = (
        "env: &env [{name: A, value: '1'}, {name: B, value: '2'}]\n"
        "base: &base {image: x, env: *env}\n"
        "containers:\n"
        "  - {<<: *base, name: one}\n"
        "  - {<<: *base, name: two}\n"
        "  - {name: three, env: *env}\n"
    )
    (document,) = load_yaml_documents(text, where="f.yaml")
    assert [c["name"] for c in document["containers"]] == ["one", "two", "three"]
    assert document["containers"][1]["env"][1] == {"name": "B", "value": "2"}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a: [1, 2\n", "f.yaml: not valid YAML at line 2, column 1: "),
        ("a: b\n\tc: d\n", "f.yaml: not valid YAML at line 2, column 1: found "),
        ("{[1, 2]: x}\n", "f.yaml: not valid YAML at line 1, column 2: found unhashable key"),
        (
            "when: 2001-02-31\n",
            "f.yaml: not valid YAML at line 1, column 7: invalid timestamp '2001-02-31': day is",
        ),
        ("n: " + "9" * 5000 + "\n", "f.yaml: not valid YAML at line 1, column 4: a number of 5000"),
        ("n: 1" + ":0" * 200_000 + "\n", "f.yaml: not valid YAML at line 1, column 4: a number of"),
    ],
)
def test_invalid_yaml_is_one_short_error_with_its_position(text: str, says: str) -> None:
    started = time.monotonic()
    with pytest.raises(InputError) as caught:
        load_yaml_documents(text, where="f.yaml")
    assert time.monotonic() - started < 5
    assert str(caught.value).startswith(says)
    assert len(str(caught.value)) < 300
    assert "\n" not in str(caught.value)


def test_a_huge_tag_is_shortened_in_the_message() -> None:
    with pytest.raises(InputError) as caught:
        load_yaml_documents("a: !" + "x" * 100_000 + " b\n", where="f.yaml")
    assert len(str(caught.value)) < 300


# ---------------------------------------------------------------------------------------------
# pod_manifests


def found(document: Any, **kwargs: Any) -> list[PodManifest | OtherObject | ShapeProblem]:
    return list(pod_manifests(document, where="f.yaml: document 1", **kwargs))


TEMPLATE = {"metadata": {"annotations": {"gpuguard.io/gpu-memory-limit": "8Gi"}}, "spec": {}}
META = {"name": "web", "namespace": "ml"}


@pytest.mark.parametrize(
    ("kind", "document", "path"),
    [
        ("Deployment", {"spec": {"template": TEMPLATE}}, "spec.template"),
        ("StatefulSet", {"spec": {"template": TEMPLATE}}, "spec.template"),
        ("DaemonSet", {"spec": {"template": TEMPLATE}}, "spec.template"),
        ("ReplicaSet", {"spec": {"template": TEMPLATE}}, "spec.template"),
        ("ReplicationController", {"spec": {"template": TEMPLATE}}, "spec.template"),
        ("Job", {"spec": {"template": TEMPLATE}}, "spec.template"),
        (
            "CronJob",
            {"spec": {"jobTemplate": {"spec": {"template": TEMPLATE}}}},
            "spec.jobTemplate.spec.template",
        ),
        ("PodTemplate", {"template": TEMPLATE}, "template"),
    ],
)
def test_every_workload_kind_yields_its_pod_template(
    kind: str, document: dict[str, Any], path: str
) -> None:
    (item,) = found({"kind": kind, "metadata": META, **document})
    assert isinstance(item, PodManifest)
    assert item.pod == TEMPLATE
    assert (item.kind, item.template_path, item.problems) == (kind, path, ())
    assert item.description == f"{kind} ml/web (pod template)"
    assert item.where == "f.yaml: document 1"


def test_pods_and_list_items_are_yielded_and_other_objects_named() -> None:
    document = {
        "kind": "List",
        "items": [
            {"kind": "Pod", "metadata": {"name": "a"}},
            {"kind": "Service", "metadata": {"name": "s"}},
            {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": TEMPLATE}},
        ],
    }
    pod, service, deployment = found(document)
    assert isinstance(pod, PodManifest)
    assert (pod.description, pod.template_path, pod.where) == (
        "Pod default/a",
        None,
        "f.yaml: document 1 item 0",
    )
    assert service == OtherObject(where="f.yaml: document 1 item 1", kind="Service")
    assert isinstance(deployment, PodManifest)
    assert deployment.description == "Deployment default/d (pod template)"


def test_without_templates_workloads_are_other_objects_and_kindless_may_be_pods() -> None:
    assert found({"kind": "Job", "spec": {"template": TEMPLATE}}, templates=False) == [
        OtherObject(where="f.yaml: document 1", kind="Job")
    ]
    (pod,) = found({"metadata": META}, templates=False, default_kind="Pod")
    assert isinstance(pod, PodManifest)
    assert pod.kind == "Pod"
    assert found({"metadata": META}) == [OtherObject(where="f.yaml: document 1", kind=None)]
    assert found(None) == []


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("just a string", "f.yaml: document 1: is a str, not a Kubernetes object (a mapping)"),
        ({"kind": "List", "items": 5}, "f.yaml: document 1: items is an int, not a list"),
        (
            {"kind": "List", "items": ["x"]},
            "f.yaml: document 1 item 0: is a str, not a Kubernetes object (a mapping)",
        ),
        ({"kind": ["Pod"]}, "f.yaml: document 1: kind is a list, not a string"),
    ],
)
def test_wrong_shapes_outside_any_pod_are_problems_naming_where(
    document: Any, problem: str
) -> None:
    (item,) = found(document)
    assert isinstance(item, ShapeProblem)
    assert item.message == problem


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ({"kind": "Pod", "metadata": "x"}, "metadata is a str, not a mapping"),
        (
            {"kind": "Pod", "metadata": {"annotations": ["a"]}},
            "metadata.annotations is a list, not a mapping",
        ),
        ({"kind": "Pod", "spec": 3}, "spec is an int, not a mapping"),
        (
            {"kind": "Pod", "status": {"containerStatuses": 1}},
            "status.containerStatuses is an int, not a list",
        ),
        (
            {"kind": "Pod", "status": {"containerStatuses": ["c"]}},
            "status.containerStatuses[0] is a str, not a mapping",
        ),
        ({"kind": "Deployment", "spec": "x"}, "spec is a str, not a mapping"),
        ({"kind": "Deployment", "spec": {}}, "spec.template is missing"),
        (
            {"kind": "CronJob", "spec": {"jobTemplate": []}},
            "spec.jobTemplate is a list, not a mapping",
        ),
        (
            {"kind": "Job", "spec": {"template": {"metadata": {"annotations": "a"}}}},
            "spec.template.metadata.annotations is a str, not a mapping",
        ),
        ({"kind": "PodTemplate", "template": 1}, "template is an int, not a mapping"),
    ],
)
def test_wrong_shapes_inside_a_pod_or_workload_are_problems_of_that_object(
    document: dict[str, Any], problem: str
) -> None:
    (item,) = found(document)
    assert isinstance(item, PodManifest)
    assert item.problems == (problem,)
