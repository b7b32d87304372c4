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

This module is also the driver that runs inside the namespace
(``python -m tests.kernel.test_pid_reuse --trials N --variant other``); ``benchmarks/pid_reuse.py``
runs it ≥ 1000 times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from gpuguard.adapters.killer import Observation, PidfdKiller, boot_ticks
from gpuguard.adapters.procfs import read_identity
from gpuguard.adapters.readiness import readable
from gpuguard.core.model import (
    ContainerCgroup,
    ProcessIdentity,
    RefusalReason,
    StopSignal,
)
from tests.kernel.cgroups import CGROUP_MOUNT, CgroupTree, fake_container_id, require_kernel
from tests.kernel.kill_targets import target_for
from tests.kernel.pid_reuse_rig import (
    SLEEP,
    require_unshare,
    run_driver_in_new_pid_namespace,
    start_on_its_pid,
    victim_and_rival_containers,
    wait_past_start_tick,
)

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# The driver (runs inside the new PID namespace)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    variant: str
    victim: int
    reused: bool
    """R got exactly V's PID."""
    start_delta_ticks: int | None
    """R's starttime minus V's (None when the PID was not reused)."""
    refusals: tuple[str, ...]
    """Refusal reasons from the signal_members calls (TERM, KILL)."""
    member_delivered: int
    """Signals signal_members reported as delivered (must be 0)."""
    container_delivered: int
    """Processes signal_container(target, KILL) delivered to (variant ``other`` only)."""
    stale_pidfd: str
    """What sending SIGKILL through V's old pidfd did: ``esrch`` or ``delivered``."""
    wrong_signal: bool
    """R received a signal: a delivery was reported, R died before we killed it ourselves, or
    it died of anything but our SIGKILL."""


def _exits_within(pid: int, seconds: float) -> bool:
    """Did our child ``pid`` terminate within ``seconds``? (poll(2) on a pidfd)"""
    fd = os.pidfd_open(pid)
    try:
        ready = readable([fd], seconds)
    finally:
        os.close(fd)
    return bool(ready)


def _one_trial(
    tree: CgroupTree,
    killer: PidfdKiller,
    variant: str,
    cgs: dict[str, ContainerCgroup],
    *,
    mode: str = "wait",
) -> Trial:
    victim_cg = cgs["victim"]
    target = target_for(victim_cg, fake_container_id(1), namespace="team-v", name="victim")
    v = tree.spawn(SLEEP, cgroups=[victim_cg])
    stamp = boot_ticks()
    identity = read_identity(Path("/proc"), v.pid)
    assert identity is not None
    if mode == "wait":
        # Observed at least one tick after it started: a successor starts after V exits, so
        # it cannot share V's starttime (see signals.Observation).
        wait_past_start_tick(identity)
        stamp = boot_ticks()
        identity = read_identity(Path("/proc"), v.pid)
        assert identity is not None
    # bare: a forged stamp claiming V was observed a tick after its start, when it was not.
    observed = Observation(
        identity=identity,
        observed_at_ticks=identity.start_ticks + 1 if mode == "bare" else stamp,
    )
    old_fd = os.pidfd_open(v.pid)
    try:
        r = start_on_its_pid(tree, v, cgs["victim" if variant == "same" else "other"])
        try:
            reused = r.pid == identity.pid
            r_identity = read_identity(Path("/proc"), r.pid)
            delta = (
                r_identity.start_ticks - identity.start_ticks
                if reused and r_identity is not None
                else None
            )
            refusals: list[str] = []
            member_delivered = 0
            for stop in (StopSignal.TERM, StopSignal.KILL):
                report = killer.signal_members([observed], target, stop)
                member_delivered += len(report.delivered)
                refusals.extend(str(x.reason) for x in report.refused)
            delivered = 0
            if variant == "other":
                report = killer.signal_container(target, StopSignal.KILL, wait_seconds=0.0)
                delivered = len(report.delivered)
            try:
                signal.pidfd_send_signal(old_fd, signal.SIGKILL)
                stale = "delivered"
            except ProcessLookupError:
                stale = "esrch"
            # R died before we kill it ourselves? (a pending fatal signal may take a moment)
            died_early = _exits_within(r.pid, 0.005)
        finally:
            if r.poll() is None:
                r.kill()
            r.wait()
        # Any delivery in these trials went to R (V was dead and reaped), and R must have died
        # of *our* SIGKILL, not of an earlier SIGTERM.
        wrong = (
            died_early
            or r.returncode != -signal.SIGKILL
            or member_delivered > 0
            or delivered > 0
            or stale == "delivered"
        )
    finally:
        os.close(old_fd)
    return Trial(
        variant=variant,
        victim=identity.pid,
        reused=reused,
        start_delta_ticks=delta,
        refusals=tuple(refusals),
        member_delivered=member_delivered,
        container_delivered=delivered,
        stale_pidfd=stale,
        wrong_signal=wrong,
    )


