"""The rig of the forced PID reuse proofs (``tests/kernel/test_pid_reuse.py``: signals;
``test_pin_reuse``: the resolver's pins): a victim's and a rival pod's container, the victim's
exact PID handed to the next process through ``ns_last_pid``, and a proof's driver run in a
fresh PID namespace; and the signals proof's driver itself (``drive``, ``MODES``,
``run_in_new_pid_namespace``; ``python -m rigs.pid_reuse --trials N --variants other
--tree-name NAME`` inside the namespace), which the tests run 30 times a variant and
``python -m benchmarks.pid_reuse`` 1000 times.

Owns the namespace (``unshare --pid --fork --mount-proc``: ``ns_last_pid`` is written for that
namespace only), the two containers and the reuse step. Must not judge a trial: each proof
reads its own outcome (the driver counts trials, ``wrong_signal`` included; the test or the
benchmark judges the counts). Writing ``ns_last_pid`` outside a namespace of the driver's own would
steer the host's PIDs: only a driver started by ``run_driver_in_new_pid_namespace`` calls
``start_on_its_pid``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuguard.adapters.killer import Observation, PidfdKiller, boot_ticks
from gpuguard.adapters.procfs import read_identity
from gpuguard.adapters.readiness import readable
from gpuguard.core.model import ContainerCgroup, ProcessIdentity, RefusalReason, StopSignal
from rigs.cgroups import CGROUP_MOUNT, CgroupTree, fake_container_id, require_kernel
from rigs.cli_run import run_python_json
from rigs.kill_targets import POD_A, POD_B, target_for
from rigs.prereq import require

POD_V = POD_A
"""The victim's pod (the one ``kill_targets.target_for`` names)."""
POD_R = POD_B
"""The rival's pod: another pod's container that may be handed the victim's PID."""
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
SLEEP = ["sleep", "1000"]


def require_unshare() -> None:
    """``require`` root, cgroup v2 and ``unshare`` (util-linux)."""
    require_kernel(((2, ""),))
    require(shutil.which("unshare") is not None, "unshare (util-linux) not installed")


def run_driver_in_new_pid_namespace(
    module: str, proof: str, *args: str, timeout: float
) -> dict[str, Any]:
    """``python -m MODULE ARGS --tree-name NAME`` as PID 1's child of a fresh PID namespace
    with its own /proc: its JSON summary. ``proof`` names the cgroup tree (``reuse``, ``pins``)."""
    tree_name = f"gpuguard-test-{os.getpid()}-{proof}-{time.monotonic_ns()}"
    summary: dict[str, Any] = run_python_json(
        "-m",
        module,
        *args,
        "--tree-name",
        tree_name,
        wrapper=["unshare", "--pid", "--fork", "--mount-proc"],
        timeout=timeout,
    )
    return summary


def victim_and_rival_containers(tree: CgroupTree) -> tuple[ContainerCgroup, ContainerCgroup]:
    """Pod V's container 1 and pod R's container 2: cgroup v2, systemd driver, Burstable,
    containerd."""

    def container(pod_uid: str, n: int) -> ContainerCgroup:
        return tree.container(
            version=2,
            driver="systemd",
            qos="burstable",
            runtime="containerd",
            pod_uid=pod_uid,
            container_id=fake_container_id(n),
        )

    return container(POD_V, 1), container(POD_R, 2)


def wait_past_start_tick(identity: ProcessIdentity) -> None:
    """Return once the clock has left the tick ``identity`` started in: an observation from
    then on cannot be confused with a same-tick successor's (``signals.Observation``)."""
    while boot_ticks() <= identity.start_ticks:
        time.sleep(0.002)


def start_on_its_pid(
    tree: CgroupTree, victim: subprocess.Popen[bytes], cg: ContainerCgroup
) -> subprocess.Popen[bytes]:
    """SIGKILL and reap ``victim``, set ``ns_last_pid`` one below its PID, and start a
    ``sleep`` in ``cg``, which the kernel gives the victim's PID (the caller checks that it
    did)."""
    victim.kill()
    victim.wait()
    NS_LAST_PID.write_text(str(victim.pid - 1))
    return tree.spawn(SLEEP, cgroups=[cg])


# ---------------------------------------------------------------------------------------------
# The signals proof's driver (runs inside the new PID namespace)


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
        "rigs.pid_reuse",
        "reuse",
        *("--trials", str(trials), "--variants", ",".join(variants), "--mode", mode),
        timeout=timeout_seconds,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The forced-PID-reuse signals proof's driver.")
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


if __name__ == "__main__":
    sys.exit(main())
