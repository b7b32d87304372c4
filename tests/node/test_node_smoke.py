"""The real node itself (rigs/kubelet/node.py), before anything of gpuguard runs on it: a kubelet
v1.37.2 with containerd v2.4.2, runc and the CNI bridge registers with the real API server and
goes Ready; a scheduled pod runs busybox ``sleep`` as its container's PID 1 on the pod network;
its host PIDs come from the kubelet's real cgroup tree; the API server reaches the kubelet (pod
logs); a SIGKILL from the host makes the kubelet restart the container (``restartCount``); the
pod deletes; and ``close`` leaves nothing on the machine. The whole round runs twice in one
session, each on a fresh node, to show that a run leaves nothing behind for the next. On a busy
machine: another's ``kubepods`` cgroup (with a live process), someone's ``cni0`` and a cgroup
made while the node runs are neither judged as its leftovers nor touched.

Needs root, etcd + kube-apiserver (scripts/ensure-testbin.sh), the controller-manager and
scheduler (scripts/ensure-controlplane.sh) and the node (scripts/ensure-node.sh), which the
fixtures run; missing, the module skips locally and fails in CI (rigs/prereq.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rigs.controlplane import (
    AdminRequestError,
    ControlPlane,
    KubeCluster,
    control_plane,
    plane_binaries,
    wait_until,
)
from rigs.kubelet.netns import CLUSTER_IP
from rigs.kubelet.node import (
    BRIDGE,
    BUSYBOX_REF,
    RealNode,
    busybox_image,
    cgroup_mounts,
    ensure_node_binaries,
    host_snapshot,
    mounts_under,
    processes_mentioning,
)
from rigs.prereq import require

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.node]

NODE = "gpu-node-1"
NAMESPACE = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plane:
    cluster: KubeCluster
    plane: ControlPlane
    node_bin: Path


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """Its own etcd + kube-apiserver + controller-manager + scheduler (the node lifecycle
    controller lifts the not-ready taint), stopped by PID at module end."""
    require(os.geteuid() == 0, "a real node needs root (kubelet, containerd, runc)")
    binaries = plane_binaries()
    node_bin, why = ensure_node_binaries()
    require(node_bin is not None, why or "")
    assert node_bin is not None
    with control_plane(tmp_path_factory.mktemp("cluster"), binaries, node_egress=True) as control:
        yield Plane(cluster=control.cluster, plane=control, node_bin=node_bin)


def sleeper(name: str) -> dict[str, Any]:
    """busybox ``sleep`` as the container's PID 1 (``exec`` after one log line); BestEffort."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_REF,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", "echo started; exec sleep 3600"],
                }
            ],
        },
    }


def get_pod(cluster: KubeCluster, name: str) -> dict[str, Any]:
    return cluster.admin_request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")


def running(pod: dict[str, Any], restarts: int = 0) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(
        statuses
        and "running" in statuses[0]["state"]
        and statuses[0]["restartCount"] >= restarts
        and pod["status"].get("podIP")
    )


def pod_log(cluster: KubeCluster, name: str) -> str:
    """The container's log, through the API server from the kubelet (its client cert, the
    kubelet's serving cert and webhook authorization, the node's InternalIP)."""
    ctx = ssl.create_default_context(cafile=str(cluster.pki["ca.crt"]))
    ctx.load_cert_chain(str(cluster.pki["admin.crt"]), str(cluster.pki["admin.key"]))
    url = f"{cluster.server}/api/v1/namespaces/{NAMESPACE}/pods/{name}/log"
    with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
        return str(r.read().decode())


def sigkill(pid: int) -> None:
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def one_host_pid(node: RealNode, pod: dict[str, Any]) -> int:
    """The container's only host PID, from the kubelet's cgroup tree, checked against the
    process's own /proc/<pid>/cgroup and its PID in the container's namespace."""
    uid = pod["metadata"]["uid"]
    cid = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    pids = node.container_host_pids(uid, cid)
    assert len(pids) == 1, (pids, node.logs())
    pid = pids[0]
    cgroups = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    want = f"/{node.cgroup_root}/kubepods/besteffort/pod{uid}/{cid}"
    assert all(line.split(":", 2)[2] == want for line in cgroups), (want, cgroups)
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"3600"]
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    assert status["NSpid"].split()[-1] == "1", status["NSpid"]  # PID 1 in its namespace
    return pid