MODES = ("wait", "stamp", "bare")
"""How V is observed: ``wait`` until a tick after its start (the normal case for GPU
processes, observed over seconds); ``stamp``: at once, with its ``boot_ticks()`` stamp, so a
same-tick identity is refused as ambiguous; ``bare``: at once, with a forged stamp one tick
after V's start — breaks the ``Observation`` contract on purpose, to measure the limit of a
starttime check."""


def drive(
    *, trials: int, variants: list[str], tree_name: str, mode: str = "wait"
) -> dict[str, object]:
    """Run the trials; returns a summary (and every trial) as a JSON-able dict."""
    killer = PidfdKiller(cgroup_root=CGROUP_MOUNT, proc_root=Path("/proc"))
    started = time.monotonic()
    results: list[Trial] = []
    with CgroupTree(name=tree_name) as tree:
        cgs = dict(zip(("victim", "other"), victim_and_rival_containers(tree), strict=True))
        for n in range(trials):
            variant = variants[n % len(variants)]
            results.append(_one_trial(tree, killer, variant, cgs, mode=mode))
    seconds = time.monotonic() - started
    deltas = [t.start_delta_ticks for t in results if t.start_delta_ticks is not None]
    return {
        "trials": len(results),
        "by_variant": {v: sum(t.variant == v for t in results) for v in variants},
        "reuse_achieved": sum(t.reused for t in results),
        "wrong_signals": sum(t.wrong_signal for t in results),
        "refused_identity_changed": sum(
            t.refusals == (RefusalReason.IDENTITY_CHANGED.value,) * 2 for t in results
        ),
        "member_deliveries": sum(t.member_delivered for t in results),
        "container_deliveries": sum(t.container_delivered for t in results),
        "stale_pidfd_esrch": sum(t.stale_pidfd == "esrch" for t in results),
        "min_start_delta_ticks": min(deltas) if deltas else None,
        "same_tick_reuses": sum(d == 0 for d in deltas),
        "mode": mode,
        "seconds": round(seconds, 3),
        "in_new_pid_namespace": os.getpid() == 1,
        "results": [asdict(t) for t in results],
    }


def run_in_new_pid_namespace(
    *, trials: int, variants: list[str], timeout_seconds: float, mode: str = "wait"
) -> dict[str, object]:
    """``unshare --pid --fork --mount-proc`` this module as the driver; returns its summary."""
    return run_driver_in_new_pid_namespace(
        "tests.kernel.test_pid_reuse",
        "reuse",
        *("--trials", str(trials), "--variants", ",".join(variants), "--mode", mode),
        timeout=timeout_seconds,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--variants", default="other,same")
    parser.add_argument("--tree-name", required=True)
    parser.add_argument("--mode", choices=MODES, default="wait")
    args = parser.parse_args(argv)
    summary = drive(
        trials=args.trials,
        variants=args.variants.split(","),
        tree_name=args.tree_name,
        mode=args.mode,
    )
    print(json.dumps(summary))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
