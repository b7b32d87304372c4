"""The pod-resources reader against a real gRPC server on a unix socket (rigs/podresources.py):
the translation of a real answer, its bounds, and every way the kubelet's socket fails (missing,
hanging, vanishing, restarting, too old, answering too much), each an ``unknown`` with its
reason, never an exception; and that it says so once.
"""

from __future__ import annotations

import shutil
import socket as sockets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.podresources import (
    MAX_MESSAGE_BYTES,
    PodResourcesReader,
    build_allocation_source,
)
from gpuguard.core.allocation import (
    MAX_CONTAINERS,
    MAX_DEVICES,
    MAX_NAME,
    MAX_PODS,
    ContainerDevices,
    DynamicDevice,
    PodAllocation,
)
from rigs.podresources import answer, container, kubelet, pod
from tests.fakes import FakeClock

UUID = "GPU-8f6d1c2e-0000-4000-8000-000000000001"
MIG = "MIG-1c2e8f6d-0000-4000-8000-000000000002"


@pytest.fixture
def sock() -> Iterator[Path]:
    """A socket path short enough for ``sun_path`` (108 bytes), unlike pytest's tmp_path."""
    directory = Path(tempfile.mkdtemp(prefix="podres-", dir="/tmp"))
    try:
        yield directory / "kubelet.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def reader(sock: Path) -> Iterator[PodResourcesReader]:
    r = PodResourcesReader(sock, clock=FakeClock(now=42.0), timeout=0.5)
    try:
        yield r
    finally:
        r.close()


def test_reads_every_device_plugin_resource_dra_device_and_pod_without_devices(
    sock: Path, reader: PodResourcesReader
) -> None:
    with kubelet(sock) as server:
        server.answer = answer(
            pod(
                "ml",
                "train",
                [
                    container(
                        "main",
                        devices=[
                            ("nvidia.com/gpu", [f"{UUID}::0", f"{UUID}::3"]),
                            ("example.com/nic", ["eth1"]),
                        ],
                    ),
                    container("sidecar"),
                ],
            ),
            pod("ml", "mig", [container("c", devices=[("nvidia.com/mig-1g.10gb", [MIG])])]),
            pod(
                "ml",
                "dra",
                [
                    container(
                        "c", dynamic=[("ml", "claim-0", [("gpu.nvidia.com", "node-a", "gpu-0")])]
                    )
                ],
            ),
            pod("web", "nginx", [container("nginx")]),
        )
        got = reader.read()
    assert got.unknown is None
    assert got.read_at == 42.0
    assert set(got.pods) == {("ml", "train"), ("ml", "mig"), ("ml", "dra"), ("web", "nginx")}
    assert got.pods["ml", "train"] == PodAllocation(
        namespace="ml",
        name="train",
        containers=("main", "sidecar"),
        devices=(
            ContainerDevices(
                container="main", resource="nvidia.com/gpu", device_ids=(f"{UUID}::0", f"{UUID}::3")
            ),
            ContainerDevices(container="main", resource="example.com/nic", device_ids=("eth1",)),
        ),
    )
    assert got.pods["ml", "mig"].devices == (
        ContainerDevices(container="c", resource="nvidia.com/mig-1g.10gb", device_ids=(MIG,)),
    )
    assert got.pods["ml", "dra"].dynamic == (
        DynamicDevice(
            container="c",
            claim_namespace="ml",
            claim_name="claim-0",
            driver="gpu.nvidia.com",
            pool="node-a",
            device="gpu-0",
        ),
    )
    assert got.pods["web", "nginx"] == PodAllocation(
        namespace="web", name="nginx", containers=("nginx",)
    )


def test_read_at_is_the_clock_when_list_was_sent(sock: Path) -> None:
    clock = FakeClock(now=7.0)
    r = PodResourcesReader(sock, clock=clock)
    with kubelet(sock):
        assert r.read().read_at == 7.0
        clock.advance(5)
        assert r.read().read_at == 12.0
    r.close()


def test_a_missing_socket_is_unknown_and_says_how_to_fix(
    sock: Path, reader: PodResourcesReader
) -> None:
    got = reader.read()
    assert got.read_at is None
    assert got.unknown is not None
    assert str(sock) in got.unknown
    assert "does not exist" in got.unknown
    assert "node.pod_resources_socket" in got.unknown


def test_a_hanging_kubelet_is_unknown_within_the_timeout(
    sock: Path, reader: PodResourcesReader
) -> None:
    with kubelet(sock) as server:
        server.hang = True
        start = time.monotonic()
        got = reader.read()
        took = time.monotonic() - start
    assert got.unknown is not None
    assert "did not answer" in got.unknown
    assert str(sock) in got.unknown
    assert took < 0.5 + 0.5


