"""Who owns what NVML lists under a PID, end to end: the real ``gpuguard enforce`` over real
processes in real kubepods cgroups and the NVML stand-in (docs/gpu-e2e.md, Rerun after the ownership
rule).

A process can close every GPU device file and keep its memory (measured on an H200: 100 GiB
stayed allocated, NVML kept listing its PID, a neighbour's allocation failed). The fd check
(``Attribution.holds_gpu``) then answers "no GPU open"; that must never let a live process
disown its memory, whether it closed its files before the enforcer first listed it (an
enforcer restart, a rolling upgrade) or while the enforcer watched. The other direction (a
reused PID is never charged for a dead process's memory) is ``tests/kernel/test_pid_reuse.py``
and ``tests/test_policy.py``.
"""

from __future__ import annotations

import time

import pytest

from gpuguard.core.model import EnforcementPolicy
from rigs.controlplane import wait_until
from rigs.node import GIB, Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

SETTLE = EnforcementPolicy().owner_settle_seconds


def test_a_process_that_closed_its_gpu_files_before_the_enforcer_started_is_stopped(
    rig: Rig,
) -> None:
    offender = rig.add_pod("closer", limit="1Gi")
    neighbour = rig.add_pod("modest", limit="4Gi")
    closer = rig.spawn(offender, "closer", used_bytes=6 * GIB, closes_gpu_files=True)
    closer.close_gpu_files()
    calm = rig.spawn(neighbour, "calm", used_bytes=3 * GIB)

    enforcer = rig.start_enforcer()
    # First reported as not (yet) its own: it might be a process handed a dead one's PID.
    enforcer.wait_for("memory_not_enforced", reason="identity_changed", timeout=30)
    assert closer.received() == []
    wait_until(lambda: not closer.alive(), timeout=SETTLE + 20, what="the closer to be stopped")

    assert closer.received() == ["SIGTERM"]
    assert calm.received() == []
    assert calm.alive()
    signalled = enforcer.settled_events("container_signalled", 1)
    assert [(e["signal"], e["pod"], e["pids"]) for e in signalled] == [
        ("SIGTERM", "closer", [closer.pid])
    ]
    assert enforcer.stop() == 0


def test_a_process_that_closes_its_gpu_files_while_watched_is_still_charged(rig: Rig) -> None:
    """Charged on without a break: its file was seen open, and ``ProcfsProcessResolver``
    remembers (and pins) a GPU holder per identity, so closing it never makes its memory "not
    its own", not even before its PID has been listed for the settle time. It closes well within
    that time (NVML lists it only once the enforcer runs), so the settle clock alone cannot
    charge it: without the remembered holder it is refused as ``identity_changed`` until
    settled (measured: the test then fails here; before, it passed through the settle alone)."""
    offender = rig.add_pod("closer", limit="4Gi")
    neighbour = rig.add_pod("modest", limit="4Gi")
    calm = rig.spawn(neighbour, "calm", used_bytes=3 * GIB)
    enforcer = rig.start_enforcer()
    wait_until(
        lambda: enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", {"pod": "modest"}) == 3 * GIB,
        timeout=30,
        what="the enforcer to charge the neighbour",
    )
    closer = rig.spawn(offender, "closer", used_bytes=2 * GIB, closes_gpu_files=True, listed=False)
    listed_at = time.monotonic()  # NVML lists it from now on: no settle clock ran before
    rig.list(closer)
    wait_until(
        lambda: enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", {"pod": "closer"}) == 2 * GIB,
        timeout=10,
        what="the closer charged while its file is open",
    )

    closer.close_gpu_files()
    rig.set_usage(closer, 12 * GIB)
    closed_after = time.monotonic() - listed_at
    # Cycles (0.1 s apart) must run between the close and the settle time, else this proves nothing.
    assert closed_after < SETTLE - 1, f"closed {closed_after:.1f} s after its first listing"
    wait_until(lambda: not closer.alive(), timeout=20, what="the closer to be stopped")

    assert closer.received() == ["SIGTERM"]
    assert calm.received() == []
    assert calm.alive()
    assert enforcer.events("memory_not_enforced", pid=closer.pid) == []  # never left uncharged
    assert enforcer.stop() == 0
