"""FilePodDirectory: the pods file of ``enforce/inspect/explain --pods-file``, re-read on change
by a watcher thread; ``snapshot()`` only returns the view in memory.

A file that turns invalid (bad YAML, the wrong shape, binary bytes) must never stop the enforcer:
the last good view is kept, its contact time stops advancing, and the error is logged once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.podfile import FilePodDirectory
from gpuguard.core.model import PodUid
from gpuguard.errors import ConfigError
from rigs.controlplane import wait_until
from tests.fakes import FakeClock
from tests.podfiles import UID_A, UID_B, pod, pods_list, write

LAUGHS = "a0: &a0 [x, x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, 30))


@contextmanager
def started(path: Path, clock: FakeClock) -> Iterator[FilePodDirectory]:
    directory = FilePodDirectory(path, node_name="node-1", clock=clock, poll_seconds=0.01)
    directory.start()
    try:
        yield directory
    finally:
        directory.stop()


@pytest.fixture
def pods_file(tmp_path: Path) -> Path:
    path = tmp_path / "pods.yaml"
    write(path, pods_list(pod(UID_A, "a"), pod(UID_B, "b", node="elsewhere")))
    return path


def test_reads_this_nodes_pods_and_counts_each_look_as_contact(pods_file: Path) -> None:
    clock = FakeClock()
    with started(pods_file, clock) as directory:
        assert directory.wait_synced(0)
        snapshot = directory.snapshot()
        assert snapshot.synced
        assert set(snapshot.pods) == {PodUid(UID_A)}
        assert snapshot.last_contact_at == clock.now
        clock.advance(1)
        wait_until(
            lambda: directory.snapshot().last_contact_at == clock.now, what="contact, unchanged"
        )
        write(pods_file, pods_list(pod(UID_A, "a"), pod(UID_B, "b")))
        wait_until(
            lambda: set(directory.snapshot().pods) == {PodUid(UID_A), PodUid(UID_B)},
            what="the changed file read",
        )
        assert directory.problem() is None
        assert directory.node().seen, "a pods file has no Node to wait for"


def test_a_snapshot_is_the_view_in_memory_and_never_reads_the_file(pods_file: Path) -> None:
    """The old defect: ``snapshot()`` stat'ed and re-parsed the file on the event loop. Only the
    watcher reads it: once stopped, a changed file is not seen and nothing is read."""
    clock = FakeClock()
    with started(pods_file, clock) as directory:
        pass
    write(pods_file, pods_list(pod(UID_B, "b")))
    clock.advance(1)
    snapshot = directory.snapshot()
    assert set(snapshot.pods) == {PodUid(UID_A)}
    assert snapshot.last_contact_at == clock.now - 1


def test_nothing_is_read_before_start(pods_file: Path) -> None:
    directory = FilePodDirectory(pods_file, node_name="node-1", clock=FakeClock())
    assert not directory.snapshot().synced
    assert not directory.wait_synced(0)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("kind: List\nitems: 5\n", "document 1: items is an int, not a list"),
        ("just a string\n", "document 1: is a str, not a Kubernetes object (a mapping)"),
        (b"\x00\xff\xfe binary", "pods file is binary, not text (a NUL byte at byte offset 0)"),
        (b"kind: List\n\xff\xfe", "pods file is not UTF-8 text (byte 0xff at byte offset 11"),
        ("items: [\n", "not valid YAML at line 2, column 1"),
        (
            "kind: List\nitems:\n- {kind: Pod, metadata: {uid: u, name: n, annotations: [x]}}\n",
            "document 1 item 0: Pod default/n: metadata.annotations is a list, not a mapping",
        ),
        (LAUGHS, "document 1: aliases expand to more than"),
    ],
)
def test_a_file_that_turns_invalid_keeps_the_last_good_pods_and_logs_once(
    pods_file: Path, content: str | bytes, says: str
) -> None:
    clock = FakeClock()
    with started(pods_file, clock) as directory:
        good = directory.snapshot()
        with capture_logs() as logs:
            write(pods_file, content)
            wait_until(lambda: directory.problem() is not None, what="the invalid file seen")
            for _ in range(3):
                clock.advance(1)
                time.sleep(0.05)  # a few more looks at the same bad file
                snapshot = directory.snapshot()
                assert snapshot.pods == good.pods
                assert snapshot.last_contact_at == good.last_contact_at  # stops advancing
        invalid = [entry for entry in logs if entry["event"] == "pods_file_invalid"]
        assert len(invalid) == 1, logs
        assert invalid[0]["path"] == str(pods_file)
        assert invalid[0]["log_level"] == "error"
        assert says in invalid[0]["error"]
        assert invalid[0]["error"].startswith(str(pods_file))
        assert str(directory.problem()) == invalid[0]["error"]

        # Fixed: read again, contact resumes, and a new breakage is logged again.
        with capture_logs() as logs:
            write(pods_file, pods_list(pod(UID_B, "b")))
            wait_until(
                lambda: set(directory.snapshot().pods) == {PodUid(UID_B)}, what="the fixed file"
            )
        assert directory.problem() is None
        assert [entry["event"] for entry in logs] == ["pods_file_valid"]
        wait_until(lambda: directory.snapshot().last_contact_at == clock.now, what="contact")
        with capture_logs() as logs:
            write(pods_file, content)
            wait_until(lambda: directory.problem() is not None, what="the new breakage")
        assert [entry["event"] for entry in logs] == ["pods_file_invalid"]


def test_a_file_that_disappears_is_logged_once_and_keeps_the_last_good_pods(
    pods_file: Path,
) -> None:
    clock = FakeClock()
    with started(pods_file, clock) as directory:
        good = directory.snapshot()
        with capture_logs() as logs:
            pods_file.unlink()
            wait_until(lambda: directory.problem() is not None, what="the file gone")
            time.sleep(0.05)  # a few more looks
        assert directory.snapshot().pods == good.pods
    assert [entry["event"] for entry in logs] == ["pods_file_invalid"]
    assert "No such file or directory" in logs[0]["error"]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("kind: List\nitems: 5\n", "pods.yaml: document 1: items is an int, not a list"),
        ("- a\n- b\n", "pods.yaml: document 1: is a list, not a Kubernetes object (a mapping)"),
        (b"\xff", "pods.yaml: pods file is not UTF-8 text (byte 0xff at byte offset 0"),
    ],
)
def test_an_invalid_file_at_start_is_a_config_error_naming_the_file(
    tmp_path: Path, content: str | bytes, says: str
) -> None:
    path = tmp_path / "pods.yaml"
    write(path, content)
    directory = FilePodDirectory(path, node_name="node-1", clock=FakeClock())
    with pytest.raises(ConfigError) as caught:
        directory.start()
    (problem,) = caught.value.problems
    assert problem.startswith(str(path.parent))
    assert says in problem


def test_a_directory_as_pods_file_is_a_config_error_saying_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        FilePodDirectory(tmp_path, node_name="node-1", clock=FakeClock()).start()
    assert caught.value.problems == [
        f"{tmp_path}: is a directory, not a regular file: refusing to read it as a pods file"
    ]


def test_workload_templates_in_the_pods_file_are_not_running_pods(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    deployment = {
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "ml", "uid": UID_B},
        "spec": {"template": pod(UID_B, "template")},
    }
    write(path, pods_list(pod(UID_A, "a"), deployment))
    with started(path, FakeClock()) as directory:
        assert set(directory.snapshot().pods) == {PodUid(UID_A)}


def test_namespaces_in_the_pods_file_say_which_carry_the_exempt_label(tmp_path: Path) -> None:
    """With ``limits.exempt_namespace_label`` set, the file's Namespace objects are the labels
    the enforcer knows; a namespace the file has no Namespace for carries none. Without the
    label, labels stay unknown and unread."""
    path = tmp_path / "pods.yaml"
    label = ("gpuguard.io/exempt", "true")

    def namespace(name: str, labels: dict[str, object]) -> dict[str, object]:
        return {"kind": "Namespace", "metadata": {"name": name, "labels": labels}}

    write(
        path,
        pods_list(
            pod(UID_A, "a"),
            namespace("gpu-operator", {"gpuguard.io/exempt": "true"}),
            namespace("nvidia-device-plugin", {"gpuguard.io/exempt": "false"}),
            namespace("odd", {"gpuguard.io/exempt": True}),
        ),
    )
    clock = FakeClock()
    directory = FilePodDirectory(path, node_name="node-1", clock=clock, exempt_label=label)
    directory.start()
    try:
        snapshot = directory.snapshot()
        assert set(snapshot.pods) == {PodUid(UID_A)}
        assert snapshot.labelled_namespaces == frozenset({"gpu-operator"})
        assert snapshot.namespaces_contact_at == clock.now
    finally:
        directory.stop()
    with started(path, clock) as unlabelled:
        assert unlabelled.snapshot().labelled_namespaces is None