def test_a_socket_that_vanishes_is_unknown(sock: Path, reader: PodResourcesReader) -> None:
    with kubelet(sock):
        assert reader.read().unknown is None
    sock.unlink(missing_ok=True)
    got = reader.read()
    assert got.unknown is not None
    assert "does not exist" in got.unknown


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on (a kubelet that died without removing it)."""
    path.unlink(missing_ok=True)
    s = sockets.socket(sockets.AF_UNIX)
    s.bind(str(path))
    s.close()


def test_a_stale_socket_file_nobody_listens_on_is_unknown(
    sock: Path, reader: PodResourcesReader
) -> None:
    with kubelet(sock):
        assert reader.read().unknown is None
    stale_socket(sock)
    got = reader.read()
    assert got.unknown is not None
    assert "UNAVAILABLE" in got.unknown


def test_a_kubelet_restart_is_read_at_the_next_read(sock: Path, reader: PodResourcesReader) -> None:
    with kubelet(sock) as old:
        old.answer = answer(pod("a", "before"))
        assert set(reader.read().pods) == {("a", "before")}
    sock.unlink(missing_ok=True)
    with kubelet(sock) as new:
        new.answer = answer(pod("a", "after"))
        got = reader.read()
        assert got.unknown is None
        assert set(got.pods) == {("a", "after")}


def test_a_new_socket_file_is_read_though_the_old_connection_still_answers(
    sock: Path, reader: PodResourcesReader
) -> None:
    """The reader follows the socket file, not the connection it has: an old kubelet still
    answering on its removed socket is not read once a new one serves the path."""
    with kubelet(sock) as old:
        old.answer = answer(pod("a", "old"))
        assert set(reader.read().pods) == {("a", "old")}
        sock.unlink()
        with kubelet(sock) as new:
            new.answer = answer(pod("a", "new"))
            assert set(reader.read().pods) == {("a", "new")}


def test_a_kubelet_restart_after_failed_reads_is_read_at_once(
    sock: Path, reader: PodResourcesReader
) -> None:
    """No channel left waiting out its reconnect backoff: the first read after the kubelet is
    back answers, though the reads before it were refused."""
    with kubelet(sock):
        assert reader.read().unknown is None
    stale_socket(sock)
    for _ in range(3):
        assert "UNAVAILABLE" in (reader.read().unknown or "")
    with kubelet(sock) as new:
        new.answer = answer(pod("a", "back"))
        got = reader.read()
    assert got.unknown is None, got.unknown
    assert set(got.pods) == {("a", "back")}


def test_an_old_kubelet_without_v1_list_is_unknown(sock: Path, reader: PodResourcesReader) -> None:
    with kubelet(sock, serve_lister=False):
        got = reader.read()
    assert got.unknown is not None
    assert "UNIMPLEMENTED" in got.unknown
    assert "old kubelet" in got.unknown


def test_an_answer_past_max_pods_is_unknown_whole(sock: Path, reader: PodResourcesReader) -> None:
    with kubelet(sock) as server:
        server.answer = answer(*(pod("ns", f"p{i}") for i in range(MAX_PODS + 1)))
        got = reader.read()
        assert got.unknown is not None
        assert f"more than {MAX_PODS}" in got.unknown
        assert got.pods == {}
        server.answer = answer(*(pod("ns", f"p{i}") for i in range(MAX_PODS)))
        assert len(reader.read().pods) == MAX_PODS


def test_a_pod_past_a_bound_is_unknown_alone(sock: Path, reader: PodResourcesReader) -> None:
    many_containers = [container(f"c{i}") for i in range(MAX_CONTAINERS + 1)]
    many_ids = [str(i) for i in range(MAX_DEVICES + 1)]
    with kubelet(sock) as server:
        server.answer = answer(
            pod("ns", "containers", many_containers),
            pod("ns", "devices", [container("c", devices=[("nvidia.com/gpu", many_ids)])]),
            pod("ns", "name", [container("c" * (MAX_NAME + 1))]),
            pod("ns", "fine", [container(f"c{i}") for i in range(MAX_CONTAINERS)]),
            pod("ns", "at-bound", [container("c", devices=[("nvidia.com/gpu", many_ids[:-1])])]),
        )
        got = reader.read()
    assert got.unknown is None
    assert f"more than {MAX_CONTAINERS}" in (got.pods["ns", "containers"].unknown or "")
    assert f"more than {MAX_DEVICES}" in (got.pods["ns", "devices"].unknown or "")
    assert f"longer than {MAX_NAME}" in (got.pods["ns", "name"].unknown or "")
    assert got.pods["ns", "fine"].unknown is None
    assert len(got.pods["ns", "at-bound"].devices[0].device_ids) == MAX_DEVICES


def test_a_name_past_the_bound_in_any_field_makes_its_pod_unknown(
    sock: Path, reader: PodResourcesReader
) -> None:
    """Every name the answer holds is bounded, not only the pod's and its containers': a
    resource, a device ID, and each field of a DRA device; DRA devices count as devices."""
    long = "x" * (MAX_NAME + 1)
    claim = ("ns", "claim", [("gpu.nvidia.com", "pool", "gpu-0")])
    fields = {
        "resource": container("c", devices=[(long, ["0"])]),
        "device-id": container("c", devices=[("nvidia.com/gpu", ["0", long])]),
        "claim-namespace": container("c", dynamic=[(long, *claim[1:])]),
        "claim-name": container("c", dynamic=[("ns", long, claim[2])]),
        "driver": container("c", dynamic=[("ns", "claim", [(long, "pool", "gpu-0")])]),
        "pool": container("c", dynamic=[("ns", "claim", [("gpu.nvidia.com", long, "gpu-0")])]),
        "device": container("c", dynamic=[("ns", "claim", [("gpu.nvidia.com", "pool", long)])]),
    }
    ids = [str(i) for i in range(MAX_DEVICES)]
    with kubelet(sock) as server:
        server.answer = answer(
            *(pod("ns", name, [c]) for name, c in fields.items()),
            pod("ns", "dra-over", [container("c", [("nvidia.com/gpu", ids)], [claim])]),
            pod("ns", "both", [container("a" * (MAX_NAME + 1)), container("c", [("r", ids * 2)])]),
        )
        got = reader.read()
    for name in fields:
        assert f"longer than {MAX_NAME}" in (got.pods["ns", name].unknown or ""), name
    assert f"{MAX_DEVICES + 1} devices" in (got.pods["ns", "dra-over"].unknown or "")
    # Too many devices is said before a long name, whichever container holds which.
    assert f"more than {MAX_DEVICES}" in (got.pods["ns", "both"].unknown or "")


def test_a_pod_listed_twice_under_one_name_is_unknown(
    sock: Path, reader: PodResourcesReader
) -> None:
    with kubelet(sock) as server:
        server.answer = answer(
            pod("ns", "web-0", [container("c", devices=[("nvidia.com/gpu", [UUID])])]),
            pod("ns", "web-0", [container("c")]),
        )
        got = reader.read()
    assert got.pods["ns", "web-0"].unknown == "the kubelet lists two pods of this name"


def test_an_answer_past_the_largest_message_is_unknown(
    sock: Path, reader: PodResourcesReader
) -> None:
    with kubelet(sock) as server:
        server.answer = answer(pod("ns", "x" * (MAX_MESSAGE_BYTES + 1)))
        got = reader.read()
        assert got.unknown is not None
        assert "larger than 16 MiB" in got.unknown
        server.answer = answer(pod("ns", "small"))
        assert reader.read().unknown is None


def test_says_once_when_reads_turn_unknown_and_once_when_they_recover(
    sock: Path, reader: PodResourcesReader
) -> None:
    with capture_logs() as logs:
        for _ in range(3):
            reader.read()
        with kubelet(sock):
            for _ in range(3):
                reader.read()
    events = [(e["event"], e["log_level"]) for e in logs]
    assert events == [
        ("pod_resources_unknown", "warning"),
        ("pod_resources_recovered", "info"),
    ]
    assert str(sock) in logs[0]["reason"]


def test_a_socket_path_relative_to_the_working_directory_is_read(
    sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(sock.parent)
    r = PodResourcesReader(Path(sock.name), clock=FakeClock())
    with kubelet(sock) as server:
        server.answer = answer(pod("a", "b"))
        assert set(r.read().pods) == {("a", "b")}
    r.close()


def test_a_closed_reader_is_unknown(sock: Path, reader: PodResourcesReader) -> None:
    with kubelet(sock):
        reader.close()
        assert reader.read().unknown == "the pod-resources reader is closed"


def test_the_factory_reads_the_setting_and_none_turns_it_off(sock: Path) -> None:
    assert build_allocation_source(None, clock=FakeClock()) is None
    source = build_allocation_source(sock, clock=FakeClock())
    assert isinstance(source, PodResourcesReader)
    with kubelet(sock) as server:
        server.answer = answer(pod("a", "b"))
        assert set(source.read().pods) == {("a", "b")}
    source.close()
