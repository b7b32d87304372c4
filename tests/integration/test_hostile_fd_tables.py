"""Tenants that make reading their open files slow or endless, against the real
``gpuguard enforce``: real kube-apiserver, real cgroups and processes, the NVML stand-in and a
real FUSE mount whose daemon is stopped (``tests/kernel/fuse_stall.py``).

Before the GPU check was bounded, one tenant's process holding a file on a stopped FUSE daemon
blocked the attribution of every PID on the node (``stat`` of its fd link waited for the
daemon): no pod was stopped, whatever it used. The oracle: a neighbour over its limit is
stopped, on time, while the tenants go on.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.apiserver import wait_until
from tests.integration.rig import GIB, PodInfo, Rig, Worker
from tests.kernel.fuse_stall import fuse_mount
from tests.kernel.test_hostile_fd_tables import EXEC_AFTER_GO, FAT, HOLD
from tests.prereq import require

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def _tenant(
    rig: Rig, tenants: list[Worker], pod: PodInfo, name: str, script: str, *args: object
) -> Worker:
    """A tenant's process running ``script`` in ``pod``'s container cgroup, listed by NVML
    with 1 GiB, once it said ``ready``; added to ``tenants`` (whose pipes the test closes)."""
    cgroup = rig.tree.container(
        version=2,
        driver="systemd",
        qos="burstable",
        pod_uid=pod.uid,
        runtime="containerd",
        container_id=pod.container_id,
    )
    proc = rig.tree.spawn(
        [sys.executable, "-c", script, *map(str, args)],
        cgroups=[cgroup],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    worker = Worker(name=name, proc=proc, record=rig.dir / f"{name}.signals", used_bytes=GIB)
    tenants.append(worker)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready", f"tenant {name} did not start"
    rig.workers.append(worker)
    rig.write_scenario()
    return worker


def test_a_pod_over_its_limit_is_stopped_while_tenants_stall_and_bloat_their_file_tables(
    rig: Rig, tmp_path: Path
) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = 50_000 if hard == resource.RLIM_INFINITY else min(50_000, hard - 64)
    require(files > 16_000, f"RLIMIT_NOFILE {hard} allows too few files")
    stalling = rig.add_pod("stalling", limit="8Gi")
    bloated = rig.add_pod("bloated", limit="8Gi")
    greedy = rig.add_pod("greedy", limit="1Gi")
    tenants: list[Worker] = []
    try:
        with fuse_mount(tmp_path) as fuse:
            # A file on the FUSE mount before its GPU file, and a process whose exec waits on the
            # daemon (its stat and fd links block), once the daemon is stopped; ~20 000 files.
            holder = _tenant(rig, tenants, stalling, "holder", HOLD, fuse.file, rig.device_node)
            stuck = _tenant(rig, tenants, stalling, "stuck", EXEC_AFTER_GO, fuse.file)
            fat = _tenant(rig, tenants, bloated, "fat", FAT, files)
            fuse.stop()
            assert stuck.proc.stdin is not None
            stuck.proc.stdin.write(b"go\n")
            stuck.proc.stdin.flush()

            enforcer = rig.start_enforcer()
            wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")
            offender = rig.spawn(greedy, "greedy", used_bytes=2 * GIB)
            wait_until(lambda: not offender.alive(), timeout=20, what="the offender to be stopped")

            assert offender.received() == ["SIGTERM"]
            assert holder.alive()
            assert fat.alive()
            enforcer.wait_for("gpu_fd_check_incomplete", pid=fat.pid)
            blocked = enforcer.wait_for("proc_read_blocked", pid=stuck.pid)
            assert blocked["reading"] == "stat"
            assert enforcer.stop() == 0  # a read still blocked keeps nothing from exiting
    finally:
        for tenant in tenants:
            for pipe in (tenant.proc.stdin, tenant.proc.stdout):
                if pipe is not None:
                    pipe.close()
