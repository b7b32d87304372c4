"""A tenant's ways around enforcement that rest on what its own processes do, end to end: the
real ``gpuguard enforce`` over real processes in real kubepods cgroups and the NVML stand-in.

- An MPS daemon of its own: NVIDIA's container toolkit puts ``nvidia-cuda-mps-control`` into
  GPU containers and single-user MPS needs no privilege, so MPS clients listed on a GPU say
  nothing about who may be stopped there; only the admin's ``enforcement.mps_gpus`` does.
- GPU files hidden in a thread's own file table (``unshare(CLONE_FILES)``), and the process
  forking a child that keeps its context, then exiting within the owner settle time: its PID
  is a ghost nobody holds, which must not leave its memory nobody's.
- Short-lived processes in rotation, each gone before its own PID would settle.
"""

from __future__ import annotations

import os
import time

import pytest

from gpuguard.core.model import EnforcementPolicy
from rigs.controlplane import wait_until
from rigs.node import GIB, GPU_UUID, Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

SETTLE = EnforcementPolicy().owner_settle_seconds
MIB = 2**20


def test_a_tenants_own_mps_client_spares_neither_its_neighbour_nor_itself(rig: Rig) -> None:
    """MPS is not declared: a 100 MiB MPS client of the tenant's pod beside its own 30 GiB
    ordinary process and a neighbour's 20 GiB, both over 2Gi limits: both pods are stopped
    (before, NVML listing one MPS client refused every violation on the GPU ``mps``)."""
    tenant = rig.add_pod("mps-tenant", limit="2Gi")
    neighbour = rig.add_pod("neighbour", limit="2Gi")
    client = rig.spawn(tenant, "client", used_bytes=100 * MIB, mps=True)
    hog = rig.spawn(tenant, "hog", used_bytes=30 * GIB)
    greedy = rig.spawn(neighbour, "greedy", used_bytes=20 * GIB)
    enforcer = rig.start_enforcer()

    wait_until(lambda: not greedy.alive(), timeout=30, what="the neighbour to be stopped")
    wait_until(lambda: not hog.alive(), timeout=30, what="the tenant's own hog to be stopped")
    assert greedy.received() == ["SIGTERM"]
    assert hog.received() == ["SIGTERM"]
    assert client.received() == ["SIGTERM"]  # the client is the tenant's container's too
    assert enforcer.events("violation_refused", reason="mps") == []
    assert enforcer.stop() == 0


def test_where_the_admin_declared_mps_only_the_pod_with_an_mps_client_is_spared(
    rig: Rig,
) -> None:
    tenant = rig.add_pod("mps-tenant", limit="2Gi")
    neighbour = rig.add_pod("neighbour", limit="2Gi")
    client = rig.spawn(tenant, "client", used_bytes=4 * GIB, mps=True)
    greedy = rig.spawn(neighbour, "greedy", used_bytes=20 * GIB)
    enforcer = rig.start_enforcer(mps_gpus=[GPU_UUID])

    wait_until(lambda: not greedy.alive(), timeout=30, what="the neighbour to be stopped")
    enforcer.wait_for("violation_refused", reason="mps", timeout=20)
    assert greedy.received() == ["SIGTERM"]
    assert client.received() == []
    assert client.alive()
    assert enforcer.stop() == 0


@pytest.mark.parametrize("files", ["hidden", "closed"])
def test_a_process_that_forks_and_exits_before_it_settles_never_leaves_its_memory_nobodys(
    rig: Rig, files: str
) -> None:
    """The worker holds 20 GiB against 1Gi with its GPU file open only in a thread with its
    own file table (``hidden``: the leader's ``fd/`` does not show it), or closed (no file at
    all), forks a child that keeps the listing and exits right after the enforcer's first
    listing, within the settle time: the child, in the same container, is stopped (before:
    the ghost stayed unattributed for good, no Event, no signal)."""
    offender = rig.add_pod("hider", limit="1Gi")
    neighbour = rig.add_pod("modest", limit="4Gi")
    hider = rig.spawn(
        offender,
        "hider",
        used_bytes=20 * GIB,
        hidden=files == "hidden",
        closes_gpu_files=files == "closed",
        forks=True,
    )
    if files == "closed":
        hider.close_gpu_files()
    fd_dir = f"/proc/{hider.pid}/fd"
    assert str(rig.device_node) not in {os.readlink(f"{fd_dir}/{n}") for n in os.listdir(fd_dir)}
    calm = rig.spawn(neighbour, "calm", used_bytes=3 * GIB)
    enforcer = rig.start_enforcer(grace_seconds=3.0)
    wait_until(
        lambda: enforcer.metric("gpuguard_last_poll_timestamp_seconds") is not None,
        timeout=30,
        what="the enforcer's first poll",
    )
    child = hider.fork_and_exit()
    wait_until(lambda: hider.proc.poll() is not None, timeout=10, what="the hider to exit")
    assert hider.signals() == []  # it left before any stop: only its ghost is listed now

    wait_until(
        lambda: "SIGTERM" in hider.signals(), timeout=SETTLE + 25, what="the child to be stopped"
    )
    signalled = enforcer.settled_events("container_signalled", 1)
    assert [(e["signal"], e["pod"]) for e in signalled][:1] == [("SIGTERM", "hider")]
    assert child in signalled[0]["pids"]
    assert calm.received() == []
    assert calm.alive()
    assert enforcer.stop() == 0


def test_a_pod_rotating_short_lived_processes_without_gpu_files_is_stopped(rig: Rig) -> None:
    """Four 5 GiB processes of one pod (limit 1Gi), none with a GPU file open, each alive
    about 4 s (under the 5 s settle), one started every second: its memory is charged once
    the pod has been listed for the settle time, and the pod is stopped (before: 20 GiB held
    with nothing charged)."""
    offender = rig.add_pod("rotator", limit="1Gi")
    neighbour = rig.add_pod("modest", limit="4Gi")
    calm = rig.spawn(neighbour, "calm", used_bytes=3 * GIB)
    enforcer = rig.start_enforcer()
    alive = []
    deadline = time.monotonic() + SETTLE + 20
    stopped = False
    n = 0
    while time.monotonic() < deadline and not stopped:
        w = rig.spawn(offender, f"r{n}", used_bytes=5 * GIB, closes_gpu_files=True, listed=False)
        w.close_gpu_files()  # before NVML lists it: the fd check never sees a GPU file
        rig.list(w)
        alive.append((w, time.monotonic()))
        n += 1
        time.sleep(1.0)
        for worker, born in alive:
            if worker.alive() and time.monotonic() - born > 4.0 and not worker.signals():
                worker.proc.kill()
                worker.proc.wait()
        stopped = any("SIGTERM" in worker.signals() for worker, _ in alive)
    assert stopped, "a pod rotating short-lived processes was never stopped"
    signalled = enforcer.settled_events("container_signalled", 1)
    assert {e["pod"] for e in signalled} == {"rotator"}
    assert calm.received() == []
    assert enforcer.stop() == 0
