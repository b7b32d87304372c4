"""Attribution of real processes placed in real kubepods cgroup trees (v1 ``pids``,
``name=systemd`` and v2 ``unified``), read back through the real ``/proc``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuguard.adapters.procfs import GHOST_REASON, ProcfsProcessResolver
from gpuguard.core.cgroup import REASON_NO_KUBEPODS, REASON_NO_POD
from gpuguard.core.model import Runtime
from rigs.cgroups import (
    V2_ROOT,
    CgroupTree,
    Driver,
    Qos,
    RuntimeName,
    fake_container_id,
    hierarchy_dir,
    require_kernel,
)

pytestmark = pytest.mark.kernel

PROC = Path("/proc")
UID = "4b1f4f77-49e6-4e30-98db-e98055c8a54f"
OTHER = "0d6a4c1e-1111-4222-8333-944455556666"
SLEEP = ["sleep", "300"]


def cgroup_lines(pid: int) -> dict[str, str]:
    """``controllers → path`` of ``/proc/<pid>/cgroup`` (``""`` is the v2 line)."""
    out: dict[str, str] = {}
    for line in (PROC / str(pid) / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        out[controllers] = path
    return out


LAYOUTS = [
    # version, hierarchy, driver, qos, runtime
    (2, "", "systemd", "burstable", "containerd"),
    (2, "", "systemd", "guaranteed", "cri-o"),
    (2, "", "systemd", "besteffort", "docker"),
    (2, "", "cgroupfs", "burstable", "containerd"),
    (2, "", "cgroupfs", "guaranteed", "cri-o"),
    (1, "pids", "cgroupfs", "besteffort", "containerd"),
    (1, "pids", "systemd", "guaranteed", "containerd"),
    (1, "pids", "systemd", "burstable", "cri-o"),
    (1, "name=systemd", "systemd", "burstable", "docker"),
]


@pytest.mark.parametrize(
    ("version", "hierarchy", "driver", "qos", "runtime"),
    LAYOUTS,
    ids=[f"v{v}-{h or 'unified'}-{d}-{q}-{r}" for v, h, d, q, r in LAYOUTS],
)
def test_a_real_process_in_a_container_cgroup_is_attributed_to_its_pod_and_container(
    cgroup_tree: CgroupTree,
    version: int,
    hierarchy: str,
    driver: Driver,
    qos: Qos,
    runtime: RuntimeName,
) -> None:
    if hierarchy == "name=systemd":
        require_kernel([(1, "name=systemd")])
    cid = fake_container_id(7)
    cg = cgroup_tree.container(
        version=version,
        driver=driver,
        qos=qos,
        pod_uid=UID,
        runtime=runtime,
        container_id=cid,
        hierarchy=hierarchy or "pids",
    )
    proc = cgroup_tree.spawn(SLEEP, cgroups=[cg])
    # What the kernel shows: the line of that hierarchy carries the container path.
    assert cgroup_lines(proc.pid)[hierarchy] == cg.path

    got = ProcfsProcessResolver(PROC).attribute(proc.pid)

    assert got.is_pod, got.reason
    assert got.pod_uid == UID
    assert got.container_id == cid
    # cgroupfs names are bare IDs for containerd and Docker: the runtime is not knowable.
    expected_runtime = None if driver == "cgroupfs" and runtime != "cri-o" else Runtime(runtime)
    assert got.runtime == expected_runtime
    assert got.cgroup == cg
    assert got.cgroup_version == version


def test_a_process_nested_below_the_container_scope_is_the_containers(
    cgroup_tree: CgroupTree,
) -> None:
    cid = fake_container_id(1)
    scope = cgroup_tree.container(
        version=2, driver="systemd", qos="burstable", pod_uid=UID, runtime="cri-o",
        container_id=cid,
    )  # fmt: skip
    crun_subgroup = cgroup_tree.child(scope, "container")
    deeper = cgroup_tree.child(crun_subgroup, "worker")
    a = cgroup_tree.spawn(SLEEP, cgroups=[crun_subgroup])
    b = cgroup_tree.spawn(SLEEP, cgroups=[deeper])
    resolver = ProcfsProcessResolver(PROC)
    for pid in (a.pid, b.pid):
        got = resolver.attribute(pid)
        assert (got.pod_uid, got.container_id, got.runtime) == (UID, cid, Runtime.CRIO)
        assert got.cgroup == scope  # the scope, not the subgroup


def test_a_cgroup_named_like_another_pod_inside_a_container_does_not_change_attribution(
    cgroup_tree: CgroupTree,
) -> None:
    cid = fake_container_id(2)
    real = cgroup_tree.container(
        version=2, driver="systemd", qos="burstable", pod_uid=UID, runtime="containerd",
        container_id=cid,
    )  # fmt: skip
    other_ = OTHER.replace("-", "_")
    fake_pod = cgroup_tree.child(real, f"kubepods-burstable-pod{other_}.slice")
    fake_ctr = cgroup_tree.child(fake_pod, f"cri-containerd-{fake_container_id(3)}.scope")
    fake_root = cgroup_tree.child(real, "kubepods")
    fake_cgroupfs = cgroup_tree.child(cgroup_tree.child(fake_root, f"pod{OTHER}"), "c" * 64)
    resolver = ProcfsProcessResolver(PROC)
    for cg in (fake_ctr, fake_cgroupfs):
        proc = cgroup_tree.spawn(SLEEP, cgroups=[cg])
        assert cgroup_lines(proc.pid)[""] == cg.path  # the kernel shows the crafted path
        got = resolver.attribute(proc.pid)
        assert got.pod_uid == UID
        assert got.container_id == cid
        assert got.cgroup == real


def test_a_host_process_in_a_non_kubepods_cgroup_is_not_a_pod(cgroup_tree: CgroupTree) -> None:
    service = cgroup_tree.make(2, f"system.slice/pod{UID}.service")
    v1 = cgroup_tree.make(1, f"system.slice/pod{UID}/{fake_container_id(4)}")
    proc = cgroup_tree.spawn(SLEEP, cgroups=[service, v1])
    got = ProcfsProcessResolver(PROC).attribute(proc.pid)
    assert not got.is_pod
    assert got.identity is not None
    assert got.reason == REASON_NO_KUBEPODS


def test_a_process_in_a_qos_slice_is_not_a_pod(cgroup_tree: CgroupTree) -> None:
    qos = cgroup_tree.make(2, "kubepods.slice/kubepods-burstable.slice")
    proc = cgroup_tree.spawn(SLEEP, cgroups=[qos])
    got = ProcfsProcessResolver(PROC).attribute(proc.pid)
    assert not got.is_pod
    assert got.reason == REASON_NO_POD


def test_hybrid_host_prefers_the_v2_line_when_it_carries_a_kubepods_path(
    cgroup_tree: CgroupTree,
) -> None:
    cid_v2, cid_v1 = fake_container_id(5), fake_container_id(6)
    v2 = cgroup_tree.container(
        version=2, driver="systemd", qos="besteffort", pod_uid=UID, runtime="containerd",
        container_id=cid_v2,
    )  # fmt: skip
    v1 = cgroup_tree.container(
        version=1, driver="cgroupfs", qos="besteffort", pod_uid=OTHER, runtime="containerd",
        container_id=cid_v1,
    )  # fmt: skip
    proc = cgroup_tree.spawn(SLEEP, cgroups=[v2, v1])
    lines = cgroup_lines(proc.pid)
    assert lines[""] == v2.path
    assert lines["pids"] == v1.path
    got = ProcfsProcessResolver(PROC).attribute(proc.pid)
    assert (got.pod_uid, got.container_id, got.cgroup) == (UID, cid_v2, v2)


def test_hybrid_host_uses_the_v1_line_when_the_v2_line_is_not_kubepods(
    cgroup_tree: CgroupTree,
) -> None:
    cid = fake_container_id(8)
    v1 = cgroup_tree.container(
        version=1, driver="cgroupfs", qos="burstable", pod_uid=UID, runtime="docker",
        container_id=cid,
    )  # fmt: skip
    host_v2 = cgroup_tree.make(2, "system.slice/docker.service")
    proc = cgroup_tree.spawn(SLEEP, cgroups=[v1, host_v2])
    got = ProcfsProcessResolver(PROC).attribute(proc.pid)
    assert (got.pod_uid, got.container_id, got.cgroup) == (UID, cid, v1)
    assert got.cgroup_version == 1


def test_a_forked_child_is_attributed_like_its_parent(cgroup_tree: CgroupTree) -> None:
    cid = fake_container_id(9)
    cg = cgroup_tree.container(
        version=2, driver="cgroupfs", qos="guaranteed", pod_uid=UID, runtime="containerd",
        container_id=cid,
    )  # fmt: skip
    parent = cgroup_tree.spawn(["sh", "-c", "sleep 300 & wait"], cgroups=[cg])
    members: list[int] = []
    for _ in range(500):
        members = [p for p in CgroupTree.members(cg) if p != parent.pid]
        if members:
            break
        time.sleep(0.01)
    assert members, "the child never appeared"
    got = ProcfsProcessResolver(PROC).attribute(members[0])
    assert (got.pod_uid, got.container_id, got.cgroup) == (UID, cid, cg)


def test_an_exited_process_is_a_ghost_and_teardown_leaves_nothing(
    cgroup_tree: CgroupTree,
) -> None:
    cg = cgroup_tree.container(
        version=2, driver="systemd", qos="burstable", pod_uid=UID, runtime="containerd",
        container_id=fake_container_id(10),
    )  # fmt: skip
    proc = cgroup_tree.spawn(["sh", "-c", "read x"], cgroups=[cg], stdin=-1)
    resolver = ProcfsProcessResolver(PROC)
    alive = resolver.attribute(proc.pid)
    assert alive.is_pod
    proc.communicate(b"\n", timeout=5)
    got = resolver.attribute(proc.pid)
    if got.identity is not None:  # the PID was reused meanwhile: never the cached answer
        assert got.identity != alive.identity
    else:
        assert got.reason == GHOST_REASON
    cgroup_tree.close()
    assert not (V2_ROOT / cgroup_tree.name).exists()
    assert not (hierarchy_dir(1, "pids") / cgroup_tree.name).exists()


def test_gpuguard_explain_reports_a_real_container_process(cgroup_tree: CgroupTree) -> None:
    cid = fake_container_id(11)
    cg = cgroup_tree.container(
        version=2, driver="systemd", qos="burstable", pod_uid=UID, runtime="containerd",
        container_id=cid,
    )  # fmt: skip
    proc = cgroup_tree.spawn(SLEEP, cgroups=[cg])
    done = subprocess.run(
        [sys.executable, "-m", "gpuguard.cli", "explain", str(proc.pid), "--offline", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert (d["pid"], d["is_pod"], d["pod_uid"]) == (proc.pid, True, UID)
    assert (d["container_id"], d["runtime"], d["cgroup_version"]) == (cid, "containerd", 2)
    assert d["cgroup"] == cg.path
    assert d["reason"] is None