def ip_in(netns: Path | None, *args: str) -> str:
    """``ip ARGS`` in the namespace pinned at ``netns`` (``None``: the host's)."""
    enter = ["nsenter", f"--net={netns}", "--"] if netns else []
    return subprocess.run([*enter, "ip", *args], capture_output=True, text=True, check=True).stdout


def assert_a_network_of_its_own(node: RealNode, pod: dict[str, Any]) -> None:
    """The node's network is its namespace's: containerd and the kubelet run there, the bridge,
    the pod's, the node's and the ClusterIP's addresses exist there and nowhere on the host,
    and nothing there routes out of it."""
    host_ns = os.stat("/proc/self/ns/net").st_ino
    netns = os.stat(node.netns).st_ino
    assert netns != host_ns
    for proc in (node._kubelet, node._containerd):
        assert proc is not None
        assert os.stat(f"/proc/{proc.pid}/ns/net").st_ino == netns
    inside, host = ip_in(node.netns, "-4", "-o", "addr"), ip_in(None, "-4", "-o", "addr")
    for address in (node.ip, CLUSTER_IP, "10.88.0.1"):
        assert f" {address}/" in inside, inside
        assert f" {address}/" not in host, host
    assert f" {BRIDGE} " in inside, inside
    pod_ip = pod["status"]["podIP"]
    assert f" {pod_ip}/" not in host, host
    assert f" dev {BRIDGE} " in ip_in(node.netns, "route", "get", pod_ip)  # the pod, on the bridge
    routes = ip_in(node.netns, "route")
    assert "default" not in routes, routes


