"""The rig of the forced PID reuse proofs (``test_pid_reuse``: signals; ``test_pin_reuse``:
the resolver's pins): a victim's and a rival pod's container, the victim's exact PID handed to
the next process through ``ns_last_pid``, and the proof's driver run in a fresh PID namespace.

Owns the namespace (``unshare --pid --fork --mount-proc``: ``ns_last_pid`` is written for that
namespace only), the two containers and the reuse step. Must not judge a trial: each proof
reads its own outcome. Writing ``ns_last_pid`` outside a namespace of the driver's own would
steer the host's PIDs: only a driver started by ``run_driver_in_new_pid_namespace`` calls
``start_on_its_pid``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from gpuguard.adapters.killer import boot_ticks
from gpuguard.core.model import ContainerCgroup, ProcessIdentity
from tests.cli_run import run_python_json
from tests.kernel.cgroups import CgroupTree, fake_container_id, require_kernel
from tests.kernel.kill_targets import POD_A, POD_B
from tests.prereq import require

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
