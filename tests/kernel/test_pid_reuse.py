"""Forced PID reuse: a signal meant for a dead process never reaches the one that got its PID.

The proof runs in a fresh PID namespace (``unshare --pid --fork --mount-proc``) so the driver
can write ``/proc/sys/kernel/ns_last_pid`` for that namespace only and make the kernel hand the
victim's exact PID to the next process (docs/reliability.md P1, N6). Per trial:

1. start victim V (``sleep``) in a kubepods-like container cgroup, wait until at least one
   clock tick after its start (mode ``wait``; see ``MODES``), observe its identity with a
   ``boot_ticks()`` stamp (an ``Observation``) and build the ``KillTarget``;
2. SIGKILL and reap V; write ``ns_last_pid = V.pid - 1``; start R (``sleep``), which gets V's
   PID — in another pod's container cgroup (variant ``other``) or in V's own (``same``);
3. ``PidfdKiller.signal_members([V's observation], target, TERM)`` and ``(…, KILL)`` must
   refuse with ``identity_changed``: the method ``signal_container`` signals each member with,
   given V's observation from before the reuse (``signal_container`` itself observes members
   when their turn comes, so R would be a member it reads fresh, not a stale identity); variant
   ``other`` also calls ``signal_container(target, KILL)``, which must find nothing to signal;
4. a pidfd opened on V before it died must give ESRCH, not reach R (the kernel half of the
   guarantee: a process dying *after* ``pidfd_open`` cannot redirect the signal);
5. R must still be alive: ``sleep`` dies on SIGTERM and SIGKILL alike, so being alive is proof
   that neither reached it. A trial where R died is a *wrong signal*.

The driver that runs inside the namespace is ``rigs.pid_reuse`` (``python -m rigs.pid_reuse``);
``python -m benchmarks.pid_reuse`` runs it ≥ 1000 times.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from gpuguard.adapters.killer import Observation, PidfdKiller, boot_ticks
from gpuguard.adapters.procfs import read_identity
from gpuguard.core.model import ProcessIdentity, StopSignal
from rigs.cgroups import CGROUP_MOUNT, CgroupTree, fake_container_id, require_kernel
from rigs.kill_targets import target_for
from rigs.pid_reuse import (
    SLEEP,
    require_unshare,
    run_in_new_pid_namespace,
    victim_and_rival_containers,
    wait_past_start_tick,
)

# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.kernel
@pytest.mark.parametrize("variant", ["other", "same"])
def test_never_signals_a_reused_pid(variant: str) -> None:
    require_unshare()

    summary = run_in_new_pid_namespace(trials=30, variants=[variant], timeout_seconds=120)

    assert summary["in_new_pid_namespace"] is True
    assert summary["trials"] == 30
    assert summary["reuse_achieved"] == 30, "ns_last_pid did not force reuse: proof is vacuous"
    assert summary["wrong_signals"] == 0
    assert summary["refused_identity_changed"] == 30
    assert summary["member_deliveries"] == 0
    assert summary["container_deliveries"] == 0
    assert summary["stale_pidfd_esrch"] == 30
    assert isinstance(summary["min_start_delta_ticks"], int)
    assert summary["min_start_delta_ticks"] >= 1


@pytest.mark.kernel
def test_a_same_tick_reuse_in_the_same_cgroup_is_refused_when_the_observation_is_stamped() -> None:
    """V observed at once (often in its first tick) and R in V's own cgroup: only the
    observation's stamp tells them apart when their starttimes are equal."""
    require_unshare()

    summary = run_in_new_pid_namespace(
        trials=60, variants=["same"], timeout_seconds=120, mode="stamp"
    )

    assert summary["reuse_achieved"] == 60
    assert summary["wrong_signals"] == 0
    assert summary["refused_identity_changed"] == 60
    assert summary["member_deliveries"] == 0


@pytest.mark.kernel
def test_the_same_identity_is_signalled_when_the_pid_was_not_reused(tmp_path: Path) -> None:
    """Control: the refusals above come from the reuse, not from a check that refuses all."""
    require_kernel(((2, ""),))
    with CgroupTree() as tree:
        cg, _ = victim_and_rival_containers(tree)
        v = tree.spawn(SLEEP, cgroups=[cg])
        identity = read_identity(Path("/proc"), v.pid)
        assert identity is not None
        killer = PidfdKiller(cgroup_root=CGROUP_MOUNT, proc_root=Path("/proc"))
        # An observation stamped in the process's start tick is rightly refused as ambiguous
        # (Observation): spawn and read can both land in that tick, which made this control
        # fail once in CI. Stamp it a tick later, as a member observed at leisure would be.
        wait_past_start_tick(identity)

        observed = Observation(
            identity=ProcessIdentity(pid=v.pid, start_ticks=identity.start_ticks),
            observed_at_ticks=boot_ticks(),
        )
        report = killer.signal_members(
            [observed],
            target_for(cg, fake_container_id(1), namespace="team-v", name="victim"),
            StopSignal.TERM,
            wait_seconds=5.0,
        )

        assert report.delivered == (identity,), report
        assert report.survivors == ()
        assert v.wait(timeout=5) == -signal.SIGTERM