@pytest.mark.parametrize("round_", [1, 2])
def test_a_real_node_runs_a_pod_restarts_it_and_leaves_nothing(
    plane: Plane, tmp_path: Path, round_: int
) -> None:
    t0 = time.monotonic()
    before = host_snapshot()
    cluster = plane.cluster
    node = RealNode(cluster, tmp_path / "node", plane.node_bin, name=NODE)
    try:
        node.start()
        assert node.ready_seconds is not None
        assert BUSYBOX_REF in node.import_image(busybox_image().archive)
        name = f"sleeper-{round_}"
        cluster.admin_request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", sleeper(name))
        wait_until(
            lambda: running(get_pod(cluster, name)),
            timeout=120,
            interval=0.5,
            what=f"{name} Running on {NODE}",
        )
        pod = get_pod(cluster, name)
        assert pod["spec"]["nodeName"] == NODE
        assert pod["status"]["podIP"].startswith("10.88."), pod["status"]
        assert pod["status"]["hostIP"] == node.ip
        assert_a_network_of_its_own(node, pod)
        pid = one_host_pid(node, pod)
        assert pod_log(cluster, name) == "started\n"

        sigkill(pid)
        wait_until(
            lambda: running(get_pod(cluster, name), restarts=1),
            timeout=60,
            interval=0.5,
            what=f"{name} restarted by the kubelet",
        )
        again = get_pod(cluster, name)
        assert again["status"]["containerStatuses"][0]["restartCount"] == 1
        last = again["status"]["containerStatuses"][0]["lastState"]["terminated"]
        assert last["exitCode"] == 137, last
        assert one_host_pid(node, again) != pid

        cluster.admin_request(
            "DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}?gracePeriodSeconds=1"
        )

        def gone() -> bool:
            try:
                get_pod(cluster, name)
            except AdminRequestError as e:
                return e.code == 404
            return False

        wait_until(gone, timeout=60, interval=0.5, what=f"{name} deleted by the kubelet")
    except BaseException:
        print(node.logs())
        raise
    finally:
        node.close()
    assert node.leftovers() == []
    assert sorted(host_snapshot() - before) == []
    timings = {
        "round": round_,
        "start_to_ready_seconds": round(node.ready_seconds or 0, 1),
        "total_seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(timings))
    (tmp_path / "timings.json").write_text(json.dumps(timings))


def test_a_crashed_node_is_reaped_by_the_next_start(plane: Plane, tmp_path: Path) -> None:
    """A run killed mid-pod (its kubelet and containerd die with it, the shims and the pod's
    processes do not) leaves a marker; the next node's start removes all of it."""
    cluster = plane.cluster
    crashed = RealNode(cluster, tmp_path / "crashed", plane.node_bin, name=NODE)
    crashed.start()
    try:
        crashed.import_image(busybox_image().archive)
        cluster.admin_request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", sleeper("orphan"))
        wait_until(lambda: running(get_pod(cluster, "orphan")), timeout=120, what="orphan Running")
        pid = one_host_pid(crashed, get_pod(cluster, "orphan"))
    except BaseException:
        crashed.close()
        raise
    # The crash: what PR_SET_PDEATHSIG does to the two processes, what the end of this process
    # does to its relays into the node's network namespace, and no close.
    for proc in (crashed._kubelet, crashed._containerd):
        assert proc is not None
        proc.kill()
        proc.wait()
    assert crashed.network is not None
    crashed.network.stop_relays()
    crashed._closed = True
    assert crashed._lock is not None
    crashed._lock.close()
    assert Path(f"/proc/{pid}").exists(), "the pod's process outlives the crash"
    assert f"netns {crashed.netns}" in crashed.leftovers()

    node = RealNode(cluster, tmp_path / "next", plane.node_bin, name=NODE)
    try:
        node.start()  # reaps first
        assert not Path(f"/proc/{pid}").exists()
        assert not crashed._marker_path.exists()
        assert processes_mentioning([f"{crashed.dir}/"]) == {}
        assert mounts_under([crashed.dir]) == []
    finally:
        node.close()
    assert crashed.leftovers() == []
    assert node.leftovers() == []


@contextlib.contextmanager
def foreign_state(tag: str) -> Iterator[tuple[Path, int]]:
    """What another kubelet and another network would leave on a busy machine: a ``kubepods``
    cgroup (pids hierarchy) holding a live ``sleep``, and a ``cni0`` bridge; each made only when
    absent, and removed again. Yields the process's cgroup and PID."""
    made: list[Path] = []
    pids_top = next(m for m in cgroup_mounts() if m.name == "pids")
    kubepods = pids_top / "kubepods"
    if not kubepods.exists():
        kubepods.mkdir()
        made.append(kubepods)
    cgroup = kubepods / f"foreign-{tag}"
    cgroup.mkdir()
    made.append(cgroup)
    link = subprocess.run(["ip", "link", "add", "cni0", "type", "bridge"], capture_output=True)
    proc = subprocess.Popen(["sleep", "600"])
    try:
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        yield cgroup, proc.pid
    finally:
        proc.kill()
        proc.wait()
        if link.returncode == 0:
            subprocess.run(["ip", "link", "del", "cni0"], capture_output=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


def test_another_processes_cgroups_and_links_are_not_this_nodes_leftovers(
    plane: Plane, tmp_path: Path
) -> None:
    """Another kubelet's ``kubepods`` (a live process in it) and a ``cni0`` exist before the
    node starts, another cgroup appears while it runs: the node starts, its close removes none
    of them and reports none; what the node itself would leave is still reported."""
    memory_top = next(m for m in cgroup_mounts() if m.name == "memory")
    during = memory_top / f"foreign-during-{os.getpid()}"
    with foreign_state(str(os.getpid())) as (cgroup, pid):
        before = host_snapshot()
        node = RealNode(plane.cluster, tmp_path / "node", plane.node_bin, name=NODE)
        try:
            node.start()
            during.mkdir()
            # The kubelet's pod tree is below the node's own root, not the foreign kubepods.
            assert (memory_top / node.cgroup_root / "kubepods").is_dir()
        finally:
            node.close()
        try:
            assert during.is_dir(), "a cgroup made while the node ran is not the node's"
        finally:
            with contextlib.suppress(OSError):
                during.rmdir()
        assert node.leftovers() == []
        assert sorted(host_snapshot() - before) == []
        assert Path(f"/proc/{pid}").exists(), "the foreign kubepods' process lives"
        assert (cgroup / "cgroup.procs").read_text().split() == [str(pid)]
        assert link_exists("cni0"), "someone's cni0 is left alone"
    # The check can fail: the node's own cgroup root and network namespace, were they left, are
    # reported.
    own = next(m for m in cgroup_mounts() if m.name == "pids") / node.cgroup_root
    own.mkdir()
    node.netns.touch()
    subprocess.run(["unshare", f"--net={node.netns}", "true"], check=True)
    try:
        assert node.leftovers() == [f"cgroup {own}", f"netns {node.netns}"]
    finally:
        own.rmdir()
        subprocess.run(["umount", str(node.netns)], check=True)
        node.netns.unlink()
    assert node.leftovers() == []
