"""A tenant over its limit with a process stuck in ``exec`` on a FUSE file whose daemon it
stopped, against the real ``gpuguard enforce``: real kube-apiserver, real cgroups and processes,
the NVML stand-in and a real FUSE mount (``tests/kernel/fuse_stall.py``).

Before the killer's reads were bounded, stopping the tenant's container read the stuck member's
``/proc/<pid>/stat``, which waits for as long as the daemon is stopped: the enforcer awaited that
call, so no other pod on the node was stopped either. The oracle: a neighbour over its limit in
another pod, confirmed after the tenant's stop began, is stopped on time; the tenant's other
process is stopped too, and the stuck one is refused by PID, never signalled.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rigs.controlplane import wait_until
from rigs.node import GIB, Rig, Worker
from tests.integration.tenant_processes import spawn_tenant
from tests.kernel.fuse_stall import fuse_mount
from tests.kernel.stuck import EXEC_AFTER_GO, go, stat_blocks

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def test_a_neighbour_is_stopped_after_a_tenant_over_its_limit_with_a_member_stuck_in_exec(
    rig: Rig, tmp_path: Path
) -> None:
    stalling = rig.add_pod("stalling", limit="1Gi")
    greedy = rig.add_pod("greedy", limit="1Gi")
    tenants: list[Worker] = []
    try:
        with fuse_mount(tmp_path) as fuse:
            stuck = spawn_tenant(rig, tenants, stalling, "stuck", EXEC_AFTER_GO, fuse.file)
            fuse.stop()
            go(stuck.proc)
            wait_until(
                lambda: stat_blocks(stuck.pid),
                timeout=10,
                what="the tenant's exec to block on the stopped daemon",
            )

            enforcer = rig.start_enforcer()
            wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")
            # The tenant's own worker takes its pod over the limit: its container, the stuck
            # process in it, is to be stopped (the Event is posted right before the killer call).
            hog = rig.spawn(stalling, "hog", used_bytes=2 * GIB)
            wait_until(
                lambda: "GPUMemoryLimitExceeded" in rig.event_reasons(stalling),
                timeout=20,
                what="the tenant's violation to be acted on",
            )
            offender = rig.spawn(greedy, "greedy", used_bytes=2 * GIB)
            wait_until(lambda: not offender.alive(), timeout=20, what="the neighbour to stop")

            assert offender.received() == ["SIGTERM"]
            wait_until(lambda: not hog.alive(), timeout=10, what="the tenant's worker to stop")
            assert hog.received() == ["SIGTERM"]
            refused = enforcer.wait_for("signal_refused", pid=stuck.pid)
            assert refused["reason"] == "signal_failed"
            assert f"PID {stuck.pid}" in refused["detail"]
            assert "not signalled" in refused["detail"]
            assert stuck.alive()  # never signalled: its identity could not be read
            assert enforcer.stop() == 0  # a killer read still blocked keeps nothing from exiting
    finally:
        for tenant in tenants:
            for pipe in (tenant.proc.stdin, tenant.proc.stdout):
                if pipe is not None:
                    pipe.close()
