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
from pathlib import Path

import pytest

from rigs.controlplane import wait_until
from rigs.node import GIB, Rig, Worker
from rigs.prereq import require
from tests.integration.tenant_processes import spawn_tenant
from tests.kernel.fuse_stall import fuse_mount
from tests.kernel.stuck import EXEC_AFTER_GO, FAT, HOLD, go

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


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
            holder = spawn_tenant(
                rig, tenants, stalling, "holder", HOLD, fuse.file, rig.device_node
            )
            stuck = spawn_tenant(rig, tenants, stalling, "stuck", EXEC_AFTER_GO, fuse.file)
            fat = spawn_tenant(rig, tenants, bloated, "fat", FAT, files)
            fuse.stop()
            go(stuck.proc)

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
